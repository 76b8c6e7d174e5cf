"""``python -m unirl_pl ablate``: its arguments, the order of the runs, and what it writes after each one.

Every (mode, arm, seed) is one run (:mod:`unirl_pl.ablate.runs`); after a run finishes, each
``--extra-val`` split scores its result. After every run ``<out>/ablation.{csv,md,png}`` and
``<out>/paired.{csv,md}`` (and, with ``--vary``, ``<out>/strict_vs_cpu.png``) are rewritten, so an
interrupted or partly failed ablation keeps what finished. A failed run makes the command exit 1, naming
the run and showing the tail of its stderr; the other runs still run (``--fail-fast`` stops).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unirl_pl.ablate.arms import Arm, build_arms, parse_vary
from unirl_pl.ablate.metrics import read_train_cpu, read_validation
from unirl_pl.ablate.paired import write_paired
from unirl_pl.ablate.plot import draw_plot, draw_strict_vs_cpu
from unirl_pl.ablate.report import write_cost_csv, write_csv, write_markdown
from unirl_pl.ablate.runs import (
    BASE_MODES,
    MODES,
    QUICK,
    Run,
    _version_number,
    execute,
    group_name,
    last_callback_is_checkpoint,
    make_run,
    tail,
)
from unirl_pl.threads import set_threads

PROG = "python -m unirl_pl ablate"
DEFAULT_EXTRA_VAL = (
    "vocabulary",
    Path(__file__).resolve().parents[1] / "assets" / "shapes" / "prompts_vocabulary.jsonl",
)


def parse_split(text: str) -> tuple[str, Path]:
    """``NAME=FILE`` of ``--extra-val``."""
    name, sep, file = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z0-9_-]+", name) or not file:
        raise argparse.ArgumentTypeError(f"expected NAME=FILE (NAME: letters, digits, _ or -), got {text!r}")
    path = Path(file)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{file} does not exist")
    return name, path.resolve()


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The ablation's own arguments, and those after ``--`` (appended to every run's command line).

    ``args.arms`` holds the arms of ``--vary`` (one unlabelled arm without it).
    """
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Run every mode over several seeds (one subprocess each), tabulate held-out strict/soft "
        "scores as mean ± std, and compare modes seed by seed (paired.md). Arguments after -- are passed to "
        "every run.",
        epilog="examples: python -m unirl_pl ablate --config recipes/joint.yaml --seeds 0 1 2 3 4; "
        "... --modes generator_only joint --vary model.generator_algorithm=flow_grpo,mix_grpo",
    )
    parser.add_argument("--config", required=True, help="the recipe every run uses (e.g. recipes/joint.yaml)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds (default: 0 1 2)")
    parser.add_argument(
        "--modes", nargs="+", choices=MODES, default=list(MODES), help="modes (default: all; base = no RL)"
    )
    parser.add_argument(
        "--vary",
        action="append",
        type=parse_vary,
        default=[],
        metavar="KEY=V1,V2,...",
        help="run every mode and seed once per value of a config key (repeat to cross several keys). For "
        "model.generator_algorithm and model.llm_algorithm a bare name is the overlay recipes/algorithms/<name>.yaml "
        "(an extra --config); otherwise --KEY=V is passed",
    )
    parser.add_argument("--out", default="runs/ablation", help="output folder (default: runs/ablation)")
    parser.add_argument("--quick", action="store_true", help="smoke setting: 2 steps, tiny batches (seconds a run)")
    parser.add_argument("--fail-fast", action="store_true", help="stop at the first failed run")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: rewrite the tables, paired report and plots from the runs already in --out (their "
        "metrics.csv, and the seconds recorded in its ablation.csv)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs side by side, one thread each (default: 1; up to the number of cores); results do not change",
    )
    parser.add_argument(
        "--val-name", default="composition", help="name of the recipe's own validation split (default: composition)"
    )
    parser.add_argument(
        "--extra-val",
        nargs="*",
        type=parse_split,
        default=[DEFAULT_EXTRA_VAL] if DEFAULT_EXTRA_VAL[1].is_file() else [],
        metavar="NAME=FILE",
        help="more prompt files to score each run's result on, after it finishes (default: the shipped "
        "ShapesWorld vocabulary split; give the flag with nothing after it for none)",
    )
    args = parser.parse_args(argv)
    if not Path(args.config).is_file():
        parser.error(f"--config: {args.config} does not exist")
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds: repeated seed in {args.seeds}")
    args.modes = list(dict.fromkeys(args.modes))
    try:
        args.arms = build_arms(args.vary, args.config)
    except ValueError as error:
        parser.error(str(error))
    return args, extra


@dataclass
class Plan:
    """The runs of an ablation, in the order they run, each with its extra-split validations."""

    runs: list[Run]
    splits: dict[str, list[Run]]  # run name -> its validations on the extra splits
    groups: list[str]  # the rows of the tables: mode-major, then arm
    modes: list[str]
    arms: list[str]

    @property
    def varied(self) -> bool:
        """Whether ``--vary`` gave arms (then ``strict_vs_cpu.png`` is drawn)."""
        return self.arms != [""]

    def finished(self) -> list[Run]:
        """The runs that ran, each followed by its extra-split validations."""
        return [x for r in self.runs if r.returncode is not None for x in (r, *self.splits[r.name])]


def plan(args: argparse.Namespace, extra: list[str], out: Path, checkpoint: bool) -> Plan:
    """Every run of ``args``: seeds outermost (a stopped ablation has whole seeds), then arms, then modes."""
    arms: list[Arm] = args.arms
    runs = [
        make_run(args.config, mode, seed, out, arm, quick=args.quick, extra=extra, checkpoint_dirpath=checkpoint)
        for seed in args.seeds
        for arm in arms
        for mode in args.modes
    ]
    by_label = {arm.label: arm for arm in arms}
    splits = {
        run.name: [
            make_run(args.config, run.mode, run.seed, out, by_label[run.arm], quick=args.quick, extra=extra, split=s)
            for s in args.extra_val
        ]
        for run in runs
    }
    groups = [group_name(mode, arm.label) for mode in args.modes for arm in arms]
    return Plan(runs, splits, groups, list(args.modes), [arm.label for arm in arms])


def write_outputs(out: Path, the_plan: Plan, meta: dict[str, str], main: str) -> None:
    """Rewrite every output from the runs finished so far."""
    runs = the_plan.finished()
    write_csv(out / "ablation.csv", runs, the_plan.groups, main)
    write_markdown(out / "ablation.md", runs, the_plan.groups, meta, main)
    draw_plot(out / "ablation.png", runs, the_plan.groups)
    write_paired(out, runs, the_plan.modes, the_plan.arms, main)
    write_cost_csv(out / "cost.csv", runs)
    if the_plan.varied:
        draw_strict_vs_cpu(out / "strict_vs_cpu.png", runs, the_plan.groups)


def reload_runs(the_plan: Plan, out: Path, main: str) -> int:
    """Fill the plan's runs from what an earlier ablation left in ``out``: each run's newest logger version
    folder with a ``metrics.csv``, and its wall and CPU seconds from ``ablation.csv``; the number found."""
    import csv

    seconds: dict[tuple[str, str, str, str], tuple[float, float]] = {}
    table = out / "ablation.csv"
    if table.is_file():
        with table.open(newline="") as f:
            for row in csv.DictReader(f):
                if row["stat"] == "value":
                    split = "" if row["split"] == main else row["split"]
                    key = (split, row["mode"], row["arm"], row["seed"])
                    seconds[key] = (float(row["wall_s"] or "nan"), float(row["cpu_s"] or "nan"))
    found = 0
    for run in (x for r in the_plan.runs for x in (r, *the_plan.splits[r.name])):
        folder = out / "runs" / run.name
        versions = sorted(folder.glob("version_*/metrics.csv"), key=lambda p: _version_number(p.parent))
        if not versions:
            continue
        run.final, run.final_step, run.series = read_validation(versions[-1], fit=run.mode not in BASE_MODES)
        if not run.final:  # still running, or stopped before its last validation: not a finished run
            continue
        run.returncode, run.version_dir = 0, versions[-1].parent
        run.train_cpu = read_train_cpu(versions[-1])
        run.seconds, run.cpu_seconds = seconds.get((run.split, run.mode, run.arm, str(run.seed)), (math.nan, math.nan))
        found += run.split == ""
    return found


def describe(args: argparse.Namespace, extra: list[str], out: Path) -> dict[str, str]:
    """The settings listed at the top of ``ablation.md``."""
    meta = {
        "recipe": f"`{args.config}`",
        "seeds": " ".join(map(str, args.seeds)),
        "setting": "`--quick` (smoke: " + " ".join(QUICK) + ")" if args.quick else "the recipe's",
        "extra overrides": f"`{' '.join(extra)}`" if extra else "none",
        "command of each run": f"`{out / 'logs'}/<mode>[-<arm>]_s<seed>[_<split>].out` (first line)",
        "splits": ", ".join(
            [f"{args.val_name} (the recipe's validation prompts)"] + [f"{n} (`{p}`)" for n, p in args.extra_val]
        ),
    }
    if len(args.arms) > 1 or args.arms[0].label:
        meta["arms (--vary)"] = "; ".join(f"`{a.label}`: `{a.describe()}`" for a in args.arms)
    return meta


def _progress(console):
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (
        SpinnerColumn(),
        TextColumn("[bold]runs"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[current]}"),
        TextColumn("elapsed"),
        TimeElapsedColumn(),
        TextColumn("left"),
        TimeRemainingColumn(),
    )
    # Runs last minutes: estimate the time left from all of them, not the default last 30 s.
    return Progress(*columns, console=console, speed_estimate_period=24 * 3600)


def run_all(the_plan: Plan, env: dict[str, str], console, fail_fast: bool, on_done, jobs: int = 1) -> list[Run]:
    """Run the plan, ``jobs`` runs at a time (each followed by its extra-split scoring), printing each result
    and calling ``on_done()`` after each run; the failed runs."""
    failed: list[Run] = []
    lock = threading.Lock()
    stop = threading.Event()
    total = sum(1 + len(v) for v in the_plan.splits.values())
    with _progress(console) as progress:
        task = progress.add_task("ablation", total=total, current="")
        running: list[str] = []

        def show() -> None:
            progress.update(task, current=", ".join(f"running [cyan]{name}[/]" for name in running))

        def one(run: Run) -> None:
            if stop.is_set():
                return
            with lock:
                running.append(run.name)
                show()
            execute(run, env)
            with lock:
                report(progress, run, failed)
                progress.advance(task)
            for split_run in the_plan.splits[run.name] if run.ok else ():
                execute(split_run, env)
                split_run.final_step = run.final_step
                with lock:
                    if not split_run.ok:
                        failed.append(split_run)
                        progress.console.print(f"[red]FAILED[/] {split_run.name}; stderr: {split_run.log_err}")
                    progress.advance(task)
            with lock:
                running.remove(run.name)
                show()
                on_done()
                if failed and fail_fast:
                    stop.set()

        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            for future in [pool.submit(one, run) for run in the_plan.runs]:
                future.result()
        progress.update(task, current="")
    return failed


def report(progress: Any, run: Run, failed: list[Run]) -> None:
    """Print one finished run's result (or failure)."""
    if run.ok:
        score = {k.split("/", 1)[1]: v for k, v in run.final.items()}
        progress.console.print(
            f"[green]done[/] {run.name}: {run.seconds:.0f} s ({run.cpu_seconds:.0f} CPU s), held-out strict "
            f"{score.get('strict/overall', math.nan):.3f} / soft {score.get('soft/overall', math.nan):.3f}"
        )
    else:
        failed.append(run)
        why = f"exit {run.returncode}" if run.returncode else "no held-out metrics in its metrics.csv"
        progress.console.print(f"[red]FAILED[/] {run.name} ({why}); stderr: {run.log_err}")


def report_failures(failed: list[Run]) -> None:
    """Each failed run's command and the tail of its stderr, then one line naming them all."""
    for run in failed:
        why = f"exit status {run.returncode}" if run.returncode else "no held-out metrics logged"
        print(
            f"error: run {run.name} failed ({why}). Command: {' '.join(run.command)}\n"
            f"Last lines of its stderr ({run.log_err}):\n{tail(run.log_err)}\n",
            file=sys.stderr,
        )
    names = ", ".join(r.name for r in failed)
    print(f"error: {len(failed)} runs failed: {names}; the others' results are kept", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Run the ablation; the exit status: 0 when every run finished, 1 when one failed, 2 for bad arguments,
    130 on Ctrl-C."""
    from rich.console import Console

    args, extra = parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.jobs < 1:
        print(f"{PROG}: --jobs must be >= 1, got {args.jobs}", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    checkpoint = last_callback_is_checkpoint(Path(args.config))
    if not checkpoint and args.extra_val and any(m not in BASE_MODES for m in args.modes):
        print(f"{PROG}: --extra-val needs the fit's last.ckpt: the recipe's last callback must be a ModelCheckpoint")
        return 2
    out.mkdir(parents=True, exist_ok=True)
    the_plan = plan(args, extra, out, checkpoint)
    meta = describe(args, extra, out)
    env = dict(os.environ)
    set_threads(env=env)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    console = Console(stderr=True)
    arms = f" x arms {' '.join(the_plan.arms)}" if the_plan.varied else ""
    seeds = " ".join(map(str, args.seeds))
    console.print(f"ablation: {len(the_plan.runs)} runs ({' '.join(args.modes)}{arms} x seeds {seeds}) -> {out}")
    if not checkpoint:
        console.print(
            "note: the recipe's last callback is not a ModelCheckpoint; checkpoints keep their default folder"
        )

    def rewrite() -> None:
        write_outputs(out, the_plan, meta, args.val_name)

    if args.report_only:
        found = reload_runs(the_plan, out, args.val_name)
        rewrite()
        console.print(f"rewrote the reports of {found} finished runs in {out}")
        return 0 if found else 1

    try:
        failed = run_all(the_plan, env, console, args.fail_fast, rewrite, args.jobs)
    except KeyboardInterrupt:
        rewrite()
        console.print(f"interrupted; finished runs are in {out / 'ablation.md'}")
        return 130
    written = ["ablation.csv", "ablation.md", "ablation.png", "paired.csv", "paired.md", "cost.csv"]
    written += ["strict_vs_cpu.png"] if the_plan.varied else []
    console.print("wrote " + ", ".join(str(out / name) for name in written))
    if failed:
        report_failures(failed)
        return 1
    return 0
