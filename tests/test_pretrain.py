"""Pretraining modules (flow matching, refiner SFT) and the shipped ShapesWorld checkpoints."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from unirl_pl.experts import CausalLMExpert, FlowTransformerExpert, TextEncoderExpert, TinyCausalLMExpert
from unirl_pl.pretrain import FlowMatchingPretrain, RefinerSFT, build_shapes_tokenizer
from unirl_pl.pretrain.data import ParaphraseDataModule, pair_batch, scene_batch, uncolored
from unirl_pl.pretrain.evaluate import DEFAULT_ASSETS, generate, load_experts, refine
from unirl_pl.pretrain.flow import flow_targets
from unirl_pl.pretrain.refiner import IGNORE, sft_batch
from unirl_pl.rewards.shapes import ShapesGenEval
from unirl_pl.sampling import flow_sigmas, ode_step
from unirl_pl.shapes import SHAPES_WORDS, make_prompt_set


def _trainer(steps: int) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )


class _Repeat(pl.LightningDataModule):
    """One fixed batch forever, so a few steps must lower its loss (memorization, not luck)."""

    def __init__(self, batch: dict) -> None:
        super().__init__()
        self.batch = batch

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader([self.batch] * 1000, batch_size=None)


def test_flow_targets_follow_the_sampler_convention() -> None:
    # With the exact velocity, Euler steps from sigma 1 to 0 must land on the data: a sign error
    # in the target (x0 - eps) would walk away from it.
    x0, eps = torch.randn(2, 3, 8, 8), torch.randn(2, 3, 8, 8)
    x, _ = flow_targets(x0, eps, torch.ones(2))
    sigmas = flow_sigmas(4)
    for i in range(4):
        s = torch.full((2,), float(sigmas[i]))
        _, v = flow_targets(x0, eps, s)
        x = ode_step(x, v, float(sigmas[i]), float(sigmas[i + 1]))
    torch.testing.assert_close(x, x0, atol=1e-5, rtol=0)


def test_tokenizer_covers_every_shapes_word() -> None:
    tok = build_shapes_tokenizer()
    ids = tok(" ".join(SHAPES_WORDS), add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids


def test_sft_batch_puts_loss_on_caption_and_eos_only() -> None:
    tok = build_shapes_tokenizer()
    enc = sft_batch(tok, ["render one ball", "a ball"], ["a circle", "a circle"])
    assert enc["labels"][0].tolist() == [IGNORE] * 3 + tok("a circle")["input_ids"] + [tok.eos_token_id]
    assert enc["labels"][1].tolist()[-1] == IGNORE and enc["attention_mask"][1].tolist()[-1] == 0


def _flow_loss(module: FlowMatchingPretrain, batch: dict) -> float:
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(0)
        hidden, pooled = module.encode(batch["captions"])
        sigma = torch.sigmoid(torch.randn(len(batch["captions"])))
        x_s, target = flow_targets(batch["images"], torch.randn_like(batch["images"]), sigma)
        return torch.nn.functional.mse_loss(module.transformer.velocity(x_s, sigma, hidden, pooled), target).item()


@pytest.mark.parametrize("train_text_encoder", [False, True])
def test_flow_pretrain_lowers_loss_and_exports_loadable_folders(tmp_path: Path, train_text_encoder: bool) -> None:
    module = _tiny_flow_module(train_text_encoder=train_text_encoder, warmup_steps=1)
    text_before = {k: v.clone() for k, v in module.text_encoder.model.state_dict().items()}
    batch = scene_batch(seed=0, step=0, batch_size=8)
    before = _flow_loss(module, batch)
    _trainer(25).fit(module, datamodule=_Repeat(batch))
    after = _flow_loss(module, batch)
    assert after < 0.7 * before, (before, after)
    text_moved = max((v - text_before[k]).abs().max().item() for k, v in module.text_encoder.model.state_dict().items())
    assert (text_moved > 1e-4) if train_text_encoder else (text_moved == 0), text_moved

    module.export(tmp_path)
    loaded = FlowTransformerExpert(pretrained_path=str(tmp_path), subfolder="transformer")
    text = TextEncoderExpert(pretrained_path=str(tmp_path / "text_encoder"))
    loaded.build()
    text.build()
    hidden, pooled = text.encode(["a verdant arrowhead"])  # a word DEFAULT_WORDS lacks
    torch.testing.assert_close(hidden, module.text_encoder.encode(["a verdant arrowhead"])[0])
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.velocity(x, 0.5, hidden, pooled), module.transformer.velocity(x, 0.5, hidden, pooled)
        )


def _sft_loss(module: RefinerSFT, batch: dict) -> float:
    enc = sft_batch(module.llm.tokenizer, batch["prompts"], batch["captions"])
    with torch.no_grad():
        logits = module.llm(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), enc["labels"][:, 1:].flatten(), ignore_index=IGNORE
    ).item()


def test_refiner_sft_lowers_loss_and_exports_a_loadable_lm(tmp_path: Path) -> None:
    module = RefinerSFT(
        TinyCausalLMExpert(
            hidden_size=32,
            num_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            intermediate_size=64,
            initializer_range=0.05,
        ),
        lr=1e-2,
        warmup_steps=1,
    )
    module.configure_model()
    batch = pair_batch(seed=0, step=0, batch_size=16)
    before = _sft_loss(module, batch)
    _trainer(25).fit(module, datamodule=_Repeat(batch))
    after = _sft_loss(module, batch)
    assert after < 0.5 * before, (before, after)

    module.export(tmp_path)
    loaded = CausalLMExpert(pretrained_path=str(tmp_path / "refiner"))
    loaded.build()  # adds a zero-initialized LoRA, exactly as an RL run does
    assert (
        loaded.tokenizer("a verdant arrowhead")["input_ids"] == module.llm.tokenizer("a verdant arrowhead")["input_ids"]
    )
    enc = sft_batch(loaded.tokenizer, batch["prompts"], batch["captions"])
    with torch.no_grad():
        got = loaded(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
        want = module.llm(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
    torch.testing.assert_close(got, want)


# ---------------------------------------------------------------- the shipped checkpoints


@pytest.fixture(scope="module")
def shipped():
    for part in ("transformer", "text_encoder", "refiner"):
        assert (DEFAULT_ASSETS / part).is_dir(), f"missing shipped checkpoint {DEFAULT_ASSETS / part}"
    # The main recipe's serve path: 10 ODE steps at the shipped shift, no guidance.
    return load_experts(DEFAULT_ASSETS, num_steps=10, guidance_scale=1.0)


def test_shipped_assets_are_small_safetensors() -> None:
    files = [p for p in DEFAULT_ASSETS.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) < 20 * 2**20
    assert not [p for p in files if p.suffix in (".bin", ".pt", ".ckpt")]


@pytest.mark.slow
def test_shipped_dit_follows_canonical_captions_far_above_chance(shipped) -> None:
    # Chance = the same generator and noise drawing a different scene's caption (rolled by 3, another
    # category), scored against this one: what a model ignoring its prompt would get. Strict scores on
    # the 120 prompts of scripts/eval_shapes.py's composition split (measured 0.62 vs 0.04; the first 48
    # alone, the ablation's validation set, give 0.54 vs 0.02).
    rows = make_prompt_set(120, 1000, "composition")
    prompts, captions = [r["prompt"] for r in rows], [r["caption"] for r in rows]
    scorer = ShapesGenEval("strict")
    right = sum(scorer(prompts, prompts, generate(shipped, captions))) / len(rows)
    wrong = sum(scorer(prompts, prompts, generate(shipped, captions[3:] + captions[:3]))) / len(rows)
    assert right >= 0.6 and wrong <= 0.2, (right, wrong)


def test_drop_colors_strips_that_fraction_of_captions_and_nothing_else() -> None:
    assert uncolored("a red circle left of a cyan square") == "a circle left of a square"
    assert uncolored("three blue squares") == "three squares" and uncolored("a circle") == "a circle"
    clean = pair_batch(seed=0, step=3, batch_size=400)
    noisy = pair_batch(seed=0, step=3, batch_size=400, drop_colors=0.6)
    # Off is the old stream exactly, and the flaw never touches the prompts.
    assert pair_batch(seed=0, step=3, batch_size=400, drop_colors=0.0) == clean
    assert noisy["prompts"] == clean["prompts"]
    assert all(n in (c, uncolored(c)) for n, c in zip(noisy["captions"], clean["captions"], strict=True))
    changed = sum(n != c for n, c in zip(noisy["captions"], clean["captions"], strict=True))
    colored = sum(c != uncolored(c) for c in clean["captions"])
    assert 0.5 < changed / colored < 0.7, changed / colored
    everything = pair_batch(seed=0, step=3, batch_size=400, drop_colors=1.0)["captions"]
    assert everything == [uncolored(c) for c in clean["captions"]]
    with pytest.raises(ValueError, match="drop_colors"):
        ParaphraseDataModule(drop_colors=1.5)


def test_shipped_refiner_rewrites_structure_right_and_drops_colors(shipped) -> None:
    """The shipped refiner's designed flaw (recipe: data.drop_colors): scenes right, colors mostly dropped."""
    rows = make_prompt_set(48, 7, "train")
    refined = refine(shipped, [r["prompt"] for r in rows])
    pairs = list(zip(refined, [r["caption"] for r in rows], strict=True))
    plain = [(a, c) for a, c in pairs if c == uncolored(c)]
    colored = [(a, c) for a, c in pairs if c != uncolored(c)]
    assert sum(a == c for a, c in plain) / len(plain) >= 0.8, plain
    # Greedy decoding leaves the colors out: a mistake shared by every colored prompt.
    assert sum(a == uncolored(c) for a, c in colored) / len(colored) >= 0.6, colored
    assert sum(a == c for a, c in colored) / len(colored) <= 0.25, colored


def _tiny_flow_module(**kwargs) -> FlowMatchingPretrain:
    dit = FlowTransformerExpert(
        sample_size=32,
        patch_size=8,
        in_channels=3,
        num_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        caption_projection_dim=32,
        pooled_projection_dim=32,
    )
    kwargs = {"lr": 3e-3, "warmup_steps": 5, "caption_dropout": 0.0} | kwargs
    module = FlowMatchingPretrain(dit, TextEncoderExpert(), **kwargs)
    module.configure_model()
    return module


def test_ema_is_the_warmed_up_average_and_is_what_gets_exported(tmp_path: Path) -> None:
    module = _tiny_flow_module(ema_decay=0.9, fingerprint_every=0)
    history = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            history.append([p.detach().clone() for p in pl_module.trained_parameters()])

    trainer = _trainer(6)
    trainer.callbacks.append(Record())
    trainer.fit(module, datamodule=_Repeat(scene_batch(seed=0, step=0, batch_size=4)))
    # The callback runs after the module's hook, at the same step: rebuild the average by hand.
    expected = [p.clone() for p in history[0]]
    for n, params in enumerate(history[1:], start=2):  # n = optimizer steps done
        decay = min(0.9, (1 + n) / (10 + n))
        expected = [e + (1 - decay) * (p - e) for e, p in zip(expected, params, strict=True)]
    for got, want in zip(module._ema, expected, strict=True):
        torch.testing.assert_close(got, want)
    live = [p.detach().clone() for p in module.trained_parameters()]
    assert max((a - b).abs().max().item() for a, b in zip(live, module._ema, strict=True)) > 1e-4
    module.export(tmp_path)
    exported = FlowTransformerExpert(pretrained_path=str(tmp_path), subfolder="transformer")
    exported.build()
    name = next(n for n, _ in module.transformer.model.named_parameters())  # the patch embedding: no LoRA
    torch.testing.assert_close(exported.model.state_dict()[name], module._ema[0])
    # The live weights are back after the export.
    for a, b in zip(live, module.trained_parameters(), strict=True):
        assert torch.equal(a, b.detach())


def test_shift_moves_training_sigmas_and_the_validation_schedule_up() -> None:
    seen: dict[float, list[float]] = {}
    for shift in (1.0, 3.0):
        module = _tiny_flow_module(shift=shift)
        calls: list[float] = []
        velocity = module.transformer.velocity

        def spy(x, sigma, hidden, pooled, _calls=calls, _velocity=velocity):
            _calls += torch.as_tensor(sigma).reshape(-1).tolist()
            return _velocity(x, sigma, hidden, pooled)

        module.transformer.velocity = spy
        module.log = lambda *a, **k: None
        torch.manual_seed(0)
        module.training_step(scene_batch(seed=0, step=0, batch_size=64), 0)
        seen[shift] = calls
        calls.clear()
        module.sample(["a red circle"], num_steps=4)
        assert calls[1] == pytest.approx(shift * 0.75 / (1 + (shift - 1) * 0.75))
    plain, shifted = torch.tensor(seen[1.0]), torch.tensor(seen[3.0])
    # Same draws, mapped by s -> 3s / (1 + 2s): every sigma moves up, the median from 0.5 to 0.75.
    torch.testing.assert_close(shifted, 3 * plain / (1 + 2 * plain))
    assert shifted.median() > plain.median() + 0.15


def test_fingerprints_of_a_short_run_match_the_long_run_inside_the_warmup(tmp_path: Path) -> None:
    def run(steps: int) -> dict[str, str]:
        torch.manual_seed(0)
        module = _tiny_flow_module(fingerprint_every=2)
        _trainer(steps).fit(module, datamodule=_Repeat(scene_batch(seed=0, step=0, batch_size=4)))
        return module.fingerprints

    short, long = run(4), run(8)
    assert set(short) == {"2", "4"} and set(long) == {"2", "4", "6", "8"}
    assert short["4"] == long["4"] and long["4"] != long["6"]
