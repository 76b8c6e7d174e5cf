"""The runs of an ablation: their command lines, and running one in a fresh subprocess.

Each (mode, arm, seed) is one run of this CLI in its own process, so runs share no state (RNG, caches,
threads) and a crash ends only that run: ``fit`` with ``--model.mode=<mode>`` for the training modes,
``validate`` of the recipe's starting weights for the base rows (with the CSVLogger on the command line,
since ``validate`` keeps a logger only when asked). An extra validation split of a finished run is one
more ``validate``: of the fit's ``last.ckpt``, or of the starting weights for a base row.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from unirl_pl.ablate.arms import Arm
from unirl_pl.ablate.metrics import Series, read_train_cpu, read_validation
from unirl_pl.errors import ConfigError
from unirl_pl.recipes import load_recipe

MODES: tuple[str, ...] = ("base", "base_no_refiner", "joint", "prompt_only", "generator_only")
TRAINING_MODES: tuple[str, ...] = ("joint", "prompt_only", "generator_only")
# No-RL rows: the recipe's starting weights, validated with these overrides.
BASE_MODES: dict[str, tuple[str, ...]] = {
    "base": ("--model.mode=joint",),
    "base_no_refiner": ("--model.mode=generator_only", "--model.llm=null"),
}
# A smoke setting: two RL steps, a validation after each, one small held-out batch, short rollouts.
QUICK: tuple[str, ...] = (
    "--trainer.max_steps=2",
    "--trainer.val_check_interval=1",
    "--trainer.limit_val_batches=1",
    "--data.val_batch_size=8",
    "--data.prompts_per_step=2",
    "--data.samples_per_prompt=2",
    # Short rollouts that still hold every algorithm's own window (the main recipe's CPS window [0, 4) needs a
    # step after it): the window is the algorithm's setting, so --quick leaves it alone.
    "--model.rollout.num_steps=6",
)
STDERR_TAIL = 25
# Added to every fit: held-out scores against the training CPU seconds spent to reach them.
CLOCK = "unirl_pl.callbacks.TrainCPUClock"


def run_name(mode: str, seed: int, split: str = "", arm: str = "") -> str:
    """``<mode>[-<arm>]_s<seed>[_<split>]``: the run's logger, checkpoint and log name."""
    return f"{group_name(mode, arm)}_s{seed}" + (f"_{split}" if split else "")


def group_name(mode: str, arm: str = "") -> str:
    """A row of the tables: the mode, and the arm when the ablation varies something."""
    return f"{mode}-{arm}" if arm else mode


@dataclass
class Run:
    """One (mode, arm, seed) run on one validation split: its command, where it writes, and what it gave.

    ``split`` is empty for the run itself (fit, or validate for base) and names the split of an
    extra validation of that run's result. ``cpu_seconds`` is the user + system CPU time of the child
    process and the processes it waited for (data workers, ranks).
    """

    mode: str
    seed: int
    command: list[str]
    save_dir: Path
    log_out: Path
    log_err: Path
    split: str = ""
    arm: str = ""
    returncode: int | None = None
    seconds: float = math.nan
    cpu_seconds: float = math.nan
    version_dir: Path | None = None
    final: dict[str, float] = field(default_factory=dict)  # metric -> value at the last validation
    final_step: int | None = None
    series: Series = field(default_factory=dict)  # metric -> [(RL steps done, value), ...]
    train_cpu: list[tuple[int, float]] = field(default_factory=list)  # [(RL steps done, training CPU s), ...]

    @property
    def name(self) -> str:
        return run_name(self.mode, self.seed, self.split, self.arm)

    @property
    def group(self) -> str:
        return group_name(self.mode, self.arm)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and bool(self.final)


# ------------------------------------------------------------------ commands
def last_callback_is_checkpoint(config: Path) -> bool:
    """Whether the recipe's last ``trainer.callbacks`` entry is a ``ModelCheckpoint`` (or ``RunCheckpoint``).

    ``--trainer.callbacks.dirpath=...`` sets ``dirpath`` of the last callback in the list, so it is
    given only when that callback is the checkpoint one.
    """
    # The recipe as written, not parsed: only the class its last callback names matters, and a parse would
    # bring torch and Lightning into the ablation's driver, which only starts the runs (each parses its recipe).
    try:
        recipe = load_recipe(str(config))
    except ConfigError:
        return False
    callbacks = (recipe.get("trainer") or {}).get("callbacks") or []
    last = callbacks[-1] if isinstance(callbacks, list) and callbacks else None
    path = last.get("class_path", "") if isinstance(last, dict) else str(last or "")
    return path.rsplit(".", 1)[-1] in ("ModelCheckpoint", "RunCheckpoint")


def build_command(
    config: str,
    mode: str,
    seed: int,
    out: Path,
    *,
    quick: bool = False,
    extra: list[str] | tuple[str, ...] = (),
    checkpoint_dirpath: bool = True,
    split: tuple[str, Path] | None = None,
    arm: Arm | None = None,
) -> list[str]:
    """The command line of one run (the base rows validate, the other modes fit).

    Order, each later one winning: the recipe, the arm's overlays, the ablation's own flags, ``--quick``,
    the arm's overrides, then ``extra`` (the arguments after ``--``).
    """
    arm = arm or Arm()
    name = run_name(mode, seed, arm=arm.label)
    runs = out / "runs"
    configs = ["--config", config, *(a for c in arm.configs for a in ("--config", c))]
    common = [f"--seed_everything={seed}", f"--data.seed={seed}"]
    tail = [*(QUICK if quick else ()), *arm.overrides, *extra]
    if split is not None:
        # Score the finished run on another prompt file: the fit's last checkpoint (base: the start).
        split_name, prompts = split
        head = ["validate", *configs, *BASE_MODES.get(mode, (f"--model.mode={mode}",)), *common]
        if mode not in BASE_MODES:
            head.append(f"--ckpt_path={out / 'ckpt' / name / 'last.ckpt'}")
        head += [f"--data.val_prompts={prompts}", "--trainer.logger=lightning.pytorch.loggers.CSVLogger"]
        head += [f"--trainer.logger.init_args.save_dir={runs}"]
        head += [f"--trainer.logger.init_args.name={run_name(mode, seed, split_name, arm.label)}"]
        return [sys.executable, "-m", "unirl_pl", *head, *tail]
    if mode in BASE_MODES:
        # No RL: the recipe's starting weights, with the refiner in front (base) or without it
        # (base_no_refiner); the logger is given so that validate writes a metrics.csv.
        head = ["validate", *configs, *BASE_MODES[mode], *common]
        head += ["--trainer.logger=lightning.pytorch.loggers.CSVLogger"]
    else:
        head = ["fit", *configs, f"--model.mode={mode}", *common]
    head += [f"--trainer.logger.init_args.save_dir={runs}", f"--trainer.logger.init_args.name={name}"]
    if mode not in BASE_MODES and checkpoint_dirpath:
        head.append(f"--trainer.callbacks.dirpath={out / 'ckpt' / name}")
    if mode not in BASE_MODES:
        # After the dirpath override, which sets the recipe's last callback: the clock is appended.
        head.append(f"--trainer.callbacks+={CLOCK}")
    return [sys.executable, "-m", "unirl_pl", *head, *tail]


def make_run(
    config: str,
    mode: str,
    seed: int,
    out: Path,
    arm: Arm,
    *,
    quick: bool,
    extra: list[str],
    checkpoint_dirpath: bool = True,
    split: tuple[str, Path] | None = None,
) -> Run:
    """A not-yet-run :class:`Run` with its command and its log files under ``<out>/logs``."""
    command = build_command(
        config, mode, seed, out, quick=quick, extra=extra, checkpoint_dirpath=checkpoint_dirpath, split=split, arm=arm
    )
    name = run_name(mode, seed, split[0] if split else "", arm.label)
    return Run(
        mode=mode,
        seed=seed,
        command=command,
        save_dir=out / "runs",
        log_out=out / "logs" / f"{name}.out",
        log_err=out / "logs" / f"{name}.err",
        split=split[0] if split else "",
        arm=arm.label,
    )


# ------------------------------------------------------------------ running
def _versions(folder: Path) -> dict[Path, float]:
    return {p: p.stat().st_mtime for p in folder.glob("version_*") if p.is_dir()} if folder.is_dir() else {}


def _version_number(path: Path) -> int:
    try:
        return int(path.name.split("_", 1)[1])
    except (IndexError, ValueError):
        return -1


def execute(run: Run, env: dict[str, str]) -> None:
    """Run ``run.command``; record its wall and CPU seconds, find the logger version folder it made, read it.

    The CPU time is this child's own user + system time and that of the processes it waited for (its
    ``wait4`` usage), so runs going side by side (``--jobs``) do not count each other's.
    """
    run.log_out.parent.mkdir(parents=True, exist_ok=True)
    folder = run.save_dir / run.name
    before = _versions(folder)
    start = time.perf_counter()
    with run.log_out.open("w") as out, run.log_err.open("w") as err:
        out.write(" ".join(run.command) + "\n\n")
        out.flush()
        proc = subprocess.Popen(run.command, stdout=out, stderr=err, env=env)
        try:
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = run.returncode = os.waitstatus_to_exitcode(status)
            run.cpu_seconds = usage.ru_utime + usage.ru_stime
        except BaseException:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise
    run.seconds = time.perf_counter() - start
    after = _versions(folder)
    new = [p for p in after if p not in before or after[p] != before[p]]
    if new:
        run.version_dir = max(new, key=_version_number)
    metrics = run.version_dir / "metrics.csv" if run.version_dir else None
    if run.returncode == 0 and metrics is not None and metrics.is_file():
        run.final, run.final_step, run.series = read_validation(metrics, fit=run.mode not in BASE_MODES)
        run.train_cpu = read_train_cpu(metrics)


def tail(path: Path, lines: int = STDERR_TAIL) -> str:
    """The last ``lines`` lines of a run's stderr, progress bars reduced to their last state."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no stderr written)"
    rows = [row.rsplit("\r", 1)[-1] for row in text.splitlines()]
    return "\n".join(rows[-lines:]) or "(stderr is empty)"
