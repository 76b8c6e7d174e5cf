"""Per-run table of a RewardHackingMonitor demonstration: when the monitor first alarmed, and when held-out strict fell.

    python scripts/monitor_demo_table.py runs/monitors_hack runs/monitors_main --out docs/data/monitors/runs.csv

Each argument is an ``ablate --out`` folder. For every training run in it (``<out>/runs/<mode>[-<arm>]_s<seed>``,
its newest ``version_N/metrics.csv``) the script writes one CSV row:

- ``alarms``: the final ``hack/alarms``; ``first_alarm_step`` and ``first_alarm_signal``: the first ``metrics.csv``
  step whose ``hack/alarms`` is above 0, and the signal(s) that raised it. The signals are found by replaying the
  run's logged ``hack/<signal>`` values through a default ``RewardHackingMonitor``'s ``observe`` (the same
  baselines and thresholds as a monitor attached with no init args; ``gold`` when none crossed there, i.e. the
  gold rule). All alarms are listed in ``all_alarms`` as ``signal@step``.
- ``base_strict``: held-out strict (overall, the recipe's validation split) before RL: the ``base`` row of
  the folders' ``ablation.csv`` or of ``--base-csv`` (an ablation.csv of the same recipe; base rows are identical
  across seeds, since validation noise does not follow the seed), else the run's first validation.
- ``strict_drop_step``: the first validation step at which strict is at least ``--drop`` (0.05) below
  ``base_strict`` (empty when it never is); ``alarm_lead_steps``: ``strict_drop_step - first_alarm_step``
  (positive: the monitor alarmed that many steps before the drop was seen).
- ``strict_fall_step``: the first validation step at which strict is at least ``--drop`` below the best strict
  before it (``base_strict`` included): a fall from where training had taken it, for a hack that first lets
  strict rise; ``alarm_lead_fall_steps``: ``strict_fall_step - first_alarm_step``.
- ``strict_by_step``: every validation's strict as ``step:value``; ``final_strict``: the last one.
- ``reward_first5`` and ``reward_last5``: the mean ``reward/mean`` over the first and last 5 training steps.

Steps are ``metrics.csv`` steps: a rollout's row is its ``global_step - 1``, the validation after N steps is at N - 1.
"""

from __future__ import annotations

import argparse
import csv
import math
import re
from pathlib import Path

from unirl_pl.callbacks.hacking import SIGNALS, RewardHackingMonitor

STRICT = "val/shapes_geneval/strict/overall"
RUN_RE = re.compile(r"^(?P<group>.+)_s(?P<seed>\d+)$")
FIELDS = [
    "ablation",
    "group",
    "seed",
    "alarms",
    "first_alarm_step",
    "first_alarm_signal",
    "all_alarms",
    "base_strict",
    "strict_drop_step",
    "alarm_lead_steps",
    "strict_fall_step",
    "alarm_lead_fall_steps",
    "final_strict",
    "strict_by_step",
    "reward_first5",
    "reward_last5",
]


def _float(text: str | None) -> float:
    try:
        return float(text) if text not in (None, "") else math.nan
    except ValueError:
        return math.nan


def base_strict(tables: list[Path]) -> float:
    """The ``base`` rows' held-out strict (overall, composition split) in the ablation.csv ``tables``; NaN if none."""
    for table in tables:
        if not table.is_file():
            continue
        for row in csv.DictReader(table.open()):
            if row["mode"] == "base" and row["stat"] == "value" and row["metric"] == "shapes_geneval/strict/overall":
                if row["split"] == "composition":
                    return float(row["value"])
    return math.nan


def newest_metrics(run: Path) -> Path | None:
    versions = sorted(run.glob("version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[-1]))
    return versions[-1] if versions else None


def summarize(metrics: Path, base: float, drop: float) -> dict[str, object]:
    """One run's row (all but its ablation, group and seed)."""
    rows = list(csv.DictReader(metrics.open()))
    steps: dict[int, dict[str, float]] = {}
    for row in rows:
        values = steps.setdefault(int(row["step"]), {})
        for key, text in row.items():
            value = _float(text)
            if key != "step" and math.isfinite(value):
                values[key] = value
    ordered = sorted(steps)
    # Replay the logged signals through a default monitor: its alarms, with their signals.
    monitor = RewardHackingMonitor()
    replayed: list[tuple[int, str]] = []
    for step in ordered:
        values = {name: steps[step][f"hack/{name}"] for name in SIGNALS if f"hack/{name}" in steps[step]}
        if values:
            replayed += [(a.step, a.signal) for a in monitor.observe(values, step)]
    alarm_steps = [s for s in ordered if steps[s].get("hack/alarms", 0.0) > 0]
    first = alarm_steps[0] if alarm_steps else None
    first_signals = [sig for s, sig in replayed if s == first]
    validations = [(s, steps[s][STRICT]) for s in ordered if STRICT in steps[s]]
    ref = base if math.isfinite(base) else (validations[0][1] if validations else math.nan)
    dropped = next((s for s, v in validations if v <= ref - drop + 1e-9), None)
    best, fell = ref, None
    for s, v in validations:
        if v <= best - drop + 1e-9:
            fell = s
            break
        best = max(best, v)
    rewards = [steps[s]["reward/mean"] for s in ordered if "reward/mean" in steps[s]]
    final_alarms = max((steps[s].get("hack/alarms", 0.0) for s in ordered), default=0.0)
    return {
        "alarms": int(final_alarms),
        "first_alarm_step": "" if first is None else first,
        "first_alarm_signal": "" if first is None else ("+".join(first_signals) or "gold"),
        "all_alarms": " ".join(f"{sig}@{s}" for s, sig in replayed),
        "base_strict": f"{ref:.4f}",
        "strict_drop_step": "" if dropped is None else dropped,
        "alarm_lead_steps": "" if first is None or dropped is None else dropped - first,
        "strict_fall_step": "" if fell is None else fell,
        "alarm_lead_fall_steps": "" if first is None or fell is None else fell - first,
        "final_strict": f"{validations[-1][1]:.4f}" if validations else "",
        "strict_by_step": " ".join(f"{s}:{v:.4f}" for s, v in validations),
        "reward_first5": f"{sum(rewards[:5]) / len(rewards[:5]):.4f}" if rewards else "",
        "reward_last5": f"{sum(rewards[-5:]) / len(rewards[-5:]):.4f}" if rewards else "",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path, help="ablate --out folders")
    parser.add_argument("--out", type=Path, required=True, help="the CSV to write")
    parser.add_argument("--base-csv", type=Path, help="an ablation.csv with base rows of the same recipe")
    parser.add_argument("--drop", type=float, default=0.05, help="how far strict must fall below base (absolute)")
    args = parser.parse_args()
    base = base_strict([f / "ablation.csv" for f in args.folders] + ([args.base_csv] if args.base_csv else []))
    table = []
    for folder in args.folders:
        for run in sorted((folder / "runs").iterdir()):
            match = RUN_RE.match(run.name)
            metrics = newest_metrics(run) if match else None
            if match is None or metrics is None or match["group"].startswith("base"):
                continue  # split validations (<name>_<split>) and the no-RL base rows have no training steps
            row = {"ablation": folder.name, "group": match["group"], "seed": int(match["seed"])}
            table.append(row | summarize(metrics, base, args.drop))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(table)
    print(f"wrote {len(table)} runs to {args.out}")


if __name__ == "__main__":
    main()
