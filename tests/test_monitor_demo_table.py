"""``scripts/monitor_demo_table.py``: the first alarm, the drop below base and the fall from the best strict, read
from a run's metrics.csv as the demonstration table in docs/monitors.md reports them."""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STRICT = "val/shapes_geneval/strict/overall"


@pytest.fixture(scope="module")
def table():
    spec = importlib.util.spec_from_file_location("monitor_demo_table", ROOT / "scripts" / "monitor_demo_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_metrics(path: Path, luminance: list[float], strict: dict[int, float]) -> Path:
    """A metrics.csv with one training row per step (its luminance, the alarm count a default monitor would log)
    and one validation row per ``strict`` step."""
    from unirl_pl.callbacks import RewardHackingMonitor

    monitor, rows = RewardHackingMonitor(), []
    for step, value in enumerate(luminance):
        monitor.observe({"luminance": value}, step)
        rows.append({"step": step, "hack/luminance": value, "hack/alarms": len(monitor.alarms), "reward/mean": 1.0})
        if step in strict:
            rows.append({"step": step, STRICT: strict[step]})
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["step", "hack/luminance", "hack/alarms", "reward/mean", STRICT])
        writer.writeheader()
        writer.writerows(rows)
    return path


def test_a_hack_that_lets_strict_rise_first_is_timed_from_its_best(table, tmp_path):
    # Luminance leaves its 5-step baseline (0.1) by more than 0.15 at step 8; strict rises to 0.5, then falls.
    luminance = [0.1] * 5 + [0.12, 0.15, 0.18, 0.3, 0.3, 0.35, 0.4, 0.45, 0.5, 0.55, 0.6]
    strict = {4: 0.40, 9: 0.50, 14: 0.44}
    row = table.summarize(write_metrics(tmp_path / "m.csv", luminance, strict), base=0.3, drop=0.05)
    assert (row["first_alarm_step"], row["first_alarm_signal"]) == (8, "luminance")
    assert row["strict_drop_step"] == "" and row["alarm_lead_steps"] == ""  # never 0.05 below base
    assert (row["strict_fall_step"], row["alarm_lead_fall_steps"]) == (14, 6)  # 0.06 below the best, 0.50


def test_a_hack_that_drops_strict_at_once_is_timed_from_base(table, tmp_path):
    luminance = [0.1] * 5 + [0.1, 0.1, 0.3, 0.3, 0.3]
    strict = {4: 0.24, 9: 0.10}
    row = table.summarize(write_metrics(tmp_path / "m.csv", luminance, strict), base=0.3, drop=0.05)
    assert row["first_alarm_step"] == 7
    assert (row["strict_drop_step"], row["alarm_lead_steps"]) == (4, -3)
    assert (row["strict_fall_step"], row["alarm_lead_fall_steps"]) == (4, -3)  # the best before it is base
    healthy = table.summarize(write_metrics(tmp_path / "h.csv", [0.1] * 10, {4: 0.35, 9: 0.32}), base=0.3, drop=0.05)
    assert healthy["alarms"] == 0 and healthy["strict_fall_step"] == "" and healthy["first_alarm_step"] == ""
