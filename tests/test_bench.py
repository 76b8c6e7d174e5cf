"""Smoke test of the step benchmark: one timed step of the tiny recipe against the bare-torch floor."""

from __future__ import annotations

import math
import re

import pytest

from unirl_pl.bench import PHASES, run


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
            "--model.rollout.sde_window=[0, 2]",
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
        assert run_on.median("project", phase) > 0, f"the bench no longer times the project's {phase!r}"
