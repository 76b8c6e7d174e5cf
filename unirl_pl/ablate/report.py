"""The ablation's table: ``ablation.csv`` and ``ablation.md``, mean ± std over seeds per row and split.

A row is a group of runs: a mode, or a mode and an arm (``joint-mix_grpo``) when the ablation varies a
config key. Every number is taken from each run's last validation; the wall and CPU seconds are the
run's own (the fit, or the base row's validate), an extra split's validation being counted apart.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

from unirl_pl.ablate.metrics import headers, metric_order, strict_overall
from unirl_pl.ablate.runs import Run
from unirl_pl.ablate.stats import mean_std

Table = dict[str, dict[str, tuple[float, float, int]]]
CSV_COLUMNS = (
    "split",
    "mode",
    "arm",
    "seed",
    "stat",
    "metric",
    "value",
    "rl_steps",
    "n_seeds",
    "wall_s",
    "cpu_s",
    "run_dir",
)


def aggregate(runs: list[Run], groups: list[str], split: str = "") -> Table:
    """``group -> metric -> (mean, std, n_seeds)`` over the finished runs of one split."""
    table: Table = {}
    for group in groups:
        done = [r for r in runs if r.group == group and r.split == split and r.ok]
        keys = {k for r in done for k in r.final}
        table[group] = {}
        for metric in metric_order(keys):
            values = [r.final[metric] for r in done if metric in r.final]
            table[group][metric] = (*mean_std(values), len(values))
    return table


def fmt(value: float | None) -> str:
    """A number for a CSV cell: 6 significant digits, empty for nan or None."""
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.6g}"


def split_names(runs: list[Run], main: str) -> dict[str, str]:
    """``Run.split -> the name written in the outputs``: the main split first, then the extra ones."""
    names = {"": main}
    for run in runs:
        names.setdefault(run.split, run.split)
    return names


def write_csv(path: Path, runs: list[Run], groups: list[str], main: str = "composition") -> None:
    """Per split: one ``stat=value`` row per run x metric with its wall and CPU seconds, then ``stat=mean``
    and ``stat=std`` rows per group x metric (their seconds: the mean and std over the group's runs);
    ``split`` is ``main`` for the recipe's own validation."""
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_COLUMNS)
        for split, label in split_names(runs, main).items():
            _split_rows(writer, [r for r in runs if r.split == split], groups, split, label)


def _split_rows(writer: Any, runs: list[Run], groups: list[str], split: str, label: str) -> None:
    table = aggregate(runs, groups, split)
    for group in groups:
        done = [r for r in runs if r.group == group and r.ok]
        if not done:
            continue
        mode, arm = done[0].mode, done[0].arm
        for run in done:
            for metric in metric_order(run.final):
                row = [label, mode, arm, run.seed, "value", metric, fmt(run.final[metric]), run.final_step, 1]
                writer.writerow([*row, f"{run.seconds:.1f}", f"{run.cpu_seconds:.1f}", run.version_dir])
        steps = sorted({r.final_step for r in done if r.final_step is not None})
        last = steps[-1] if steps else ""
        wall, cpu = mean_std([r.seconds for r in done]), mean_std([r.cpu_seconds for r in done])
        for stat, index in (("mean", 0), ("std", 1)):
            for metric, stats in table[group].items():
                row = [label, mode, arm, "", stat, metric, fmt(stats[index]), last, stats[2]]
                writer.writerow([*row, fmt(wall[index]), fmt(cpu[index]), ""])


def cell(mean: float, std: float) -> str:
    """``mean ± std`` to three decimals (``–`` for a missing std or value)."""
    if math.isnan(mean):
        return "–"
    return f"{mean:.3f} ± {'–' if math.isnan(std) else f'{std:.3f}'}"


INTRO = (
    "Each cell is `mean ± std` over seeds of the held-out score at the run's last validation "
    "(std: sample standard deviation, n - 1; `–` with a single seed). Strict = every constraint of "
    "the scene holds (GenEval accuracy); soft = fraction of constraints that hold. `base` = the "
    "recipe's starting weights validated before any RL step, refiner in front of the DiT (where every "
    "mode starts: all run the whole pipeline and differ only in which experts learn); "
    "`base_no_refiner` = the same DiT on the user's prompts, no refiner. CPU s = user + system CPU "
    "seconds of the run's process (the extra splits' validations not included). Paired differences "
    "between modes: `paired.md`."
)


def write_markdown(
    path: Path, runs: list[Run], groups: list[str], meta: dict[str, str], main: str = "composition"
) -> None:
    """Per split (the main one first), a table with one row per group and a column per metric as
    ``mean ± std`` over seeds; then every run of the main split with its seconds and overall scores."""
    lines = ["# Ablation: held-out scores by mode", "", *(f"- {key}: {value}" for key, value in meta.items())]
    lines += ["", INTRO]
    for split, label in split_names(runs, main).items():
        note = " (the recipe's validation prompts)" if not split else " (scored after each run)"
        lines += ["", f"## {label} split{note}", "", *_table([r for r in runs if r.split == split], groups, split)]
    lines += ["", f"## Runs ({main} split)", "", *_run_rows([r for r in runs if not r.split and r.ok], groups)]
    lines += _cost_section([r for r in runs if not r.split and r.ok], groups, main)
    failed = [r for r in runs if r.returncode is not None and not r.ok]
    if failed:
        lines += ["", "Failed runs (not in the tables):", ""]
        lines += [f"- `{r.name}`: exit {r.returncode}, stderr in `{r.log_err}`" for r in failed]
    path.write_text("\n".join(lines) + "\n")


def _table(runs: list[Run], groups: list[str], split: str) -> list[str]:
    table = aggregate(runs, groups, split)
    columns = headers(metric_order({m for row in table.values() for m in row}))
    lines = [
        "| mode | seeds | RL steps | wall s (mean) | CPU s (mean) | " + " | ".join(h for _, h in columns) + " |",
        "|---|---|---|---|---|" + "---|" * len(columns),
    ]
    for group in groups:
        done = [r for r in runs if r.group == group and r.ok]
        if not done:
            lines.append("| " + " | ".join([group, "–", "–", "–", "–", *("–" for _ in columns)]) + " |")
            continue
        steps = sorted({r.final_step for r in done if r.final_step is not None})
        wall = sum(r.seconds for r in done) / len(done)
        cpu = sum(r.cpu_seconds for r in done) / len(done)
        cells = [cell(*table[group][m][:2]) if m in table[group] else "–" for m, _ in columns]
        seeds = " ".join(str(r.seed) for r in done)
        step_text = "/".join(str(s) for s in steps) or "–"
        lines.append("| " + " | ".join([group, seeds, step_text, f"{wall:.0f}", f"{cpu:.0f}", *cells]) + " |")
    return lines


def cost_points(run: Run) -> list[tuple[int, float, float]]:
    """``(RL steps done, training CPU s, held-out strict overall)`` at each validation of a fit that logged
    its training CPU time (:class:`unirl_pl.callbacks.TrainCPUClock`)."""
    metric = strict_overall(run.series)
    scores = dict(run.series.get(metric, [])) if metric else {}
    return [(x, cpu, scores[x]) for x, cpu in run.train_cpu if x in scores]


def write_cost_csv(path: Path, runs: list[Run]) -> None:
    """``cost.csv``: a row per run x validation, its training CPU seconds and held-out strict overall."""
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(("mode", "arm", "seed", "rl_steps", "train_cpu_s", "strict_overall"))
        for run in runs:
            if not run.split and run.ok:
                for x, cpu, strict in cost_points(run):
                    writer.writerow((run.mode, run.arm, run.seed, x, f"{cpu:.1f}", fmt(strict)))


def cost_curves(runs: list[Run], groups: list[str]) -> dict[str, list[tuple[int, float, float, float, int]]]:
    """``group -> [(step, mean training CPU s, strict mean, strict std, n), ...]`` over its seeds, per validation."""
    curves: dict[str, list[tuple[int, float, float, float, int]]] = {}
    for group in groups:
        by_step: dict[int, list[tuple[float, float]]] = {}
        for run in runs:
            if run.group == group and not run.split and run.ok:
                for x, cpu, strict in cost_points(run):
                    by_step.setdefault(x, []).append((cpu, strict))
        curve = []
        for x, found in sorted(by_step.items()):
            mean, std = mean_std([s for _, s in found])
            curve.append((x, sum(c for c, _ in found) / len(found), mean, std, len(found)))
        if curve:
            curves[group] = curve
    return curves


def reach(curve: list[tuple[int, float, float, float, int]], target: float) -> tuple[int, float] | None:
    """``(step, mean training CPU s)`` of the first validation whose mean strict is at least ``target``."""
    return next(((x, cpu) for x, cpu, mean, _, _ in curve if mean >= target), None)


def _cost_section(runs: list[Run], groups: list[str], main: str) -> list[str]:
    """Per group and validation: mean training CPU seconds and held-out strict (mean ± std over seeds); and
    where each group first reaches the first group's final mean strict, in steps and in CPU."""
    curves = cost_curves(runs, groups)
    if not curves:
        return []
    steps = sorted({x for curve in curves.values() for x, *_ in curve})
    reference = next(iter(curves))
    ref_step, ref_cpu, ref_strict, _, _ = curves[reference][-1]
    lines = [
        "",
        f"## Held-out strict against training CPU seconds ({main} split)",
        "",
        "Each cell: strict overall `mean ± std` over seeds after that many RL steps, and the mean CPU seconds "
        "of training spent to get there (validation excluded; `unirl_pl.callbacks.TrainCPUClock`). The last "
        f"column: the first validation at which the row's mean reaches `{reference}`'s mean after step "
        f"{ref_step} ({ref_strict:.3f}, {ref_cpu:.0f} CPU s), and that CPU as a fraction of its. Every point: "
        "`cost.csv`.",
        "",
        "| mode | " + " | ".join(f"step {x}" for x in steps) + f" | reaches {reference} @ {ref_step} |",
        "|---|" + "---|" * (len(steps) + 1),
    ]
    for group, curve in curves.items():
        at = {x: (cpu, mean, std) for x, cpu, mean, std, _ in curve}
        cells = [f"{cell(at[x][1], at[x][2])} ({at[x][0]:.0f} CPU s)" if x in at else "–" for x in steps]
        found = reach(curve, ref_strict)
        cells.append(f"step {found[0]}, {found[1]:.0f} CPU s ({found[1] / ref_cpu:.2f}x)" if found else "not reached")
        lines.append(f"| {group} | " + " | ".join(cells) + " |")
    return lines


def _run_rows(runs: list[Run], groups: list[str]) -> list[str]:
    strict = strict_overall({k for r in runs for k in r.final})
    soft = strict.replace("/strict/", "/soft/") if strict else None
    lines = ["| run | wall s | CPU s | strict overall | soft overall |", "|---|---|---|---|---|"]
    order = {g: i for i, g in enumerate(groups)}
    for run in sorted(runs, key=lambda r: (order.get(r.group, len(order)), r.seed)):
        scores = [f"{run.final[m]:.3f}" if m in run.final else "–" for m in (strict, soft)]
        lines.append(f"| {run.name} | {run.seconds:.0f} | {run.cpu_seconds:.0f} | " + " | ".join(scores) + " |")
    return lines
