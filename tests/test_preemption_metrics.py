"""Nothing lost on preemption: an interrupted run plus its resume log every (step, metric) an uninterrupted run logs.

The signal is sent in-process by a callback (:class:`SignalAt`) at a chosen phase, so each case is three
short in-process fits of the tiny recipe (the uninterrupted one is shared).
"""

from __future__ import annotations

import csv
import os
import signal
from collections import Counter
from pathlib import Path

import lightning.pytorch as pl
import pytest

from tests.helpers import run_cli

HERE = "tests.test_preemption_metrics"
N = 3  # steps of every run
# Validation only as the sanity check (one batch, not logged); no validation during the few steps.
OPTS = (
    f"--trainer.max_steps={N}",
    "--trainer.limit_val_batches=1",
    "--trainer.val_check_interval=1000",
    "--model.rollout.num_steps=4",
    "--model.generator_algorithm.init_args.sde_window=[0,2]",
)
WATCH = "--trainer.callbacks+=unirl_pl.callbacks.PreemptionCheckpoint"
DERIVED = {"cache/text_encoder_hit_rate"}  # the text-encoder cache is cold after a resume


class SignalAt(pl.Callback):
    """Test helper: send this process SIGTERM once, during the sanity validation or inside training step ``step``."""

    def __init__(self, phase: str = "train", step: int = 1) -> None:
        if phase not in ("sanity", "train"):
            raise ValueError(phase)
        self.phase, self.step, self.sent = phase, step, False

    def _send(self) -> None:
        if self.sent:
            return
        # Never the default action: that would end the test process.
        assert callable(signal.getsignal(signal.SIGTERM)), "no SIGTERM handler installed"
        self.sent = True
        os.kill(os.getpid(), signal.SIGTERM)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if self.phase == "sanity" and trainer.sanity_checking:
            self._send()

    def on_after_backward(self, trainer, pl_module) -> None:  # inside training_step (manual backward)
        if self.phase == "train" and trainer.training and trainer.global_step == self.step:
            self._send()


def _rows(log_dir: Path) -> list[dict[str, float]]:
    with (log_dir / "metrics.csv").open() as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def _pairs(*log_dirs: Path) -> Counter:
    """How often each (step, metric) occurs in the runs' metrics.csv files together."""
    return Counter((int(row["step"]), key) for d in log_dirs for row in _rows(d) for key in row if key != "step")


def _values(*log_dirs: Path) -> dict[tuple[int, str], float]:
    return {
        (int(row["step"]), key): value
        for d in log_dirs
        for row in _rows(d)
        for key, value in row.items()
        if key != "step" and key not in DERIVED
    }


@pytest.fixture(autouse=True)
def _keep_signal_handlers():
    """Whatever a case leaves installed, the next case (and pytest) get the process's handlers back."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    yield
    for signum, handler in handlers.items():
        signal.signal(signum, handler)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("full")
    run_cli(root, *OPTS, name="full")
    return root / "full" / "version_0"


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["train", "sanity"])
def test_preempted_and_resumed_run_logs_every_metric_of_every_step(full_run, tmp_path, phase):
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)
    killer = (f"--trainer.callbacks+={HERE}.SignalAt", f"--trainer.callbacks.phase={phase}")
    with pytest.raises(SystemExit) as info:
        run_cli(tmp_path, *OPTS, WATCH, *killer, name="preempted")
    assert info.value.code == 143
    preempted = tmp_path / "preempted" / "version_0"
    ckpt = preempted / "checkpoints" / "last.ckpt"
    assert ckpt.is_file()

    resumed = run_cli(tmp_path, *OPTS, WATCH, f"--ckpt_path={ckpt}", name="resumed")
    assert resumed.trainer.global_step == N
    resumed_dir = Path(resumed.trainer.logger.log_dir)

    want, got = _pairs(full_run), _pairs(preempted, resumed_dir)
    assert {s for s, _ in want} == set(range(N)), sorted(want)
    missing, extra = want - got, got - want
    assert not missing and not extra, f"missing {sorted(missing)}, logged twice or extra {sorted(extra)}"
    full_values, union_values = _values(full_run), _values(preempted, resumed_dir)
    assert union_values == full_values
    # A preempted fit, too, hands the process its signal handlers back (a later fit in it must not chain to them).
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)) == handlers
