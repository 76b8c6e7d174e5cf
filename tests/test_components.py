"""Card, versioning, data and rewards: the small pieces, each on its own."""

import json

import pytest
import torch

from tests.helpers import read_metrics, run_cli
from unirl_pl.card import LOOPS, MODES, Card, CardError
from unirl_pl.data import PromptDataModule, _PromptStream, load_prompts
from unirl_pl.experts import TextEncoderExpert
from unirl_pl.method import AdvantageConfig, GroupLayout, check_scheme
from unirl_pl.rewards import ContainsWord, RefinerFormat, WeightedSum, jpeg_compressibility, resolve_reward
from unirl_pl.versioning import FeatureCache, VersionLedger


# ---------------------------------------------------------------- card
def test_unified_card_binds_two_experts_and_validates_every_mode():
    card = Card.unified()
    assert card.loops == {"diffusion_denoise": ["transformer"], "ar_decode": ["llm"]}
    for mode in ("joint", "prompt_only", "generator_only"):
        card.validate(mode)
    assert card.trained_components("joint") == ["llm", "transformer"]
    assert card.trained_components("prompt_only") == ["llm"]
    assert card.trained_components("generator_only") == ["transformer"]
    # Every mode runs every loop the card declares; a card without a refiner runs none.
    assert all(card.runs_loop(mode, loop) for mode in MODES for loop in LOOPS)
    assert not Card.unified(has_llm=False).runs_loop("generator_only", "ar_decode")


def test_card_rejects_undeclared_components_missing_loops_and_bad_modes():
    with pytest.raises(CardError, match="undeclared component 'llm'"):
        Card({"transformer": "expert"}, {"ar_decode": ["llm"], "diffusion_denoise": ["transformer"]}).validate("joint")
    with pytest.raises(CardError, match="needs loop 'ar_decode'"):
        Card.unified(has_llm=False).validate("joint")
    with pytest.raises(CardError, match="unknown mode"):
        Card.unified().validate("both")


def test_a_shared_weight_card_is_expressible():
    """A mixture-of-transformers card binds one component to both loops."""
    card = Card({"mot": "expert", "text_encoder": "frozen"}, {"ar_decode": ["mot"], "diffusion_denoise": ["mot"]})
    card.validate("joint")
    assert card.trained_components("joint") == ["mot"]


# ---------------------------------------------------------------- versioning
def _encoder(calls):
    def encode(texts):
        calls.append(list(texts))
        return {"f": torch.stack([torch.full((2,), float(len(t))) for t in texts])}

    return encode


def test_a_group_encodes_its_prompt_once_and_llm_updates_keep_the_cache_warm():
    ledger = VersionLedger(["llm", "transformer", "text_encoder"])
    cache = FeatureCache(ledger)
    calls: list[list[str]] = []
    feats = cache.get_or_compute("text_encoder", ["a", "a", "a", "bb"], _encoder(calls))["f"]
    # Both misses in one call of the fixed encode shape (8 rows, padded by repeating the last miss).
    assert calls == [["a", "bb"] + ["bb"] * 6] and feats.shape == (4, 2)
    assert feats[:, 0].tolist() == [1.0, 1.0, 1.0, 2.0]
    ledger.bump("llm")
    ledger.bump("transformer")
    cache.get_or_compute("text_encoder", ["a", "bb"], _encoder(calls))
    assert len(calls) == 1, "an llm/transformer update must not invalidate the text encoder's features"
    assert cache.hit_rate() == pytest.approx(4 / 6)
    ledger.bump("text_encoder")
    cache.get_or_compute("text_encoder", ["a"], _encoder(calls))
    assert calls[-1] == ["a"] * 8, "a text_encoder version change invalidates its features"


@pytest.mark.slow
def test_cache_size_and_offload_are_the_rollout_settings_and_offloaded_rows_are_host_copies():
    from tests.helpers import TINY
    from unirl_pl.cli import main
    from unirl_pl.loops import RolloutConfig

    args = ["--config", TINY, "--trainer.logger=false", "--trainer.callbacks=[]"]
    cli = main([*args, "--model.rollout.feature_cache_size=3", "--model.rollout.feature_cache_offload=true"], run=False)
    cache = cli.model.conditioning.cache
    assert cache.max_entries == 3 and cache.offload
    assert not main(args, run=False).model.conditioning.cache.offload
    calls: list[list[str]] = []
    texts = ["a", "bb", "ccc", "dddd"]
    got = cache.get_or_compute("text_encoder", texts, _encoder(calls))["f"]
    kept = FeatureCache(VersionLedger(["text_encoder"])).get_or_compute("text_encoder", texts, _encoder([]))["f"]
    assert torch.equal(got, kept), "offloading changes where rows live, never their values"
    assert len(cache) == 3, "least recently used rows leave beyond feature_cache_size"
    assert got.device == cache.device
    for row in cache._store.values():
        assert row["f"].device.type == "cpu"
        # A kept row owns its storage: a view would hold its whole encode batch (8 rows) alive.
        assert row["f"].untyped_storage().nbytes() == row["f"].numel() * row["f"].element_size()
    with pytest.raises(ValueError, match="feature_cache_size"):
        RolloutConfig(feature_cache_size=0)


def test_cached_features_do_not_depend_on_what_missed_with_them():
    """A cold cache (after a resume) must condition the generator exactly as the warm one did."""
    encoder = TextEncoderExpert()
    encoder.build()

    def compute(texts):
        hidden, pooled = encoder.encode(texts)
        return {"hidden": hidden, "pooled": pooled}

    alone = FeatureCache(VersionLedger(["text_encoder"])).get_or_compute("text_encoder", ["a red circle"], compute)
    crowd = ["two blue squares", "a red circle", "a green triangle left of a circle"]
    mixed = FeatureCache(VersionLedger(["text_encoder"])).get_or_compute("text_encoder", crowd, compute)
    for name in ("hidden", "pooled"):
        assert torch.equal(alone[name][0], mixed[name][1]), name


def test_ledger_round_trips_and_refuses_unknown_components():
    ledger = VersionLedger(["llm"])
    ledger.bump("llm")
    other = VersionLedger(["llm"])
    other.load(ledger.as_dict())
    assert other["llm"] == 1
    with pytest.raises(KeyError):
        other.load({"vae": 3})


# ---------------------------------------------------------------- data
def test_prompt_sources(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_text("a red circle\n\ntwo blue squares\n")
    assert load_prompts(str(txt)) == ["a red circle", "two blue squares"]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps({"prompt": "x"}) + "\n" + json.dumps({"text": "y"}) + "\n")
    with pytest.raises(ValueError, match=r"p.jsonl:2: each JSONL row needs a string field 'prompt'"):
        load_prompts(str(jsonl))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_prompts(str(tmp_path / "missing.txt"))
    assert len(load_prompts(None)) >= 4


def test_prompt_stream_shards_union_equals_single_process_and_resumes():
    prompts = [f"p{i}" for i in range(7)]
    single = iter(_PromptStream(prompts, 4, seed=3, rank=0, world=1, start_step=0, layout=GroupLayout()))
    ranks = [
        iter(_PromptStream(prompts, 4, seed=3, rank=r, world=2, start_step=0, layout=GroupLayout())) for r in range(2)
    ]
    for _ in range(5):
        whole = next(single)
        parts = [next(it) for it in ranks]
        assert parts[0].prompts + parts[1].prompts == whole.prompts
        assert parts[0].request_ids + parts[1].request_ids == whole.request_ids
    resumed = next(iter(_PromptStream(prompts, 4, seed=3, rank=0, world=1, start_step=5, layout=GroupLayout())))
    assert resumed.prompts == next(single).prompts


def test_bad_scheme_and_layout_settings_are_refused():
    with pytest.raises(ValueError, match="images_per_refinement >= 2"):
        check_scheme(AdvantageConfig(scheme="hierarchical"), GroupLayout(images_per_refinement=1))
    check_scheme(AdvantageConfig(scheme="hierarchical"), GroupLayout(images_per_refinement=2))
    with pytest.raises(ValueError, match="scheme"):
        AdvantageConfig(scheme="per_image")
    with pytest.raises(ValueError, match="samples_per_prompt"):
        PromptDataModule(samples_per_prompt=1)
    with pytest.raises(ValueError, match="num_skip_refinement"):
        PromptDataModule(samples_per_prompt=2, num_skip_refinement=2)
    with pytest.raises(ValueError, match="prompts_per_step"):
        PromptDataModule(prompts_per_step=0)
    with pytest.raises(ValueError, match="val_batch_size"):
        PromptDataModule(val_batch_size=0)
    with pytest.raises(ValueError, match="val_images_per_prompt"):
        PromptDataModule(val_images_per_prompt=0)


def test_val_seed_fixes_validation_noise_and_leaves_training_to_seed():
    prompts = ["a red circle", "a blue square", "two cyan triangles"]

    def seeds(**kwargs):
        dm = PromptDataModule(prompts=prompts, val_prompts=prompts, val_batch_size=2, **kwargs)
        train = next(iter(dm.train_dataloader()))
        return train.seed, [b.seed for b in dm.val_dataloader()], [b.seed for b in dm.predict_dataloader()]

    assert seeds(seed=3) == (3, [3, 3], [3, 3])  # null: the run's seed everywhere
    assert seeds(seed=3, val_seed=0) == (3, [0, 0], [0, 0])
    assert seeds(seed=5, val_seed=0)[1:] == seeds(seed=3, val_seed=0)[1:]


def test_val_images_per_prompt_scores_every_prompt_on_that_many_noises():
    prompts = ["a red circle", "a blue square", "two cyan triangles"]

    def flat(loader):
        batches = list(loader)
        return [q for b in batches for q in b.prompts], [i for b in batches for i in b.request_ids]

    one = PromptDataModule(prompts=prompts, val_prompts=prompts, val_batch_size=2, val_seed=0)
    four = PromptDataModule(prompts=prompts, val_prompts=prompts, val_batch_size=2, val_seed=0, val_images_per_prompt=4)
    assert flat(one.val_dataloader()) == (prompts, [-1, -2, -3])
    texts, ids = flat(four.val_dataloader())
    assert texts == prompts * 4
    # Every image its own request id (its own noise); the first of each prompt is the single-image draw.
    assert sorted(ids, reverse=True) == list(range(-1, -13, -1))
    assert ids[:3] == [-1, -2, -3]
    assert flat(four.predict_dataloader()) == flat(one.predict_dataloader())  # predict: one image a prompt


def test_group_layout_index_math():
    layout = GroupLayout(samples_per_prompt=3, num_skip_refinement=1, images_per_refinement=2)
    assert layout.text_prompt(2).tolist() == [0, 0, 0, 1, 1, 1]
    assert layout.refined_rows(2, refine=True) == [1, 2, 4, 5]
    assert layout.refined_rows(2, refine=False) == []
    assert layout.image_text(2).tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert layout.image_sample_index(1) == [0, 1, 2, 3, 4, 5]


# ---------------------------------------------------------------- rewards
def my_reward(prompts, refined_prompts, images):
    return [float(len(r)) for r in refined_prompts]


def test_weighted_sum_with_registry_and_dotted_path_rewards():
    fn = WeightedSum({"contains_word": 2.0, "tests.test_components.my_reward": 0.5}, {"contains_word": {"word": "red"}})
    total, parts = fn(["p", "p"], ["a red box", "blue"], torch.zeros(2, 3, 4, 4))
    assert parts["contains_word"].tolist() == [1.0, 0.0]
    assert total.tolist() == pytest.approx([2.0 + 4.5, 2.0])


def test_reward_errors_are_specific():
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        resolve_reward("nope")
    with pytest.raises(ValueError, match="cannot import"):
        resolve_reward("nowhere.module.fn")
    with pytest.raises(ValueError, match="bad reward_args"):
        resolve_reward("contains_word", {"colour": "red"})
    with pytest.raises(ValueError, match="not in the weights"):
        WeightedSum({"brightness": 1.0}, {"contains_word": {"word": "x"}})
    bad = WeightedSum({"tests.test_components.my_reward": 1.0})
    bad.terms["tests.test_components.my_reward"] = lambda p, r, i: [1.0]
    with pytest.raises(ValueError, match="returned 1 values for 2 samples"):
        bad(["a", "b"], ["a", "b"], torch.zeros(2, 3, 4, 4))


def test_jpeg_compressibility_prefers_flat_images():
    flat = torch.full((1, 3, 32, 32), 0.5)
    noise = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    scores = jpeg_compressibility(["", ""], ["", ""], torch.cat([flat, noise]))
    assert scores[0] > scores[1]


def test_refiner_format_and_contains_word():
    fmt = RefinerFormat(min_words=2, max_words=4, max_repeats=2)
    assert fmt([""] * 4, ["a b c", "a", "a b c d e f g", "x x x"], None) == pytest.approx(
        [1.0, 0.6065, 0.2231, 0.0], abs=1e-3
    )
    assert ContainsWord("Red")(["", ""], ["a RED box", "reddish"], None) == [1.0, 0.0]


# ---------------------------------------------------------------- plugin check
@pytest.mark.slow
def test_plugin_callback_loads_by_class_path_from_a_recipe(tmp_path):
    cli = run_cli(
        tmp_path,
        "--trainer.max_steps=2",
        "--trainer.limit_val_batches=0",
        "--trainer.callbacks+=callbacks.reward_range.RewardRangeCheck",
        "--trainer.callbacks.low=0.0",
        "--trainer.callbacks.high=1.0",
    )
    check = [c for c in cli.trainer.callbacks if type(c).__name__ == "RewardRangeCheck"]
    assert check and check[0].checked == 2
    assert len(read_metrics(cli)) >= 2


@pytest.mark.slow
def test_plugin_callback_fires_on_a_reward_outside_its_range(tmp_path):
    with pytest.raises(ValueError, match="outside"):
        run_cli(
            tmp_path,
            "--trainer.max_steps=1",
            "--trainer.limit_val_batches=0",
            "--trainer.callbacks+=callbacks.reward_range.RewardRangeCheck",
            "--trainer.callbacks.low=0.9",
            "--trainer.callbacks.high=1.0",
        )


def test_a_mixture_of_transformers_card_binds_one_component_to_both_loops():
    card = Card({"mot": "expert", "text_encoder": "frozen"}, {"ar_decode": ["mot"], "diffusion_denoise": ["mot"]})
    card.validate("joint")
    assert card.trained_components("joint") == ["mot"], "one expert, trained once, by both loops"
    assert card.loops_of("mot") == ["ar_decode", "diffusion_denoise"]
    assert card.owner("ar_decode") == card.owner("diffusion_denoise") == "mot"
    assert card.trained_components("generator_only") == ["mot"]
    with pytest.raises(CardError, match="binds no expert"):
        Card({"enc": "frozen"}, {"diffusion_denoise": ["enc"]}).owner("diffusion_denoise")
