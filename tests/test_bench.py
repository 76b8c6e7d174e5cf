"""The step benchmark: its exclusive-time accounting of the project's timing phases (unit), and one timed
step of the tiny recipe against the bare-torch floor (integration)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

import unirl_pl.bench
from unirl_pl import timing
from unirl_pl.bench import PHASES, Recorder, run
from unirl_pl.bench.record import fill_overhead


class FakeClock:
    """CPU seconds that move only when the test says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def spend(self, seconds: float) -> None:
        self.now += seconds


def test_nested_phases_are_exclusive_and_sum_to_the_outer_time():
    clock = FakeClock()
    recorder = Recorder(clock)
    with timing.recording(recorder), timing.phase("train_glue"):
        clock.spend(1.0)
        with timing.phase("lm_loss"):
            clock.spend(2.0)
            with timing.phase("backward"):  # the LM's per-micro-batch backward
                clock.spend(0.5)
        with timing.phase("dit_loss"):
            clock.spend(3.0)
            with timing.phase("backward"):  # the DiT's per-step backward
                clock.spend(4.0)
        with timing.phase("backward"):  # training_step's backward of the losses not yet backpropagated
            clock.spend(0.25)
        with timing.phase("optimizer"):
            clock.spend(0.125)
    totals = recorder.take()
    assert totals == {
        "train_glue": 1.0,
        "lm_loss": 2.0,
        "lm_backward": 0.75,
        "dit_loss": 3.0,
        "dit_backward": 4.0,
        "optimizer": 0.125,
    }
    assert sum(totals.values()) == clock.now  # nothing counted twice, nothing lost
    assert recorder.take() == {}  # take() empties


def test_an_opaque_phase_owns_what_it_runs_and_a_pause_records_nothing():
    clock = FakeClock()
    recorder = Recorder(clock)
    with timing.recording(recorder):
        with timing.phase("gate_parity", opaque=True):
            clock.spend(2.0)
            with timing.phase("denoise"):  # the gate's own probe of the loop
                clock.spend(5.0)
                with timing.phase("gate_c2", opaque=True):
                    clock.spend(1.0)
        with recorder.paused(), timing.phase("denoise"):  # the floor step
            clock.spend(7.0)
        with timing.phase("denoise"):
            clock.spend(3.0)
    assert recorder.take() == {"gate_parity": 8.0, "denoise": 3.0}


def test_a_phase_that_raises_is_still_counted_and_leaves_no_frame_behind():
    clock = FakeClock()
    recorder = Recorder(clock)
    with pytest.raises(RuntimeError), timing.recording(recorder), timing.phase("rollout_glue"):
        with timing.phase("reward"):
            clock.spend(1.0)
            raise RuntimeError("reward server down")
    assert recorder.take() == {"reward": 1.0, "rollout_glue": 0.0}
    assert recorder.current() is None


def test_overhead_is_the_step_total_less_every_phase():
    rep = {"decode": 1.0, "denoise": 2.5, "total": 4.0}
    fill_overhead(rep)
    assert rep["overhead"] == pytest.approx(0.5)


def test_the_bench_patches_nothing_of_the_project():
    sources = Path(unirl_pl.bench.__file__).parent.glob("*.py")
    text = "\n".join(path.read_text() for path in sources)
    for needle in ("setattr(", "Patches", "patches.", "delattr(", "._step", "._grad_norm"):
        assert needle not in text, needle


@pytest.mark.integration
def test_bench_reports_every_phase_and_a_finite_ratio():
    result = run(
        [
            "--config",
            "recipes/tiny.yaml",
            "--prompts-per-step",
            "2",
            "--samples-per-prompt",
            "2",
            "--repeats",
            "1",
            "--warmup",
            "1",
            "--gates",
            "on",
            "--model.rollout.max_new_tokens=4",
            "--model.rollout.num_steps=4",
            "--model.generator_algorithm.init_args.sde_window=[0, 2]",
        ]
    )
    rows = {line.split()[0] for line in result.report.splitlines() if line.strip()}
    for phase in (*PHASES, "total"):
        assert phase in rows, f"phase {phase!r} missing from\n{result.report}"
    run_on = result.runs["on"]
    assert len(run_on.project) == len(run_on.floor) == 1
    assert math.isfinite(run_on.ratio) and run_on.ratio > 0
    total = re.search(r"^total\s.*\s(\S+)$", result.report, re.MULTILINE)
    assert total is not None and float(total.group(1)) > 0
    # The floor covers every phase it has a counterpart for: a zero would make that row's ratio meaningless.
    for phase in ("decode", "text_encode", "denoise", "reward", "lm_loss", "dit_loss", "dit_backward", "optimizer"):
        assert run_on.median("floor", phase) > 0, phase
    # Every row is reported by the project's own timing phases (nothing is wrapped at run time).
    for phase in PHASES:
        assert run_on.median("project", phase) > 0, f"the project no longer reports its {phase!r} phase"
    # Exclusive accounting: the phases never add up to more than the step (a phase counted twice would).
    (project,) = run_on.project
    assert project["overhead"] >= 0
    assert sum(project[p] for p in PHASES) == pytest.approx(project["total"])
    assert set(project) <= {*PHASES, "total"}, "a phase the table does not show"


@pytest.mark.slow
def test_the_floor_runs_the_recipes_own_stochastic_step_and_refuses_what_it_does_not_cover():
    from unirl_pl.bench.floor import Floor
    from unirl_pl.cli import main
    from unirl_pl.sampling import cps_step_with_logprob, flow_sde_step_with_logprob

    def floor_of(*overlay: str) -> Floor:
        cli = main(["--config", "recipes/tiny.yaml", *overlay, "--trainer.logger=false"], run=False)
        cli.model.configure_model()
        return Floor(cli.model, cli.datamodule.layout)

    plain = floor_of()
    assert plain.stochastic_step is flow_sde_step_with_logprob and plain.noise_level == 0.7
    cps = floor_of("--config", "recipes/algorithms/cps.yaml")
    assert cps.stochastic_step is cps_step_with_logprob and cps.noise_level == 0.8
    with pytest.raises(ValueError, match="covers Flow-GRPO and Flow-CPS"):
        floor_of("--config", "recipes/algorithms/diffusion_nft.yaml")
