"""``python -m unirl_pl ablate``: modes x seeds in subprocesses, held-out scores as mean ± std."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PIL import Image

from tests.helpers import JOINT, ROOT
from unirl_pl.ablate import Run, build_command, draw_plot, mean_std, read_validation, write_markdown


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _ablate(tmp_path: Path, *args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "unirl_pl", "ablate", "--config", JOINT, "--out", str(tmp_path / "abl"), *args]
    return subprocess.run(command, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------- fast: commands and reading
def test_commands_fit_per_mode_and_validate_with_a_logger_for_base(tmp_path):
    fit = build_command("r.yaml", "prompt_only", 3, tmp_path, quick=True, extra=["--trainer.max_steps=5"])
    assert fit[3:7] == ["fit", "--config", "r.yaml", "--model.mode=prompt_only"]
    assert "--seed_everything=3" in fit and "--data.seed=3" in fit
    assert f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}" in fit
    assert "--trainer.logger.init_args.name=prompt_only_s3" in fit
    assert f"--trainer.callbacks.dirpath={tmp_path / 'ckpt' / 'prompt_only_s3'}" in fit
    assert fit.index("--trainer.max_steps=2") < fit.index("--trainer.max_steps=5"), "extra overrides win"
    base = build_command("r.yaml", "base", 3, tmp_path)
    assert base[3] == "validate" and "--model.mode=joint" in base
    assert "--trainer.logger=lightning.pytorch.loggers.CSVLogger" in base, "validate logs only when asked"
    assert not any(a.startswith("--trainer.callbacks.dirpath") for a in base)
    start = build_command("r.yaml", "base_no_refiner", 3, tmp_path)
    assert start[3] == "validate" and "--model.llm=null" in start, "the DiT alone, on the user's prompts"
    # An extra split scores the fit's last checkpoint, or the starting weights for a base row.
    vocab = Path("v.jsonl")
    fit_v = build_command("r.yaml", "joint", 3, tmp_path, split=("vocabulary", vocab))
    assert fit_v[3] == "validate" and f"--ckpt_path={tmp_path / 'ckpt' / 'joint_s3' / 'last.ckpt'}" in fit_v
    assert f"--data.val_prompts={vocab}" in fit_v and "--trainer.logger.init_args.name=joint_s3_vocabulary" in fit_v
    start_v = build_command("r.yaml", "base_no_refiner", 3, tmp_path, split=("vocabulary", vocab))
    assert "--model.llm=null" in start_v and not any(a.startswith("--ckpt_path") for a in start_v)


def test_read_validation_takes_the_last_validation_and_counts_rl_steps(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_text(
        "epoch,step,reward/mean,val/reward_mean,val/g/strict/overall,val/g/soft/overall,val/g/strict/counting\n"
        "0,0,0.5,,,,\n"
        "0,19,,0.6,0.25,0.6,0.0\n"
        "0,39,,0.7,0.5,0.7,\n"
    )
    final, step, series = read_validation(path, fit=True)
    assert step == 40 and final == {"g/strict/overall": 0.5, "g/soft/overall": 0.7}
    assert series["g/strict/overall"] == [(20, 0.25), (40, 0.5)] and series["g/strict/counting"] == [(20, 0.0)]
    assert read_validation(path, fit=False)[1] == 0, "validate (base) is before any step"


def test_mean_std_and_a_failed_mode_in_the_table(tmp_path):
    mean, std = mean_std([0.25, 0.5, 0.75])
    assert mean == pytest.approx(0.5) and std == pytest.approx(0.25)
    assert math.isnan(mean_std([0.5])[1])
    ok = Run("joint", 0, [], tmp_path, tmp_path / "o", tmp_path / "e", returncode=0, seconds=3.0)
    ok.final, ok.final_step, ok.series = {"g/strict/overall": 0.5}, 2, {"g/strict/overall": [(1, 0.4), (2, 0.5)]}
    bad = Run("base", 0, [], tmp_path, tmp_path / "o", tmp_path / "e", returncode=2)
    write_markdown(tmp_path / "a.md", [bad, ok], ["base", "joint"], {})
    rows = [line for line in (tmp_path / "a.md").read_text().splitlines() if line.startswith("| ")]
    assert len({row.count("|") for row in rows}) == 1, rows
    assert "0.500 ± –" in rows[-1] and "`base_s0`: exit 2" in (tmp_path / "a.md").read_text()
    draw_plot(tmp_path / "a.png", [bad, ok], ["base", "joint"])
    assert Image.open(tmp_path / "a.png").size == (960, 560)


# ---------------------------------------------------------------- end to end
@pytest.mark.integration
def test_quick_ablation_writes_table_csv_and_plot(tmp_path):
    start = time.perf_counter()
    proc = _ablate(tmp_path, "--quick", "--seeds", "0", "1", "--modes", "base", "joint")
    wall = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "abl"
    md, table, png = out / "ablation.md", out / "ablation.csv", out / "ablation.png"
    assert md.is_file() and table.is_file() and png.is_file()

    rows = {line.split("|")[1].strip(): line for line in md.read_text().splitlines() if line.startswith("| ")}
    assert "strict overall" in rows["mode"] and "soft overall" in rows["mode"]
    for mode in ("base", "joint"):
        assert rows[mode].count("±") >= 2, rows[mode]

    records = list(csv.DictReader(table.open()))
    assert {r["split"] for r in records} == {"composition", "vocabulary"}
    # The vocabulary split is scored from each fit's last checkpoint, once per mode x seed.
    vocab = [r for r in records if r["split"] == "vocabulary" and r["metric"] == "shapes_geneval/strict/overall"]
    assert {(r["mode"], r["seed"]) for r in vocab if r["stat"] == "value"} == {
        (m, s) for m in ("base", "joint") for s in ("0", "1")
    }
    assert (out / "runs" / "joint_s1_vocabulary" / "version_0" / "metrics.csv").is_file()
    assert "--ckpt_path=" in (out / "logs" / "joint_s1_vocabulary.out").read_text().splitlines()[0]
    assert "## vocabulary split" in md.read_text()
    records = [r for r in records if r["split"] == "composition"]
    stats = {(r["mode"], r["stat"], r["metric"]) for r in records}
    for mode in ("base", "joint"):
        for stat in ("mean", "std"):
            assert (mode, stat, "shapes_geneval/strict/overall") in stats
            assert (mode, stat, "shapes_geneval/soft/overall") in stats
        seeds = {r["seed"] for r in records if r["mode"] == mode and r["stat"] == "value"}
        assert seeds == {"0", "1"}
    joint = [r for r in records if r["mode"] == "joint" and r["metric"] == "shapes_geneval/strict/overall"]
    values = [float(r["value"]) for r in joint if r["stat"] == "value"]
    mean = next(float(r["value"]) for r in joint if r["stat"] == "mean")
    assert mean == pytest.approx(sum(values) / 2, abs=1e-5)
    assert {r["rl_steps"] for r in joint} == {"2"}

    with Image.open(png) as img:
        img.load()
        assert img.size[0] >= 640 and img.size[1] >= 400
    assert (out / "runs" / "joint_s1" / "version_0" / "metrics.csv").is_file()
    assert (out / "ckpt" / "joint_s1" / "last.ckpt").is_file()
    assert not (tmp_path / "runs").exists(), "every run writes under --out"
    assert wall < 240, f"quick ablation took {wall:.0f} s"


@pytest.mark.integration
def test_failed_run_is_named_with_its_stderr_and_exits_1(tmp_path):
    proc = _ablate(tmp_path, "--quick", "--seeds", "0", "--modes", "joint", "--", "--data.prompts_per_stepp=3")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "error: run joint_s0 failed (exit status 2)" in proc.stderr
    assert "Option 'prompts_per_stepp' is not accepted" in proc.stderr, "the tail of the run's stderr"
    assert (tmp_path / "abl" / "ablation.md").is_file(), "results are written even when a run fails"
