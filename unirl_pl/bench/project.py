"""The project step: a real ``trainer.fit`` of the recipe, timed step by step, each followed by a floor step.

The fit runs with the bench's :class:`~unirl_pl.bench.record.Recorder` installed (:func:`unirl_pl.timing.recording`):
the project reports its phases itself. A callback times each step (the end of the previous one to the end
of this one's ``on_train_batch_end``) and runs a floor step on the same prompts right after it.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl

from unirl_pl import timing
from unirl_pl.bench.floor import Floor
from unirl_pl.bench.record import Recorder, RunResult, clock, fill_overhead
from unirl_pl.recipes import load_recipe


class _Interleave(pl.Callback):
    """Times each project step (end of the previous step, or of the floor step after it, to this one's
    end) and runs a floor step on the same prompts right after it."""

    def __init__(
        self, recorder: Recorder, floor_factory: Callable[[], Floor], warmup: int, result: RunResult, stride: int
    ) -> None:
        self.recorder, self.floor_factory, self.warmup, self.result = recorder, floor_factory, warmup, result
        self.stride = stride  # images per prompt: the experience lists each prompt once per image
        self.floor: Floor | None = None
        self.prompts: list[str] = []
        self.mark = 0.0
        self.parity_costs: list[float] = []
        self.steps = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        fit_start = self.recorder.take()
        if fit_start.get("gate_parity"):
            self.parity_costs.append(fit_start["gate_parity"])
        self.floor = self.floor_factory()
        self.mark = clock()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        # The batch is the step's experience (the rollout ran in on_after_batch_transfer): prompt-major rows.
        self.prompts = list(batch.prompts[:: self.stride])

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        total = clock() - self.mark
        phases = self.recorder.take()
        parity = phases.pop("gate_parity", 0.0)
        if parity:
            self.parity_costs.append(parity)
            total -= parity
        phases["total"] = total
        num_tokens = (
            int(batch.lm.gen_mask.shape[1]) if batch.lm is not None else pl_module.rollout_config.max_new_tokens
        )
        assert self.floor is not None
        saved = [[p.detach().clone() for p in ps] for ps in self.floor.params.values()]
        with self.recorder.paused():
            floor = self.floor.step(self.prompts, num_tokens)
        for ps, copies in zip(self.floor.params.values(), saved, strict=True):
            for param, copy in zip(ps, copies, strict=True):
                param.data.copy_(copy)
                param.grad = None
        if self.steps >= self.warmup:
            self.result.project.append(phases)
            self.result.floor.append(floor)
            self.result.tokens.append(num_tokens)
        self.steps += 1
        self.mark = clock()


def _step_callbacks(recipe: str) -> list[Any]:
    """The recipe's callbacks less the progress bar (off) and the checkpoint one (periodic file I/O, not
    step compute; it would also write into the recipe's run folder)."""
    # The list as the recipe writes it, not parsed: it goes back on the fit's command line below, where the
    # CLI parses it with the rest, and a callback list has no default of a constructor to fill in.
    config = load_recipe(recipe)
    callbacks = (config.get("trainer") or {}).get("callbacks") or []
    dropped = ("ProgressBar", "ModelCheckpoint", "RunCheckpoint")
    return [c for c in callbacks if not str(c.get("class_path", "") if isinstance(c, dict) else c).endswith(dropped)]


def _cli_args(recipe: str, steps: int, prompts_per_step: int | None, samples_per_prompt: int | None) -> list[str]:
    """The CLI arguments of the bench's fit: the recipe with logger, progress bar, checkpointing, model
    summary and validation off, ``steps`` steps, the step's batch when given."""
    args = [
        "--config",
        recipe,
        "--trainer.logger=false",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.enable_model_summary=false",
        "--trainer.limit_val_batches=0",
        "--trainer.num_sanity_val_steps=0",
        f"--trainer.max_steps={steps}",
        "--trainer.callbacks=" + json.dumps(_step_callbacks(recipe)),
    ]
    if prompts_per_step is not None:
        args.append(f"--data.prompts_per_step={prompts_per_step}")
    if samples_per_prompt is not None:
        args.append(f"--data.samples_per_prompt={samples_per_prompt}")
    return args


def run_project(
    recipe: str,
    gates: bool,
    prompts_per_step: int | None,
    samples_per_prompt: int | None,
    repeats: int,
    warmup: int,
    overrides: Sequence[str] = (),
    root: str | None = None,
) -> RunResult:
    """Build the recipe through the CLI and fit ``warmup + repeats`` steps, each followed by a floor step.

    Files written at fit end go under ``root`` (a temporary folder when None).
    """
    if root is None:
        with tempfile.TemporaryDirectory(prefix="unirl_bench_") as tmp:
            return run_project(recipe, gates, prompts_per_step, samples_per_prompt, repeats, warmup, overrides, tmp)
    from unirl_pl.callbacks import InterleaveParityCheck, LogProbIdentityCheck, WeightVersionLedger
    from unirl_pl.cli import main

    args = [*_cli_args(recipe, warmup + repeats, prompts_per_step, samples_per_prompt), *overrides]
    # Anything a callback writes at fit end (RunSummary's reward curve) goes to ``root``, not the repository.
    args.append(f"--trainer.default_root_dir={root}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cli = main(args, run=False)
    trainer, model, data = cli.trainer, cli.model, cli.datamodule
    gate_types = (LogProbIdentityCheck, InterleaveParityCheck, WeightVersionLedger)
    # SaveConfigCallback would write config.yaml into the working directory: not part of a step.
    kept = [c for c in trainer.callbacks if type(c).__name__ != "SaveConfigCallback"]
    trainer.callbacks = kept if gates else [c for c in kept if not isinstance(c, gate_types)]

    recorder = Recorder()
    model.configure_model()
    layout = data.layout
    result = RunResult(
        gates=gates, images_per_step=data.prompts_per_step * layout.samples_per_prompt * layout.images_per_refinement
    )
    stride = layout.samples_per_prompt * layout.images_per_refinement
    interleave = _Interleave(recorder, lambda: Floor(model, layout), warmup, result, stride)
    trainer.callbacks.append(interleave)
    for callback in trainer.callbacks:
        if isinstance(callback, InterleaveParityCheck):
            result.parity_every = callback.every_n_steps
    with warnings.catch_warnings(), timing.recording(recorder):
        warnings.simplefilter("ignore")
        trainer.fit(model, datamodule=data)
    if result.parity_every and interleave.parity_costs:
        result.parity_cost = statistics.mean(interleave.parity_costs)
        share = result.parity_cost / result.parity_every
        for rep in result.project:
            rep["gate_parity"] = share
            rep["total"] += share
    for side in (result.project, result.floor):
        for rep in side:
            fill_overhead(rep)
    return result
