"""Rewards as components: a term is a ``class_path`` with typed ``init_args`` and a weight, checked when the
recipe is parsed; the short form (registry name -> weight, ``reward_args``) stays as an alias of the same terms."""

from __future__ import annotations

import importlib

import pytest
import torch

from unirl_pl.cli import ConfigError, parse_config
from unirl_pl.plan.recipe import _rewards
from unirl_pl.rewards import REGISTRY, Brightness, ContainsWord, Reward, RewardTerm, WeightedSum

JOINT = ["--config", "recipes/joint.yaml"]


def _component(reward: str, weight: float, **init_args: object) -> str:
    args = ", ".join(f"{k}: {v}" for k, v in init_args.items())
    return f"{{reward: {{class_path: {reward}, init_args: {{{args}}}}}, weight: {weight}}}"


def test_a_misspelt_or_mistyped_reward_argument_is_refused_when_the_recipe_is_parsed():
    bad_name = _component("unirl_pl.rewards.ContainsWord", 1.0, wrod="red")
    with pytest.raises(ConfigError, match="wrod"):
        parse_config([*JOINT, f"--model.rewards=[{bad_name}]"])
    bad_type = _component("unirl_pl.rewards.RefinerFormat", 1.0, max_words="many")
    with pytest.raises(ConfigError, match="max_words"):
        parse_config([*JOINT, f"--model.rewards=[{bad_type}]"])
    with pytest.raises(ConfigError, match="NoSuchReward"):
        parse_config([*JOINT, f"--model.rewards=[{_component('unirl_pl.rewards.NoSuchReward', 1.0)}]"])


def test_the_main_recipe_gives_its_reward_as_a_component():
    config = parse_config(JOINT)
    (term,) = config.model.init_args.rewards
    assert term.reward.class_path == "unirl_pl.rewards.ShapesGenEval"
    assert term.reward.init_args.penalize_requested_extra is True and term.weight == 1.0
    assert config.model.init_args.reward_args is None


def test_both_forms_build_the_same_terms_and_the_same_reward():
    images = torch.rand(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    prompts, refined = ["a"] * 4, ["a red b", "blue", "red", "x"]
    short = WeightedSum({"contains_word": 0.5, "brightness": 2.0}, {"contains_word": {"word": "red"}})
    components = WeightedSum([RewardTerm(ContainsWord(word="red"), weight=0.5), RewardTerm(Brightness(), weight=2.0)])
    assert components.weights == short.weights == {"contains_word": 0.5, "brightness": 2.0}
    total_s, parts_s = short(prompts, refined, images)
    total_c, parts_c = components(prompts, refined, images)
    assert torch.equal(total_s, total_c) and parts_s.keys() == parts_c.keys()
    renamed = WeightedSum([RewardTerm(Brightness(channel=0), weight=1.0, name="red_channel")])
    assert list(renamed.terms) == ["red_channel"]


def test_a_term_given_without_a_weight_weighs_one_and_the_total_is_its_values():
    # Every recipe and test names a weight, so a wrong default would go unseen without this.
    assert RewardTerm(Brightness()).weight == 1.0
    images = torch.rand(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    prompts, refined = ["a"] * 4, ["a"] * 4
    reward = WeightedSum([RewardTerm(Brightness())])
    assert reward.weights == {"brightness": 1.0}
    total, parts = reward(prompts, refined, images)
    alone = torch.as_tensor(Brightness()(prompts, refined, images), dtype=total.dtype)
    assert torch.equal(total, alone) and torch.equal(parts["brightness"], alone)
    assert total.abs().sum() > 0, "a zero weight would give a zero total"
    # The same default when a recipe gives the term without a weight.
    term = "{reward: {class_path: unirl_pl.rewards.Brightness}}"
    (parsed,) = parse_config([*JOINT, f"--model.rewards=[{term}]"]).model.init_args.rewards
    assert parsed.weight == 1.0


def test_component_terms_refuse_what_would_merge_or_be_ignored():
    with pytest.raises(ValueError, match="two reward terms are named 'brightness'"):
        WeightedSum([RewardTerm(Brightness()), RewardTerm(Brightness(channel=1))])
    with pytest.raises(ValueError, match="reward_args is for the short form"):
        WeightedSum([RewardTerm(Brightness())], {"brightness": {"channel": 1}})
    with pytest.raises(ValueError, match="finite"):
        WeightedSum([RewardTerm(Brightness(), weight=float("nan"))])
    with pytest.raises(ValueError, match="must be a RewardTerm"):
        WeightedSum([Brightness()])  # type: ignore[list-item]


def _registered_class(alias: str) -> type:
    factory = REGISTRY[alias]
    if isinstance(factory, type):
        return factory
    return getattr(importlib.import_module(factory.__module__), factory.__name__)


@pytest.mark.parametrize("alias", sorted(REGISTRY))
def test_every_registered_reward_is_a_component_logged_under_its_alias(alias):
    """A recipe moved from the short form to components keeps its metric names (``reward/<alias>``)."""
    cls = _registered_class(alias)
    assert issubclass(cls, Reward) and cls.name == alias


def test_plan_reads_component_terms_with_their_class_and_arguments():
    config = parse_config(JOINT)
    model = config.model.init_args.as_dict()
    read = _rewards(model)
    assert read == {
        "rewards": {"shapes_geneval": {"score": "soft", "penalize_extra": False, "penalize_requested_extra": True}},
        "reward_paths": {"shapes_geneval": "unirl_pl.rewards.ShapesGenEval"},
    }
    short = parse_config(
        [*JOINT, "--model.rewards={pickscore: 1.0}", "--model.reward_args={pickscore: {batch_size: 4}}"]
    )
    assert _rewards(short.model.init_args.as_dict()) == {
        "rewards": {"pickscore": {"batch_size": 4}},
        "reward_paths": {},
    }


@pytest.mark.parametrize("form", ["short", "component"])
def test_plan_names_the_in_process_rewards_it_does_not_count(form):
    from unirl_pl.plan.rewards import planned_rewards

    paths = {"hpsv3": "unirl_pl.rewards.HPSv3"} if form == "component" else None
    (term,) = planned_rewards({"hpsv3": {}}, None, paths)
    assert "NOT counted" in term.line() and term.untraced and not term.on_device, term.line()


@pytest.mark.parametrize("form", ["short", "component"])
def test_plan_counts_imagerewards_blip_on_the_device_and_traces_its_scoring(form):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from unirl_pl.plan.rewards import planned_rewards, reward_models, score
    from unirl_pl.rewards.imagereward import imagereward_blip_config

    mode = FakeTensorMode()
    paths = {"imagereward": "unirl_pl.rewards.ImageReward"} if form == "component" else None
    (term,) = planned_rewards({"imagereward": {"dtype": "bfloat16", "batch_size": 4}}, mode, paths)
    assert term.on_device and not term.untraced and term.batch_size == 4
    config = imagereward_blip_config()
    with torch.device("meta"):
        from transformers import BlipTextModel, BlipVisionModel

        expected = sum(p.numel() for p in BlipVisionModel(config.vision_config).parameters())
        expected += sum(p.numel() for p in BlipTextModel(config.text_config, add_pooling_layer=False).parameters())
    head = sum(p.numel() for p in term.scorer.model.mlp.parameters())
    assert term.parameters == expected + head
    buffers = sum(b.numel() * b.element_size() for b in term.scorer.model.buffers())  # the text position ids
    assert term.weight_bytes == 2 * expected + 4 * head + buffers, "the BLIP in bf16, the head in float32"
    assert [m for m in reward_models([term])] == [term.scorer.model]
    with mode:
        score([term], torch.rand(6, 3, 512, 512), ["a cat"] * 6)  # traced: the BLIP runs on fake tensors


def test_the_rewards_command_lists_every_reward_and_shows_one_s_arguments(capsys):
    from unirl_pl.commands import run_before_lightning

    assert run_before_lightning(["rewards"]) == 0
    listing = capsys.readouterr().out
    for alias in REGISTRY:
        cls = _registered_class(alias)
        assert f"{cls.__module__}.{cls.__qualname__}" in listing and f"\n{alias} " in listing
    assert run_before_lightning(["rewards", "refiner_format"]) == 0
    help_text = capsys.readouterr().out
    assert "--max_words MAX_WORDS" in help_text and "default: 16" in help_text and "Most words" in help_text
    assert run_before_lightning(["rewards", "unirl_pl.rewards.ContainsWord"]) == 0
    assert "--word WORD" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no reward 'no_such'"):
        run_before_lightning(["rewards", "no_such"])


def test_the_docs_table_names_every_reward_with_the_class_it_aliases():
    import re
    from pathlib import Path

    from unirl_pl.rewards.catalog import reward_class

    text = (Path(__file__).resolve().parents[1] / "docs" / "rewards.md").read_text()
    rows = dict(re.findall(r"^\| `([a-z0-9_]+)` \| `([A-Za-z0-9_.]+)` \|", text, flags=re.MULTILINE))
    assert set(rows) == set(REGISTRY), "one row per registered reward"
    for alias, path in rows.items():
        assert reward_class(path) is _registered_class(alias), alias


def test_a_negative_weight_is_refused_unless_the_term_allows_it(capsys):
    """A sign typed by mistake trains the run to lower its reward: refused, unless the term says it is a penalty."""
    with pytest.raises(ValueError, match=r"reward term 'brightness' has weight -1\.0: .*allow_negative: true"):
        RewardTerm(Brightness(), weight=-1.0)
    penalty = WeightedSum([RewardTerm(Brightness(), weight=-1.0, allow_negative=True)])
    images = torch.full((2, 3, 4, 4), 0.25)
    total, parts = penalty(["a", "b"], ["a", "b"], images)
    assert total.tolist() == [-0.25, -0.25] and parts["brightness"].tolist() == [0.25, 0.25]
    assert RewardTerm(Brightness(), weight=0.0).weight == 0.0, "zero logs the term without training on it"
    with pytest.raises(ValueError, match=r"negative reward weights \{'brightness': -1\.0\}.*allow_negative: true"):
        WeightedSum({"brightness": -1.0})
    # On the command line: one line naming the setting, before any model loads.
    from tests.helpers import TINY
    from unirl_pl.cli import main

    rewards = "--model.rewards=[{reward: {class_path: unirl_pl.rewards.Brightness}, weight: -1.0}]"
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--config", TINY, rewards, "--model.reward_args=null", "--trainer.logger=false"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert stop.value.code == 2 and "Traceback" not in err and len(lines) == 1 and "allow_negative" in lines[0], err
