"""The paired report: ``paired.md`` and ``paired.csv``, mode against mode (and arm against arm) seed by seed.

Runs with the same seed share their training seed, their held-out prompts and the serve path's noise
(the recipe's ``data.val_seed``), so the per-seed difference A - B removes what the seed does to both and
leaves what the mode does. For each pair, on each split and for every held-out metric (strict and soft,
overall and per category): the per-seed differences, their mean, a 95% confidence interval of that mean
(Student's t, n - 1 degrees of freedom), and how many seeds each side wins.
"""

from __future__ import annotations

import csv
import itertools
from pathlib import Path

from unirl_pl.ablate.metrics import headers, metric_order, strict_overall
from unirl_pl.ablate.report import fmt, split_names
from unirl_pl.ablate.runs import TRAINING_MODES, Run, group_name
from unirl_pl.ablate.stats import Paired, paired

LEVEL = 0.95
CSV_COLUMNS = (
    "split",
    "a",
    "b",
    "metric",
    "stat",
    "seed",
    "value_a",
    "value_b",
    "diff",
    "n",
    "sd_diff",
    "t",
    "ci_low",
    "ci_high",
    "wins_a",
    "wins_b",
    "ties",
    "reading",
)


def pairs(modes: list[str], arms: list[str]) -> list[tuple[str, str]]:
    """The ``(A, B)`` groups to compare: the training modes pairwise within each arm, joint first
    (joint - prompt_only, joint - generator_only, prompt_only - generator_only), then the arms
    pairwise within each training mode. The base rows have no training seed to pair on."""
    trained = [m for m in TRAINING_MODES if m in modes]
    out = [(group_name(a, arm), group_name(b, arm)) for arm in arms for a, b in itertools.combinations(trained, 2)]
    out += [(group_name(m, x), group_name(m, y)) for m in trained for x, y in itertools.combinations(arms, 2)]
    return out


def by_seed(runs: list[Run], group: str, split: str, metric: str) -> dict[int, float]:
    """``seed -> value`` of ``metric`` at the last validation of the finished runs of ``group`` on ``split``."""
    return {
        r.seed: r.final[metric] for r in runs if r.group == group and r.split == split and r.ok and metric in r.final
    }


def compare(runs: list[Run], a: str, b: str, split: str) -> dict[str, Paired]:
    """``metric -> Paired(a, b)`` for every metric both groups logged on ``split`` (on at least one common seed)."""
    keys = {k for r in runs if r.split == split and r.ok and r.group in (a, b) for k in r.final}
    found = {m: paired(by_seed(runs, a, split, m), by_seed(runs, b, split, m), LEVEL) for m in metric_order(keys)}
    return {m: p for m, p in found.items() if p.n}


def _interval(p: Paired) -> str:
    return "–" if p.n < 2 else f"[{p.ci_low:+.3f}, {p.ci_high:+.3f}]"


def write_paired_csv(path: Path, runs: list[Run], modes: list[str], arms: list[str], main: str) -> None:
    """Per split, pair and metric: a ``stat=seed`` row per common seed (a, b, a - b), then a ``stat=mean``
    row (the means, sd of the differences, t, the interval, wins, reading)."""
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_COLUMNS)
        for split, label in split_names(runs, main).items():
            for a, b in pairs(modes, arms):
                for metric, p in compare(runs, a, b, split).items():
                    for seed, x, y, d in zip(p.seeds, p.a, p.b, p.diffs, strict=True):
                        writer.writerow([label, a, b, metric, "seed", seed, fmt(x), fmt(y), fmt(d), 1, *[""] * 8])
                    stats = [
                        p.n,
                        fmt(p.sd),
                        fmt(p.t),
                        fmt(p.ci_low),
                        fmt(p.ci_high),
                        p.wins_a,
                        p.wins_b,
                        p.ties,
                        p.reading,
                    ]
                    writer.writerow(
                        [label, a, b, metric, "mean", "", fmt(p.mean_a), fmt(p.mean_b), fmt(p.mean), *stats]
                    )


def intro(level: float = LEVEL) -> list[str]:
    """What the numbers of ``paired.md`` are, said once at its top."""
    pct = f"{level:.0%}"
    return [
        "# Paired differences between modes",
        "",
        "- A − B is taken seed by seed, on the seeds both ran: the same training seed, and the same held-out "
        "prompts and validation noise in every run, so the seed's effect on both sides cancels.",
        f"- Interval: {pct} confidence interval of the mean paired difference, Student's t with n − 1 degrees "
        f"of freedom: mean ± t_{{{(1 + level) / 2:.3g}, n−1}} · sd / √n, sd the sample standard deviation of "
        "the per-seed differences; n is given per pair (no interval for n = 1).",
        "- Reading: `interval above 0`, `includes 0` or `below 0`. Wins: seeds where A is higher / where B is "
        "higher / equal.",
        "- Each held-out score is the run's last validation. Per category the scores rest on fewer prompts "
        "than overall and move in coarser steps.",
    ]


def write_paired_markdown(path: Path, runs: list[Run], modes: list[str], arms: list[str], main: str) -> None:
    """``paired.md``: a summary of the overall scores, then per split and pair the per-seed differences
    and a row per metric (means, mean difference, interval, wins, reading)."""
    lines = intro()
    todo = pairs(modes, arms)
    if not todo:
        lines += ["", "No two training modes (or arms) in this ablation: nothing to pair."]
        path.write_text("\n".join(lines) + "\n")
        return
    names = split_names(runs, main)
    summary = ["| split | A − B | metric | n | mean A | mean B | mean A − B | 95% CI (t) | wins A/B/ties | reading |"]
    summary.append("|---|---|---|---|---|---|---|---|---|---|")
    sections: list[str] = []
    for split, label in names.items():
        sections += ["", f"## {label} split"]
        for a, b in todo:
            found = compare(runs, a, b, split)
            if not found:
                sections += ["", f"### {a} − {b}", "", "No seed where both finished."]
                continue
            strict = strict_overall(found)
            head = [m for m in (strict, strict.replace("/strict/", "/soft/") if strict else None) if m in found]
            for metric, header in headers(head):
                summary.append(f"| {label} | {a} − {b} | {header} | " + " | ".join(_stat_cells(found[metric])) + " |")
            sections += _pair_section(a, b, found, head)
    path.write_text("\n".join([*lines, "", "## Summary (overall scores)", "", *summary, *sections]) + "\n")


def _stat_cells(p: Paired) -> list[str]:
    means = [f"{p.mean_a:.3f}", f"{p.mean_b:.3f}", f"{p.mean:+.3f}", _interval(p)]
    return [str(p.n), *means, f"{p.wins_a}/{p.wins_b}/{p.ties}", p.reading]


def _pair_section(a: str, b: str, found: dict[str, Paired], head: list[str]) -> list[str]:
    first = found[head[0]] if head else next(iter(found.values()))
    t_text = f", t_{{{(1 + LEVEL) / 2:.3g}, {first.n - 1}}} = {first.t:.3f}" if first.n >= 2 else ""
    seeds = " ".join(map(str, first.seeds))
    lines = ["", f"### {a} − {b} (n = {first.n}: seeds {seeds}{t_text})", ""]
    if head:
        cols = headers(head)
        lines.append("| seed | " + " | ".join(f"{a} {h} | {b} {h} | A − B {h}" for _, h in cols) + " |")
        lines.append("|---|" + "---|---|---|" * len(cols))
        for seed in found[head[0]].seeds:
            cells = []
            for metric, _ in cols:
                p = found[metric]
                at = p.seeds.index(seed) if seed in p.seeds else None
                cells += ["–"] * 3 if at is None else [f"{p.a[at]:.3f}", f"{p.b[at]:.3f}", f"{p.diffs[at]:+.3f}"]
            lines.append(f"| {seed} | " + " | ".join(cells) + " |")
        lines.append("")
    lines.append("| metric | n | mean A | mean B | mean A − B | 95% CI (t) | wins A/B/ties | reading |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for metric, header in headers(list(found)):
        lines.append(f"| {header} | " + " | ".join(_stat_cells(found[metric])) + " |")
    return lines


def write_paired(out: Path, runs: list[Run], modes: list[str], arms: list[str], main: str) -> None:
    """Write ``<out>/paired.csv`` and ``<out>/paired.md``."""
    write_paired_csv(out / "paired.csv", runs, modes, arms, main)
    write_paired_markdown(out / "paired.md", runs, modes, arms, main)
