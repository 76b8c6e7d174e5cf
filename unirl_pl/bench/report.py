"""The bench's printed report: one per-phase table per gate setting, and the gate overhead of both."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from unirl_pl.bench.record import PHASES, PROJECT_ONLY, RunResult


def format_table(result: RunResult, recipe: str, repeats: int, warmup: int) -> str:
    """The per-phase table of one gate setting (milliseconds of CPU time per step)."""
    ms = 1000.0
    n = result.images_per_step
    tokens = statistics.median(result.tokens) if result.tokens else 0
    lines = [
        f"{recipe}: {n} images/step, gates {'on' if result.gates else 'off'}, median of {len(result.project)} "
        f"steps after {warmup} warmup (decode {tokens:g} tokens); CPU ms per step",
        f"{'phase':<14}{'project median (min-max)':>30}{'floor median':>14}{'ratio':>8}",
    ]
    for phase in PHASES:
        proj = result.median("project", phase)
        lo, hi = result.span("project", phase)
        floor = result.median("floor", phase)
        ratio = f"{proj / floor:.2f}" if phase not in PROJECT_ONLY and floor > 1e-9 else "-"
        lines.append(f"{phase:<14}{f'{proj * ms:.1f} ({lo * ms:.1f}-{hi * ms:.1f})':>30}{floor * ms:>14.1f}{ratio:>8}")
    proj, floor = result.median("project", "total"), result.median("floor", "total")
    lo, hi = result.span("project", "total")
    lines.append(
        f"{'total':<14}{f'{proj * ms:.1f} ({lo * ms:.1f}-{hi * ms:.1f})':>30}{floor * ms:>14.1f}{result.ratio:>8.2f}"
    )
    lines.append(f"images/s (CPU): project {n / proj:.1f}, floor {n / floor:.1f}")
    if result.gates:
        parity = (
            f"parity check {result.parity_cost * ms:.1f} ms every {result.parity_every} steps"
            if result.parity_every
            else "no parity gate"
        )
        lines.append(f"gates: {result.gate_share:.1%} of the rest of the step ({parity})")
    return "\n".join(lines)


@dataclass
class BenchResult:
    """Both gate settings' runs (whichever were asked for) and the printed report."""

    runs: dict[str, RunResult]
    report: str

    @property
    def gate_overhead(self) -> float | None:
        """Total ratio with gates on over total ratio with gates off, minus 1 (None unless both ran)."""
        if "on" not in self.runs or "off" not in self.runs:
            return None
        return self.runs["on"].ratio / self.runs["off"].ratio - 1


def format_report(runs: dict[str, RunResult], recipe: str, repeats: int, warmup: int) -> BenchResult:
    """Each run's table, then (when both gate settings ran) the gate overhead both ways."""
    tables = [format_table(r, recipe, repeats, warmup) for r in runs.values()]
    result = BenchResult(runs, "")
    if result.gate_overhead is not None:
        tables.append(
            f"gate overhead (total ratio on / off - 1): {result.gate_overhead:+.1%}; "
            f"measured share with gates on: {runs['on'].gate_share:.1%}"
        )
    result.report = "\n\n".join(tables)
    return result
