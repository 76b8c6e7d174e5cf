"""Validation and predict sample with their own settings (steps, guidance), as the references evaluate;
training's rollout keeps its own."""

from __future__ import annotations

import pytest

from tests.helpers import JOINT, TINY
from unirl_pl.cli import main
from unirl_pl.data import PromptBatch
from unirl_pl.loops import EvalSampler, RolloutConfig

QUIET = ["--trainer.logger=false", "--trainer.callbacks=[]", "--trainer.enable_progress_bar=false"]


def test_unset_values_are_the_rollouts_and_bad_ones_are_refused():
    rollout = RolloutConfig(num_steps=10, guidance_scale=4.5)
    assert EvalSampler().apply(rollout) is rollout
    assert EvalSampler(num_steps=40).apply(rollout) == RolloutConfig(num_steps=40, guidance_scale=4.5)
    assert EvalSampler(guidance_scale=1.0).apply(rollout).guided is False
    with pytest.raises(ValueError, match="num_steps"):
        EvalSampler(num_steps=0)
    with pytest.raises(ValueError, match="guidance_scale"):
        EvalSampler(guidance_scale=-1.0)


def _velocity_calls(model, monkeypatch, run) -> int:
    calls = []
    velocity = model.generator.velocity
    monkeypatch.setattr(model.generator, "velocity", lambda *a, **k: calls.append(1) or velocity(*a, **k))
    run()
    return len(calls)


def test_validation_samples_with_its_own_steps_and_rollout_with_the_rollouts(monkeypatch):
    cli = main(["--config", TINY, *QUIET, "--model.eval_sampler.num_steps=5"], run=False)
    model = cli.model
    model.configure_model()
    batch = PromptBatch(["a red circle", "a blue square"], [-1, -2], seed=0)
    assert _velocity_calls(model, monkeypatch, lambda: model.serve(batch)) == 5, "one ODE forward per eval step"
    train = PromptBatch(["a red circle"], [3], seed=0, layout=cli.datamodule.layout)
    steps = model.rollout_config.num_steps
    calls = _velocity_calls(model, monkeypatch, lambda: model.source.collect(train, model.device))
    assert calls == steps, f"rollout keeps its {steps} steps"


@pytest.mark.parametrize("key, value", [("noise_level", 0.7), ("sde_window", (0, 3))])
def test_a_sampler_value_the_algorithm_owns_is_refused_on_the_rollout_naming_its_new_key(key, value):
    with pytest.raises(ValueError, match=f"model.generator_algorithm.init_args.{key}"):
        RolloutConfig(**{key: value})


def test_the_main_recipe_has_one_place_for_each_sampler_value():
    model = main(["--config", JOINT, *QUIET], run=False).model
    algorithm = model.generator_algorithm
    assert (algorithm.sde_window, algorithm.noise_level(model.rollout_config)) == ((0, 4), 0.8)
    assert model.rollout_config.noise_level is None and model.rollout_config.sde_window is None
