"""Learning: each mode moves the reward it can move, and leaves frozen experts bit-identical."""

import pytest
import torch

from tests.helpers import read_metrics, run_cli, series
from unirl_pl.data import PromptBatch
from unirl_pl.experts import CausalLMExpert, FlowTransformerExpert, TinyCausalLMExpert


def _fresh(cls, **kwargs):
    expert = cls(**kwargs)
    expert.build()
    return {k: v.clone() for k, v in expert.state_dict().items()}


def _lora(state):
    return {k: v for k, v in state.items() if "lora" in k}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _rise(values, n=10):
    return sum(values[-n:]) / n - sum(values[:n]) / n


COMMON = ("--trainer.limit_val_batches=0", "--model.reward_args=null")


@pytest.mark.slow
def test_prompt_only_learns_a_refiner_reward_and_keeps_the_dit_frozen(tmp_path):
    cli = run_cli(
        tmp_path,
        "--model.mode=prompt_only",
        "--trainer.max_steps=50",
        *COMMON,
        "--model.rewards={contains_word: 1.0}",
        "--model.llm_optimizer.init_args.lr=0.01",
    )
    rows = read_metrics(cli)
    reward = series(rows, "reward/mean")
    assert _rise(reward) > 0.2, reward
    assert _same(_fresh(FlowTransformerExpert), cli.model.generator.transformer.state_dict())
    assert set(series(rows, "version/transformer")) == {0.0}
    assert "transformer/pg_loss" not in set().union(*rows)


@pytest.mark.slow
def test_generator_only_without_a_refiner_learns_an_image_reward_and_never_runs_an_lm(tmp_path, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("generator_only without a refiner ran an LM")

    monkeypatch.setattr(CausalLMExpert, "forward", never)
    cli = run_cli(
        tmp_path,
        "--model.mode=generator_only",
        "--model.llm=null",
        "--trainer.max_steps=40",
        *COMMON,
        "--model.rewards={brightness: 1.0}",
        "--model.transformer_optimizer.init_args.lr=0.01",
    )
    rows = read_metrics(cli)
    reward = series(rows, "reward/mean")
    # Brightness through the tiny random VAE moves by ~0.02 over 40 steps; the per-step noise is ~0.003.
    assert _rise(reward) > 0.01, reward
    assert cli.model.llm is None and "version/llm" not in set().union(*rows)


@pytest.mark.slow
def test_generator_only_trains_the_dit_behind_the_frozen_refiners_greedy_rewrites(tmp_path):
    cli = run_cli(tmp_path, "--model.mode=generator_only", "--trainer.max_steps=2", *COMMON)
    model, dm = cli.model, cli.datamodule
    # The refiner ran (every mode runs the whole pipeline) but never learned.
    assert _same(_fresh(TinyCausalLMExpert), cli.model.llm.state_dict())
    assert set(series(read_metrics(cli), "version/llm")) == {0.0}
    assert not _same(_lora(_fresh(FlowTransformerExpert)), _lora(model.generator.transformer.state_dict()))
    prompts = ["a red circle", "a blue square"]
    exp = model.source.collect(PromptBatch(prompts, [0, 1], seed=dm.seed, layout=dm.layout), model.device)
    assert "ar_decode" not in exp.records  # no LM record: nothing of the LM is trained
    k, skip = dm.layout.samples_per_prompt, dm.layout.num_skip_refinement
    assert 0 < skip < k, "the tiny recipe must have both raw and refined samples for this test"
    served, _ = model.ar_decode.sample(prompts, [0, 1], [0, 0], "serve", seed=dm.seed)
    for i, prompt in enumerate(prompts):
        group = exp.refined[i * k : (i + 1) * k]
        # Raw samples keep the user's prompt; every refined sample is the served (greedy) rewrite.
        assert group[:skip] == [prompt] * skip
        assert group[skip:] == [served[i]] * (k - skip), (group, served[i])


@pytest.mark.slow
def test_generator_update_is_a_real_policy_gradient_step(tmp_path):
    """Flipping the reward's sign flips the direction the generator moves the reward."""
    up = run_cli(
        tmp_path,
        "--model.mode=generator_only",
        "--trainer.max_steps=20",
        *COMMON,
        "--model.rewards={brightness: 1.0}",
        "--model.transformer_optimizer.init_args.lr=0.01",
        name="up",
    )
    down = run_cli(
        tmp_path,
        "--model.mode=generator_only",
        "--trainer.max_steps=20",
        *COMMON,
        # A negative weight is asked for (allow_negative): the short form refuses one.
        "--model.rewards=[{reward: {class_path: unirl_pl.rewards.Brightness}, weight: -1.0, allow_negative: true}]",
        "--model.transformer_optimizer.init_args.lr=0.01",
        name="down",
    )
    up_r = series(read_metrics(up), "reward/brightness")
    down_r = series(read_metrics(down), "reward/brightness")
    assert _rise(up_r, 5) > 0 > _rise(down_r, 5), (up_r, down_r)


@pytest.mark.slow
def test_joint_changes_both_adapters(tmp_path):
    cli = run_cli(tmp_path, "--trainer.max_steps=3", "--trainer.limit_val_batches=0")
    dit_before = _lora(_fresh(FlowTransformerExpert))
    llm_before = _lora(_fresh(TinyCausalLMExpert))
    dit_after = _lora(cli.model.generator.transformer.state_dict())
    llm_after = _lora(cli.model.llm.state_dict())
    assert dit_before and llm_before
    assert not _same(dit_before, dit_after)
    assert not _same(llm_before, llm_after)
    base = {k: v for k, v in _fresh(FlowTransformerExpert).items() if "lora" not in k}
    assert _same(base, {k: v for k, v in cli.model.generator.transformer.state_dict().items() if "lora" not in k})


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["hierarchical"])
def test_hierarchical_scheme_runs_and_groups_the_dit_by_refinement(tmp_path, scheme):
    cli = run_cli(
        tmp_path,
        "--trainer.max_steps=2",
        "--trainer.limit_val_batches=0",
        f"--model.advantage.scheme={scheme}",
        "--data.images_per_refinement=2",
    )
    rows = read_metrics(cli)
    assert len(series(rows, "transformer/pg_loss")) == 2
    assert series(rows, "cache/text_encoder_hit_rate")[0] >= 0.5  # each text rendered twice, encoded once
