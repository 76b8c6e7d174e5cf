"""``python -m unirl_pl ablate``: modes x arms x seeds in subprocesses, mean ± std and paired t intervals."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from tests.helpers import JOINT, ROOT
from unirl_pl.ablate import (
    Arm,
    Run,
    build_arms,
    build_command,
    draw_plot,
    draw_strict_vs_cpu,
    execute,
    mean_std,
    paired,
    pairs,
    parse_args,
    plan,
    read_train_cpu,
    read_validation,
    t_quantile,
    write_cost_csv,
    write_csv,
    write_markdown,
    write_paired,
)
from unirl_pl.ablate.stats import ABOVE, BELOW, INCLUDES, NO_INTERVAL, t_central_probability

OVERLAYS = ROOT / "recipes" / "algorithms"


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _ablate(tmp_path: Path, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "unirl_pl", "ablate", "--config", JOINT, "--out", str(tmp_path / "abl"), *args]
    return subprocess.run(command, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=timeout)


def _run(mode: str, seed: int, final: dict[str, float], *, split: str = "", arm: str = "", cpu: float = 1.0) -> Run:
    """A finished run with the given last-validation scores (no process)."""
    run = Run(mode, seed, [], Path("runs"), Path("o"), Path("e"), split=split, arm=arm, returncode=0, seconds=2.0)
    run.cpu_seconds, run.final, run.final_step = cpu, dict(final), 2
    run.series = {k: [(1, v), (2, v)] for k, v in final.items()}
    return run


# ---------------------------------------------------------------- fast: commands and reading
def test_commands_fit_per_mode_and_validate_with_a_logger_for_base(tmp_path):
    fit = build_command("r.yaml", "prompt_only", 3, tmp_path, quick=True, extra=["--trainer.max_steps=5"])
    assert fit[3:7] == ["fit", "--config", "r.yaml", "--model.mode=prompt_only"]
    assert "--seed_everything=3" in fit and "--data.seed=3" in fit
    assert f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}" in fit
    assert "--trainer.logger.init_args.name=prompt_only_s3" in fit
    assert f"--trainer.callbacks.dirpath={tmp_path / 'ckpt' / 'prompt_only_s3'}" in fit
    # The clock is appended after dirpath is set (that override names the recipe's last callback).
    clock = fit.index("--trainer.callbacks+=unirl_pl.callbacks.TrainCPUClock")
    assert clock == fit.index(f"--trainer.callbacks.dirpath={tmp_path / 'ckpt' / 'prompt_only_s3'}") + 1
    assert fit.index("--trainer.max_steps=2") < fit.index("--trainer.max_steps=5"), "extra overrides win"
    base = build_command("r.yaml", "base", 3, tmp_path)
    assert base[3] == "validate" and "--model.mode=joint" in base
    assert "--trainer.logger=lightning.pytorch.loggers.CSVLogger" in base, "validate logs only when asked"
    assert not any(a.startswith("--trainer.callbacks") for a in base)
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


def test_training_cpu_per_validation_is_read_tabulated_and_drawn(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_text(
        "epoch,step,reward/mean,time/train_cpu_seconds,val/g/strict/overall\n"
        "0,9,0.5,,\n0,9,,12.5,0.25\n0,19,,30.0,0.5\n"
    )
    assert read_train_cpu(path) == [(10, 12.5), (20, 30.0)]
    runs = []
    for seed, (a, b) in enumerate(((0.25, 0.5), (0.75, 0.5))):
        run = _run("joint", seed, {"g/strict/overall": b}, arm="x")
        run.series = {"g/strict/overall": [(10, a), (20, b)]}
        run.train_cpu = [(10, 10.0 + seed), (20, 30.0 + seed)]
        runs.append(run)
    write_cost_csv(tmp_path / "cost.csv", runs)
    rows = list(csv.DictReader((tmp_path / "cost.csv").open()))
    assert [(r["seed"], r["rl_steps"], r["train_cpu_s"], r["strict_overall"]) for r in rows] == [
        ("0", "10", "10.0", "0.25"),
        ("0", "20", "30.0", "0.5"),
        ("1", "10", "11.0", "0.75"),
        ("1", "20", "31.0", "0.5"),
    ]
    slow = _run("joint", 0, {"g/strict/overall": 0.4}, arm="y")
    slow.series, slow.train_cpu = {"g/strict/overall": [(10, 0.3), (20, 0.4)]}, [(10, 20.0), (20, 40.0)]
    write_markdown(tmp_path / "a.md", [*runs, slow], ["joint-x", "joint-y"], {})
    section = (tmp_path / "a.md").read_text().split("## Held-out strict against training CPU seconds")[1]
    assert "| mode | step 10 | step 20 | reaches joint-x @ 20 |" in section
    # joint-x's mean is already 0.5 after step 10: 10.5 of its 30.5 CPU seconds.
    assert "| joint-x | 0.500 ± 0.354 (10 CPU s) | 0.500 ± 0.000 (30 CPU s) | step 10, 10 CPU s (0.34x) |" in section
    assert "| joint-y | 0.300 ± – (20 CPU s) | 0.400 ± – (40 CPU s) | not reached |" in section
    draw_strict_vs_cpu(tmp_path / "c.png", runs, ["joint-x"])
    with Image.open(tmp_path / "c.png") as img:
        assert (31, 119, 180) in {c for _, c in img.convert("RGB").getcolors(1 << 20)}
    runs[0].train_cpu = []  # without the clock there is no section
    write_markdown(tmp_path / "b.md", runs[:1], ["joint-x"], {})
    assert "training CPU seconds" not in (tmp_path / "b.md").read_text()


def test_mean_std_and_a_failed_mode_in_the_table(tmp_path):
    mean, std = mean_std([0.25, 0.5, 0.75])
    assert mean == pytest.approx(0.5) and std == pytest.approx(0.25)
    assert math.isnan(mean_std([0.5])[1])
    ok = Run("joint", 0, [], tmp_path, tmp_path / "o", tmp_path / "e", returncode=0, seconds=3.0, cpu_seconds=5.0)
    ok.final, ok.final_step, ok.series = {"g/strict/overall": 0.5}, 2, {"g/strict/overall": [(1, 0.4), (2, 0.5)]}
    bad = Run("base", 0, [], tmp_path, tmp_path / "o", tmp_path / "e", returncode=2)
    write_markdown(tmp_path / "a.md", [bad, ok], ["base", "joint"], {})
    text = (tmp_path / "a.md").read_text()
    table = text.split("## composition split")[1].split("##")[0]
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert len({row.count("|") for row in rows}) == 1, rows
    assert rows[0].startswith("| mode | seeds | RL steps | wall s (mean) | CPU s (mean) |")
    assert rows[-1].startswith("| joint | 0 | 2 | 3 | 5 |") and "0.500 ± –" in rows[-1]
    assert "| joint_s0 | 3 | 5 | 0.500 | – |" in text, "each run with its wall and CPU seconds"
    assert "`base_s0`: exit 2" in text
    draw_plot(tmp_path / "a.png", [bad, ok], ["base", "joint"])
    assert Image.open(tmp_path / "a.png").size == (960, 560)


def test_csv_has_cpu_seconds_per_run_and_their_mean_per_group(tmp_path):
    runs = [_run("joint", s, {"g/strict/overall": v}, arm="mix", cpu=c) for s, v, c in ((0, 0.2, 10), (1, 0.4, 30))]
    write_csv(tmp_path / "a.csv", runs, ["joint-mix"])
    rows = list(csv.DictReader((tmp_path / "a.csv").open()))
    assert [(r["mode"], r["arm"], r["seed"], r["cpu_s"]) for r in rows if r["stat"] == "value"] == [
        ("joint", "mix", "0", "10.0"),
        ("joint", "mix", "1", "30.0"),
    ]
    mean = next(r for r in rows if r["stat"] == "mean")
    assert float(mean["value"]) == pytest.approx(0.3) and float(mean["cpu_s"]) == pytest.approx(20)
    std = next(r for r in rows if r["stat"] == "std")
    assert float(std["value"]) == pytest.approx(math.sqrt(0.02), abs=1e-5)
    assert float(std["cpu_s"]) == pytest.approx(math.sqrt(200), abs=1e-4)


# ---------------------------------------------------------------- statistics
@pytest.mark.parametrize(
    ("p", "dof", "expected"),
    [
        (0.975, 1, 12.706),
        (0.975, 2, 4.303),
        (0.975, 3, 3.182),
        (0.975, 4, 2.776),
        (0.975, 9, 2.262),
        (0.975, 30, 2.042),
        (0.995, 5, 4.032),
        (0.95, 7, 1.895),
        (0.975, 10000, 1.960),
    ],
)
def test_t_quantile_matches_the_printed_tables(p, dof, expected):
    assert t_quantile(p, dof) == pytest.approx(expected, abs=5e-4)


def test_t_distribution_closed_forms_and_bad_arguments():
    # dof 1 is Cauchy, dof 2 has P(|T| <= t) = t / sqrt(2 + t^2): both checked at a few points.
    for t in (0.3, 1.0, 4.0):
        assert t_central_probability(t, 1) == pytest.approx(2 / math.pi * math.atan(t), abs=1e-12)
        assert t_central_probability(t, 2) == pytest.approx(t / math.sqrt(2 + t * t), abs=1e-12)
    assert t_central_probability(2.776445, 4) == pytest.approx(0.95, abs=1e-6)
    assert t_central_probability(2.570582, 5) == pytest.approx(0.95, abs=1e-6)
    for bad in ((0.5, 3), (1.0, 3)):
        with pytest.raises(ValueError):
            t_quantile(*bad)
    with pytest.raises(ValueError):
        t_central_probability(1.0, 0)


def test_paired_differences_by_hand():
    # Seeds 0-2 in both (seed 3 only in b, so it is left out): differences 0.1, 0.2, 0.1.
    p = paired({0: 0.5, 1: 0.6, 2: 0.7}, {0: 0.4, 1: 0.4, 2: 0.6, 3: 0.9})
    assert p.seeds == (0, 1, 2) and p.n == 3
    assert p.diffs == pytest.approx((0.1, 0.2, 0.1))
    assert (p.mean_a, p.mean_b, p.mean) == pytest.approx((0.6, 0.466667, 0.133333), abs=1e-6)
    assert p.sd == pytest.approx(math.sqrt(1 / 300))  # deviations -1/30, 2/30, -1/30 over n - 1 = 2
    assert p.t == pytest.approx(4.302653, abs=1e-6)
    half = 4.302653 * math.sqrt(1 / 300) / math.sqrt(3)
    assert (p.ci_low, p.ci_high) == pytest.approx((0.133333 - half, 0.133333 + half), abs=1e-6)
    assert (p.wins_a, p.wins_b, p.ties) == (3, 0, 0) and p.reading == INCLUDES
    # Differences 0.1, 0.12, 0.08: mean 0.1, sd 0.02, half width 4.3027 * 0.02 / sqrt(3) = 0.0497.
    up = paired({0: 0.6, 1: 0.62, 2: 0.58}, {0: 0.5, 1: 0.5, 2: 0.5})
    assert (up.ci_low, up.ci_high) == pytest.approx((0.1 - 0.049683, 0.1 + 0.049683), abs=1e-6)
    assert up.reading == ABOVE
    down = paired({0: 0.5, 1: 0.5, 2: 0.5}, {0: 0.6, 1: 0.62, 2: 0.58})
    assert down.reading == BELOW and (down.wins_a, down.wins_b) == (0, 3)
    tie = paired({0: 0.5, 1: 0.7}, {0: 0.5, 1: 0.6})
    assert (tie.wins_a, tie.wins_b, tie.ties) == (1, 0, 1)
    one = paired({0: 0.5}, {0: 0.4})
    assert one.reading == NO_INTERVAL and math.isnan(one.ci_low) and one.mean == pytest.approx(0.1)


def test_pairs_compare_modes_within_an_arm_then_arms_within_a_mode():
    assert pairs(["base", "generator_only", "joint", "prompt_only"], [""]) == [
        ("joint", "prompt_only"),
        ("joint", "generator_only"),
        ("prompt_only", "generator_only"),
    ]
    assert pairs(["base", "joint"], [""]) == [], "base has no training seed to pair on"
    assert pairs(["generator_only", "joint"], ["a", "b", "c"]) == [
        ("joint-a", "generator_only-a"),
        ("joint-b", "generator_only-b"),
        ("joint-c", "generator_only-c"),
        ("joint-a", "joint-b"),
        ("joint-a", "joint-c"),
        ("joint-b", "joint-c"),
        ("generator_only-a", "generator_only-b"),
        ("generator_only-a", "generator_only-c"),
        ("generator_only-b", "generator_only-c"),
    ]


def test_paired_report_per_split_and_category(tmp_path):
    strict, soft, count = "g/strict/overall", "g/soft/overall", "g/strict/counting"
    joint = {0: (0.5, 0.7, 0.1), 1: (0.6, 0.8, 0.2), 2: (0.7, 0.9, 0.1)}
    prompt = {0: (0.4, 0.7, 0.3), 1: (0.4, 0.8, 0.3), 2: (0.6, 0.9, 0.3)}
    runs = [_run("base", s, {strict: 0.3}) for s in (0, 1, 2)]
    for mode, values in (("joint", joint), ("prompt_only", prompt)):
        runs += [_run(mode, s, {strict: a, soft: b, count: c}) for s, (a, b, c) in values.items()]
        runs += [_run(mode, s, {strict: a / 2}, split="vocabulary") for s, (a, _, _) in values.items()]
    runs.append(_run("joint", 3, {strict: 0.9}))  # no prompt_only partner: not paired
    write_paired(tmp_path, runs, ["base", "joint", "prompt_only"], [""], "composition")
    rows = list(csv.DictReader((tmp_path / "paired.csv").open()))
    mean = {(r["split"], r["metric"]): r for r in rows if r["stat"] == "mean"}
    assert set(mean) == {("composition", m) for m in (strict, soft, count)} | {("vocabulary", strict)}
    top = mean[("composition", strict)]
    assert (top["a"], top["b"], top["n"]) == ("joint", "prompt_only", "3")
    assert float(top["diff"]) == pytest.approx(0.4 / 3, abs=1e-5) and top["reading"] == INCLUDES
    assert (top["wins_a"], top["wins_b"], top["ties"]) == ("3", "0", "0")
    assert mean[("composition", soft)]["ties"] == "3" and mean[("composition", count)]["reading"] == BELOW
    assert float(mean[("vocabulary", strict)]["diff"]) == pytest.approx(0.2 / 3, abs=1e-5)
    seeds = [r for r in rows if r["stat"] == "seed" and r["metric"] == strict and r["split"] == "composition"]
    assert [(r["seed"], float(r["diff"])) for r in seeds] == [
        ("0", pytest.approx(0.1)),
        ("1", pytest.approx(0.2)),
        ("2", pytest.approx(0.1)),
    ]
    text = (tmp_path / "paired.md").read_text()
    assert "95% confidence interval" in text and "Student's t with n − 1 degrees of freedom" in text
    assert "### joint − prompt_only (n = 3: seeds 0 1 2, t_{0.975, 2} = 4.303)" in text
    assert (
        "| composition | joint − prompt_only | strict overall | 3 | 0.600 | 0.467 | +0.133 | [-0.010, +0.277] "
        "| 3/0/0 | includes 0 |" in text
    )
    assert "| strict counting | 3 | 0.133 | 0.300 | -0.167 |" in text and "## vocabulary split" in text
    write_paired(tmp_path, runs[:3], ["base"], [""], "composition")
    assert "nothing to pair" in (tmp_path / "paired.md").read_text()


# ---------------------------------------------------------------- --vary
def test_vary_algorithm_names_are_overlays_and_other_keys_overrides(tmp_path):
    args, extra = parse_args(
        [
            "--config", JOINT, "--seeds", "0", "1", "--modes", "generator_only", "joint", "--quick",
            "--out", str(tmp_path), "--extra-val",
            "--vary", "model.generator_algorithm=flow_grpo,mix_grpo",
            "--vary", "trainer.max_steps=3,5",
            "--", "--trainer.max_steps=7",
        ]
    )  # fmt: skip
    assert [a.label for a in args.arms] == [
        "flow_grpo-max_steps_3",
        "flow_grpo-max_steps_5",
        "mix_grpo-max_steps_3",
        "mix_grpo-max_steps_5",
    ]
    the_plan = plan(args, extra, tmp_path, checkpoint=True)
    assert len(the_plan.runs) == 2 * 4 * 2 and the_plan.groups[:2] == [
        "generator_only-flow_grpo-max_steps_3",
        "generator_only-flow_grpo-max_steps_5",
    ]
    run = next(r for r in the_plan.runs if r.name == "joint-mix_grpo-max_steps_5_s1")
    command = run.command
    overlay = str(OVERLAYS / "mix_grpo.yaml")
    assert command[4:8] == ["--config", JOINT, "--config", overlay], "the overlay right after the recipe"
    assert "--trainer.logger.init_args.name=joint-mix_grpo-max_steps_5_s1" in command
    assert f"--trainer.callbacks.dirpath={tmp_path / 'ckpt' / 'joint-mix_grpo-max_steps_5_s1'}" in command
    quick, varied, after = (command.index(f"--trainer.max_steps={n}") for n in (2, 5, 7))
    assert quick < varied < after, "the arm's value beats --quick; the arguments after -- beat both"
    assert run.log_err == tmp_path / "logs" / "joint-mix_grpo-max_steps_5_s1.err"
    # The extra split validates the arm's own checkpoint with the arm's overlay.
    split = build_command(JOINT, "joint", 1, tmp_path, split=("vocabulary", Path("v.jsonl")), arm=run_arm(args, run))
    assert (
        overlay in split and f"--ckpt_path={tmp_path / 'ckpt' / 'joint-mix_grpo-max_steps_5_s1' / 'last.ckpt'}" in split
    )
    assert "--trainer.logger.init_args.name=joint-mix_grpo-max_steps_5_s1_vocabulary" in split


def run_arm(args, run: Run) -> Arm:
    return next(a for a in args.arms if a.label == run.arm)


def test_vary_values_and_refusals(tmp_path, capsys):
    assert build_arms([], JOINT) == [Arm()], "no --vary: the recipe as is, unlabelled"
    [dotted] = build_arms([("model.llm_algorithm", ("unirl_pl.algorithms.GSPO",))], JOINT)
    assert dotted.overrides == ("--model.llm_algorithm=unirl_pl.algorithms.GSPO",) and not dotted.configs
    [path] = build_arms([("model.generator_algorithm", (str(OVERLAYS / "cps.yaml"),))], JOINT)
    assert path.label == "cps" and path.configs == (str(OVERLAYS / "cps.yaml"),)
    [lr] = build_arms([("model.llm_optimizer.init_args.lr", ("1e-4",))], JOINT)
    assert lr.label == "lr_1e-4" and lr.overrides == ("--model.llm_optimizer.init_args.lr=1e-4",)
    for bad, message in (
        ("model.generator_algorithm=nosuch", "no overlay nosuch.yaml (known: "),
        ("model.mode=joint", "use --modes"),
        ("data.seed=1,2", "use --seeds"),
        ("trainer.max_steps", "expected KEY=V1,V2"),
        ("trainer.max_steps=3,", "non-empty values"),
    ):
        with pytest.raises(SystemExit) as exit_:
            parse_args(["--config", JOINT, "--vary", bad])
        assert exit_.value.code == 2 and message in capsys.readouterr().err, bad
    with pytest.raises(SystemExit):
        parse_args(["--config", JOINT, "--vary", "trainer.max_steps=3", "--vary", "trainer.max_steps=4"])
    assert "given twice" in capsys.readouterr().err


def test_strict_vs_cpu_plot_draws_each_run_and_the_blank_case(tmp_path):
    runs = [
        _run("joint", s, {"g/strict/overall": 0.3 + 0.1 * s}, arm=a, cpu=10 + s) for s in (0, 1) for a in ("x", "y")
    ]
    draw_strict_vs_cpu(tmp_path / "p.png", runs, ["joint-x", "joint-y"])
    with Image.open(tmp_path / "p.png") as img:
        colors = {c for _, c in img.convert("RGB").getcolors(1 << 20)}
    assert (31, 119, 180) in colors and (255, 127, 14) in colors, "one color per arm"
    long = [_run("generator_only", 0, {"g/strict/overall": 0.5}, arm="diffusion_nft-max_steps_80")]
    draw_strict_vs_cpu(tmp_path / "long.png", long, ["generator_only-diffusion_nft-max_steps_80"])
    assert Image.open(tmp_path / "long.png").size[0] > 960, "widened so that the legend's label fits"
    draw_strict_vs_cpu(tmp_path / "blank.png", [], ["joint-x"])
    with Image.open(tmp_path / "blank.png") as img:
        assert img.size == (960, 560) and (31, 119, 180) not in {c for _, c in img.convert("RGB").getcolors(1 << 20)}


@pytest.mark.integration
def test_execute_records_the_child_cpu_seconds(tmp_path):
    # The child burns CPU and prints how much; the parent's account of it must be at least that.
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\nprint(time.process_time())"
    run = Run("base", 0, [sys.executable, "-c", burn], tmp_path, tmp_path / "o.txt", tmp_path / "e.txt")
    execute(run, _env())
    reported = float((tmp_path / "o.txt").read_text().split()[-1])
    assert run.returncode == 0 and run.cpu_seconds >= reported >= 0.3
    assert run.cpu_seconds < reported + 5, "only this child's time"


def test_jobs_must_be_positive(tmp_path, capsys):
    from unirl_pl.ablate import main as ablate_main

    assert ablate_main(["--config", str(ROOT / "recipes" / "joint.yaml"), "--jobs", "0", "--out", str(tmp_path)]) == 2
    assert "--jobs must be >= 1" in capsys.readouterr().err


# ---------------------------------------------------------------- end to end
@pytest.mark.integration
def test_quick_ablation_writes_table_csv_plot_and_paired_report(tmp_path):
    modes = ("joint", "prompt_only")
    # Two runs side by side (--jobs 2): each run's CPU seconds are its own child's (wait4), not the pair's.
    proc = _ablate(tmp_path, "--quick", "--seeds", "0", "1", "--modes", *modes, "--jobs", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "abl"
    md, table, png = out / "ablation.md", out / "ablation.csv", out / "ablation.png"
    assert md.is_file() and table.is_file() and png.is_file()
    assert not (out / "strict_vs_cpu.png").exists(), "drawn only with --vary"
    cost = list(csv.DictReader((out / "cost.csv").open()))
    for mode in modes:
        for seed in "01":
            clock = [float(r["train_cpu_s"]) for r in cost if (r["mode"], r["seed"]) == (mode, seed)]
            assert len(clock) == 2 and 0 < clock[0] < clock[1], (mode, seed, clock)

    table_text = md.read_text().split("## composition split")[1].split("\n## ")[0]
    rows = {line.split("|")[1].strip(): line for line in table_text.splitlines() if line.startswith("| ")}
    assert "strict overall" in rows["mode"] and "soft overall" in rows["mode"] and "CPU s" in rows["mode"]
    for mode in modes:
        assert rows[mode].count("±") >= 2, rows[mode]

    records = list(csv.DictReader(table.open()))
    assert {r["split"] for r in records} == {"composition", "vocabulary"}
    # The vocabulary split is scored from each fit's last checkpoint, once per mode x seed.
    vocab = [r for r in records if r["split"] == "vocabulary" and r["metric"] == "shapes_geneval/strict/overall"]
    assert {(r["mode"], r["seed"]) for r in vocab if r["stat"] == "value"} == {(m, s) for m in modes for s in "01"}
    assert (out / "runs" / "joint_s1_vocabulary" / "version_0" / "metrics.csv").is_file()
    assert "--ckpt_path=" in (out / "logs" / "joint_s1_vocabulary.out").read_text().splitlines()[0]
    assert "## vocabulary split" in md.read_text()
    assert all(float(r["cpu_s"]) > 0 for r in records if r["stat"] == "value"), "CPU seconds of every run"
    records = [r for r in records if r["split"] == "composition"]
    stats = {(r["mode"], r["stat"], r["metric"]) for r in records}
    for mode in modes:
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

    # The paired report: joint - prompt_only on both splits, seed by seed, with its t interval (n = 2).
    text = (out / "paired.md").read_text()
    assert text.count("### joint − prompt_only (n = 2: seeds 0 1, t_{0.975, 1} = 12.706)") == 2, text
    paired_rows = [r for r in csv.DictReader((out / "paired.csv").open()) if r["stat"] == "mean"]
    top = {(r["split"], r["a"], r["b"]) for r in paired_rows if r["metric"] == "shapes_geneval/strict/overall"}
    assert top == {(split, "joint", "prompt_only") for split in ("composition", "vocabulary")}
    for row in paired_rows:
        assert float(row["diff"]) == pytest.approx(float(row["value_a"]) - float(row["value_b"]), abs=2e-5)

    with Image.open(png) as img:
        img.load()
        assert img.size[0] >= 640 and img.size[1] >= 400
    assert (out / "runs" / "joint_s1" / "version_0" / "metrics.csv").is_file()
    assert (out / "ckpt" / "joint_s1" / "last.ckpt").is_file()
    assert not (tmp_path / "runs").exists(), "every run writes under --out"


@pytest.mark.integration
def test_failed_run_is_named_with_its_stderr_and_exits_1(tmp_path):
    vary = ("--vary", "model.generator_algorithm=mix_grpo")
    proc = _ablate(tmp_path, "--quick", "--seeds", "0", "--modes", "joint", *vary, "--", "--data.prompts_per_stepp=3")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "error: run joint-mix_grpo_s0 failed (exit status 2)" in proc.stderr
    assert "recipes/algorithms/mix_grpo.yaml" in proc.stderr, "the arm's overlay is in the command"
    # Only the typo is refused (the overlay recipe was accepted): the tail of the run's stderr.
    assert "Option 'prompts_per_stepp' is not accepted" in proc.stderr
    for name in ("ablation.md", "paired.md", "strict_vs_cpu.png"):
        assert (tmp_path / "abl" / name).is_file(), "results are written even when every run fails"


def test_report_only_rebuilds_the_reports_from_the_runs_on_disk(tmp_path, capsys):
    from unirl_pl.ablate import main as ablate_main

    out = tmp_path / "abl"
    header = "epoch,step,time/train_cpu_seconds,val/g/strict/overall,val/g/soft/overall\n"
    for seed, (mid, last) in enumerate(((0.25, 0.5), (0.5, 0.75))):
        folder = out / "runs" / f"joint_s{seed}" / "version_0"
        folder.mkdir(parents=True)
        (folder / "metrics.csv").write_text(header + f"0,9,10.0,{mid},0.6\n0,19,20.0,{last},0.8\n")
    # A run that had not reached a validation when the ablation stopped is not a finished run.
    (out / "runs" / "prompt_only_s0" / "version_0").mkdir(parents=True)
    (out / "runs" / "prompt_only_s0" / "version_0" / "metrics.csv").write_text(header + "0,4,,,\n")
    (out / "ablation.csv").write_text(
        ",".join(("split", "mode", "arm", "seed", "stat", "metric", "value", "rl_steps", "n_seeds", "wall_s", "cpu_s"))
        + ",run_dir\ncomposition,joint,,0,value,g/strict/overall,0.5,20,1,12.0,34.0,x\n"
    )
    args = ["--config", JOINT, "--out", str(out), "--seeds", "0", "1", "--modes", "joint", "prompt_only"]
    assert ablate_main([*args, "--extra-val", "--report-only"]) == 0
    text = (out / "ablation.md").read_text()
    assert "| joint | 0 1 | 20 |" in text and "0.625 ± 0.177" in text, text
    assert "| joint_s0 | 12 | 34 | 0.500 |" in text, "seconds come back from the earlier ablation.csv"
    assert "| prompt_only | – |" in text and "Failed runs" not in text
    assert [r["train_cpu_s"] for r in csv.DictReader((out / "cost.csv").open())] == ["10.0", "20.0", "10.0", "20.0"]
    assert ablate_main([*args, "--extra-val", "--report-only", "--seeds", "7"]) == 1, "nothing on disk"


def test_vary_overlay_takes_recipe_overlays_and_none(tmp_path):
    overlay = str(ROOT / "recipes" / "overlays" / "two_updates_ema.yaml")
    arms = build_arms([("overlay", ("none", overlay))], JOINT)
    assert [(a.label, a.configs, a.overrides) for a in arms] == [
        ("none", (), ()),
        ("two_updates_ema", (overlay,), ()),
    ], "none is the recipe as is; a path is an extra --config"
    with pytest.raises(ValueError, match="overlay"):
        build_arms([("overlay", ("none", str(tmp_path / "missing.yaml")))], JOINT)
    with pytest.raises(ValueError, match="overlay"):
        build_arms([("overlay", ("trainer.max_steps=3",))], JOINT)
