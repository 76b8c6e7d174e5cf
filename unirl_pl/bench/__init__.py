"""CPU-time benchmark of one RL step: the project (Lightning, loops, gates) against a bare-torch floor.

``python -m unirl_pl bench --config recipes/joint.yaml --prompts-per-step 8 --samples-per-prompt 4``
(``python -m unirl_pl.bench`` is an alias).

The **project step** is a real ``trainer.fit`` of the recipe (logger, progress bar, checkpointing and
validation off), timed from the end of one step to the end of the next: batch fetch, the rollout in
``on_after_batch_transfer``, ``training_step``, every callback and Lightning's own bookkeeping. Its
phases are the ones the project reports through :mod:`unirl_pl.timing` (decode, text encode, denoise,
image decode, reward, advantages, the LM and DiT losses and their backward, the optimizer steps, each
gate) to the bench's recorder, installed for the fit; ``overhead`` is the step total minus the phases. The
interleave-parity gate runs every ``every_n_steps`` steps (and at fit start, outside the timed steps), so
its measured cost enters every step amortized (``cost / every_n_steps``).

The **floor step** (:class:`Floor`) is the same math on the same model objects with no framework. It runs
right after each project step, on the same prompts (interleaved, so both see the same machine load); the
trainable weights are restored after it, so the project's run is the run it would have been.

Everything is CPU time of this process (``time.process_time``), not wall time: the numbers hold on a
shared machine. One thread per process unless ``OMP_NUM_THREADS`` says otherwise (:mod:`unirl_pl.threads`),
as the documented numbers were measured.

Modules: :mod:`.record` (rows, the recorder, one run's results), :mod:`.floor`, :mod:`.project` (the
timed fit), :mod:`.report` (tables), :mod:`.cli` (the command). Torch and Lightning load only when a run
starts (``Floor`` and ``run_project`` are imported on first use), so ``--help`` is quick.
"""

from __future__ import annotations

from typing import Any

from unirl_pl.bench.cli import main, parser, run
from unirl_pl.bench.record import GATE_PHASES, PHASES, PROJECT_ONLY, Recorder, RunResult
from unirl_pl.bench.report import BenchResult, format_report, format_table

__all__ = [
    "GATE_PHASES",
    "PHASES",
    "PROJECT_ONLY",
    "BenchResult",
    "Floor",
    "Recorder",
    "RunResult",
    "format_report",
    "format_table",
    "main",
    "parser",
    "run",
    "run_project",
]

_LAZY = {"Floor": "unirl_pl.bench.floor", "run_project": "unirl_pl.bench.project"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'unirl_pl.bench' has no attribute {name!r}")
