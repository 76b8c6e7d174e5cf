"""One command that checks the family recipes on a GPU: ``python scripts/gpu_check.py [--weights DIR]``.

For each family recipe (``recipes/sd35.yaml``, ``flux.yaml``, ``wan_t2v.yaml`` and ``wan22_t2v.yaml``) it
runs ``python -m unirl_pl fit`` in a subprocess for ``--steps`` RL steps, with the C2 gate, interleave
parity (once, at fit start) and the version ledger on, and both experts' losses set to the bf16 rollout
correction (``rollout_correction: tis``) so the run measures the rollout/train mismatch instead of stopping
on it. It then reads the run's ``metrics.csv`` and writes one JSON (``--out``) with, per family: C2's
largest and mean ``|logp_recompute - logp_behavior|`` and the mismatch KL per expert, parity's largest
difference, the time of every step, images per second (after the first step), the peak GPU memory
(``torch.cuda.max_memory_allocated``) and, with real weights, ``python -m unirl_pl plan``'s prediction when
that subcommand exists. Exit status 0 when every family ran.

With ``--weights DIR`` a family runs at real size from these folders (a family whose folder is missing
falls back to its test pipeline):

    DIR/stable-diffusion-3.5-medium     sd35        (diffusers folder)
    DIR/FLUX.1-dev                      flux        (diffusers folder)
    DIR/Wan2.1-T2V-1.3B-Diffusers       wan_t2v     (diffusers folder)
    DIR/Wan2.2-T2V-A14B-Diffusers       wan22_t2v   (diffusers folder; one GPU, no FSDP)
    DIR/Qwen2.5-1.5B-Instruct           the refiner of every family

Real size means the recipe's models (sd35's PickScore reward included: the run is offline, so
yuvalkirstain/PickScore_v1 and laion/CLIP-ViT-H-14-laion2B-s32B-b79K must be in the HF cache), resolution and
sampling steps; to fit every family in about five minutes the batch is ``--prompts`` x ``--samples`` (1 x 2 by
default) and videos have ``--frames`` frames (17 by default; 0 keeps the recipe's 81), not a recipe's full step.
Without ``--weights`` every family runs on the tiny test pipelines of ``tests/pipelines.py`` (built into a
temporary folder) in bfloat16, with the recipe's documented CPU sizes and reward (JPEG) and a batch of 2 x 4.
``--device cpu --steps 1`` runs the same on CPU, the smoke test of this script (``tests/test_rollout_correction.py``).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent

WEIGHT_FOLDERS = {
    "sd35": "stable-diffusion-3.5-medium",
    "flux": "FLUX.1-dev",
    "wan_t2v": "Wan2.1-T2V-1.3B-Diffusers",
    "wan22_t2v": "Wan2.2-T2V-A14B-Diffusers",
}
REFINER_FOLDER = "Qwen2.5-1.5B-Instruct"
# The test pipeline builder of each family (tests/pipelines.py) and the sizes its recipe's CPU block uses.
BUILDERS = {"sd35": "make_sd3_pipeline", "flux": "make_flux_pipeline", "wan_t2v": "make_wan_pipeline"}
BUILDERS["wan22_t2v"] = "make_wan22_pipeline"
IMAGE = ["--model.generator.init_args.height=32", "--model.generator.init_args.width=32"]
VIDEO = [
    "--model.generator.init_args.height=16",
    "--model.generator.init_args.width=16",
    "--model.generator.init_args.num_frames=5",
]
TINY_SIZES = {"sd35": IMAGE, "flux": IMAGE, "wan_t2v": VIDEO, "wan22_t2v": VIDEO}
# As the recipes' CPU blocks: the JPEG reward (sd35's stand-in for its 4 GB PickScore; the others' own).
TINY_REWARDS = ["--model.rewards={jpeg_incompressibility: 1.0}", "--model.reward_args=null"]
# Wan2.2's tiny schedule (shift 12, 4 steps) puts the expert boundary after step 2: train one step of each.
TINY_WINDOWS = {"wan22_t2v": "[2,4]"}
EXPERTS = ("llm", "transformer")
VIDEO_FAMILIES = ("wan_t2v", "wan22_t2v")


class StepProbe(pl.Callback):
    """Logs ``perf/step_time_s`` (wall time of the whole RL step, rollout included), ``perf/images`` (this
    step's images on all ranks) and ``perf/peak_memory_gib`` (CUDA: ``max_memory_allocated`` since fit start;
    CPU: the process's peak resident set) after every training step. ``gpu_check`` adds it to each run.
    """

    def __init__(self) -> None:
        self._last = 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)
        self._last = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
            peak = torch.cuda.max_memory_allocated(pl_module.device) / 2**30
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
        now = time.perf_counter()
        elapsed, self._last = now - self._last, now
        images = len(getattr(batch, "prompts", ())) * trainer.world_size
        metrics = {"perf/step_time_s": elapsed, "perf/images": float(images), "perf/peak_memory_gib": peak}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step - 1)


def families_available() -> list[str]:
    """The family recipes this checkout has (Wan2.2 only once its recipe and test pipeline exist)."""
    sys.path.insert(0, str(ROOT))
    import tests.pipelines as pipelines

    return [f for f in BUILDERS if (ROOT / "recipes" / f"{f}.yaml").is_file() and hasattr(pipelines, BUILDERS[f])]


def overlay(run_dir: Path, family: str) -> Path:
    """A config layered after the recipe: this check's callbacks and a logger writing into ``run_dir``."""
    text = f"""trainer:
  default_root_dir: {run_dir}
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  limit_val_batches: 0
  logger:
    class_path: lightning.pytorch.loggers.CSVLogger
    init_args: {{save_dir: {run_dir}, name: {family}}}
  callbacks:
    - class_path: unirl_pl.callbacks.LogProbIdentityCheck
    - class_path: unirl_pl.callbacks.InterleaveParityCheck
      init_args: {{every_n_steps: 1000000, num_requests: 2, tolerance: 5.0e-2, action: warn}}
    - class_path: unirl_pl.callbacks.WeightVersionLedger
    - class_path: gpu_check.StepProbe
"""
    path = run_dir / f"{family}_overlay.yaml"
    path.write_text(text)
    return path


def fit_command(
    family: str, args: argparse.Namespace, run_dir: Path, pipeline: Path, refiner: str, real: bool
) -> list[str]:
    """The ``python -m unirl_pl fit`` command of one family's check."""
    recipe = ROOT / "recipes" / f"{family}.yaml"
    cmd = [sys.executable, "-m", "unirl_pl", "fit", "--config", str(recipe), "--config", str(overlay(run_dir, family))]
    accelerator = "gpu" if args.device == "cuda" else "cpu"
    cmd += [
        f"--model.pipeline_path={pipeline}",
        f"--model.llm.init_args.pretrained_path={refiner}",
        f"--trainer.accelerator={accelerator}",
        "--trainer.devices=1",
        f"--trainer.max_steps={args.steps}",
        f"--data.prompts_per_step={args.prompts or (1 if real else 2)}",
        f"--data.samples_per_prompt={args.samples or (2 if real else 4)}",
        f"--model.llm_loss.rollout_correction={args.correction}",
        f"--model.transformer_loss.rollout_correction={args.correction}",
    ]
    if family == "wan22_t2v":
        cmd.append("--trainer.strategy=auto")  # the recipe shards over 8 GPUs; one GPU here
    if real and family in VIDEO_FAMILIES and args.frames:
        cmd.append(f"--model.generator.init_args.num_frames={args.frames}")
    if not real:
        cmd += [
            f"--model.generator.init_args.dtype={args.dtype}",
            f"--model.llm.init_args.dtype={args.dtype}",
            "--model.generator.init_args.max_sequence_length=16",
            "--model.rollout.num_steps=4",
            f"--model.generator_algorithm.init_args.sde_window={TINY_WINDOWS.get(family, '[0,2]')}",
            "--model.rollout.max_new_tokens=12",
            *TINY_SIZES[family],
            *TINY_REWARDS,
        ]
    return cmd


def read_metrics(run_dir: Path, family: str) -> list[dict[str, float]]:
    """The rows of the newest ``metrics.csv`` of ``family``'s run, empty cells dropped."""
    found = sorted((run_dir / family).glob("version_*/metrics.csv"), key=lambda p: p.stat().st_mtime)
    if not found:
        return []
    with found[-1].open() as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def series(rows: list[dict[str, float]], key: str) -> list[float]:
    return [r[key] for r in rows if key in r and math.isfinite(r[key])]


def _max(values: list[float]) -> float | None:
    return max(values) if values else None


def summarize(rows: list[dict[str, float]]) -> dict[str, Any]:
    """Per family: C2 and rollout-correction statistics per expert, parity, step times, throughput, memory."""
    c2 = {}
    for name in EXPERTS:
        stats = {
            "max_abs_diff": _max(series(rows, f"c2/{name}_max_abs_diff")),
            "mean_abs_diff": _max(series(rows, f"c2/{name}_mean_abs_diff")),
            "frac_bitwise_equal": min(series(rows, f"c2/{name}_frac_bitwise_equal"), default=None),
            "mismatch_kl": _max(series(rows, f"rollout_corr/{name}_kl")),
            "tis_clipped_frac": _max(series(rows, f"rollout_corr/{name}_clipped_frac")),
        }
        if any(v is not None for v in stats.values()):
            c2[name] = stats
    times, images = series(rows, "perf/step_time_s"), series(rows, "perf/images")
    # The first step also compiles kernels and fills caches; throughput is over the later ones when there are any.
    steady = times[1:] or times
    steady_images = images[1:] or images
    return {
        "c2": c2,
        "parity_max_abs_diff": _max(series(rows, "parity/max_abs_diff")),
        "step_time_s": times,
        "images_per_s": sum(steady_images) / sum(steady) if steady and steady_images else None,
        "peak_memory_gib": _max(series(rows, "perf/peak_memory_gib")),
        "reward_mean": series(rows, "reward/mean"),
    }


def predicted_peak_gib(plan: Any) -> float | None:
    """The largest peak ``plan --json`` reports: any number under a key naming a peak, in GiB (keys ending
    in ``bytes`` are converted); None when it reports none."""
    found: list[float] = []

    def walk(node: Any, key: str = "") -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, str(k))
        elif isinstance(node, list):
            for v in node:
                walk(v, key)
        elif isinstance(node, int | float) and not isinstance(node, bool) and "peak" in key.lower():
            found.append(node / 2**30 if key.lower().endswith("bytes") else float(node))

    walk(plan)
    return max(found) if found else None


def run_plan(family: str, env: dict[str, str], timeout: float) -> dict[str, Any]:
    """``python -m unirl_pl plan --config RECIPE --devices 1 --json`` if the subcommand exists."""
    cmd = [sys.executable, "-m", "unirl_pl", "plan", "--config", str(ROOT / "recipes" / f"{family}.yaml")]
    try:
        proc = subprocess.run(
            [*cmd, "--devices", "1", "--json"], env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {"available": False, "error": f"plan took more than {timeout:.0f} s"}
    if proc.returncode != 0:
        return {"available": False, "error": (proc.stderr or proc.stdout).strip()[-500:]}
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        return {"available": False, "error": "plan --json did not print JSON"}
    return {"available": True, "predicted_peak_gib": predicted_peak_gib(report), "report": report}


def check_family(family: str, args: argparse.Namespace, work: Path, refiner_tiny: str, env: dict[str, str]) -> dict:
    """Run one family's fit and summarize it."""
    folder = args.weights / WEIGHT_FOLDERS[family] if args.weights else None
    real = folder is not None and folder.is_dir()
    if real:
        pipeline, source = folder, f"weights: {folder}"
    else:
        sys.path.insert(0, str(ROOT))
        import tests.pipelines as pipelines

        # Wan2.2's folder gets the real pipeline's UniPC scheduler, so the recipe's shift 12 splits the window
        # between the two experts as it does at real size.
        options = {"unipc": True} if family == "wan22_t2v" else {}
        pipeline = getattr(pipelines, BUILDERS[family])(work / f"pipeline_{family}", **options)
        source = f"test pipeline ({BUILDERS[family]}, {args.dtype})"
    refiner_dir = args.weights / REFINER_FOLDER if args.weights else None
    refiner = str(refiner_dir) if real and refiner_dir is not None and refiner_dir.is_dir() else refiner_tiny
    run_dir = work / "runs"
    run_dir.mkdir(exist_ok=True)
    cmd = fit_command(family, args, run_dir, pipeline, refiner, real)
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=args.timeout)
        rc, tail = proc.returncode, (proc.stderr or "")[-2000:]
    except subprocess.TimeoutExpired as err:
        rc, tail = 124, f"timed out after {args.timeout} s: {str(err.stderr or '')[-1500:]}"
    result: dict[str, Any] = {
        "source": source,
        "rc": rc,
        "seconds": round(time.perf_counter() - start, 1),
        **summarize(read_metrics(run_dir, family)),
    }
    if rc != 0:
        result["error"] = tail
    if real:
        result["plan"] = run_plan(family, env, timeout=min(args.timeout, 300))
        predicted, measured = result["plan"].get("predicted_peak_gib"), result["peak_memory_gib"]
        if predicted and measured:
            result["peak_vs_plan"] = measured / predicted
    else:
        result["plan"] = {"available": False, "error": "skipped: plan predicts the recipe's real-size models"}
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", type=Path, default=None, help="folder holding the checkpoint folders above")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: the smoke test")
    parser.add_argument("--steps", type=int, default=3, help="RL steps per family")
    parser.add_argument("--families", nargs="+", default=None, help="default: every family recipe present")
    parser.add_argument("--prompts", type=int, default=None, help="prompts per step (1 real size, 2 test)")
    parser.add_argument("--samples", type=int, default=None, help="samples per prompt (2 real size, 4 test)")
    parser.add_argument("--frames", type=int, default=17, help="video frames at real size (0: the recipe's)")
    parser.add_argument("--dtype", default="bfloat16", help="base weights of the test pipelines")
    parser.add_argument("--correction", choices=["tis", "off"], default="tis", help="both experts' rollout_correction")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per family run")
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"), help="the JSON report")
    parser.add_argument("--keep", type=Path, default=None, help="keep the runs and pipelines in this folder")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: pass --device cpu for the CPU smoke test")
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    families = args.families or families_available()
    unknown = sorted(set(families) - set(BUILDERS))
    if unknown:
        raise SystemExit(f"unknown families {unknown}; known: {sorted(BUILDERS)}")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(SCRIPTS), env.get("PYTHONPATH", "")])
    sys.path.insert(0, str(ROOT))
    from tests.chat_lm import make_qwen2_chat_lm

    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "weights": str(args.weights) if args.weights else None,
        "steps": args.steps,
        "batch": {"prompts_per_step": args.prompts, "samples_per_prompt": args.samples, "frames": args.frames},
        "rollout_correction": args.correction,
        "families": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        refiner_tiny = make_qwen2_chat_lm(work / "tiny-qwen")
        for family in families:
            result = check_family(family, args, work, refiner_tiny, env)
            report["families"][family] = result
            c2 = ", ".join(
                f"{n} {s['max_abs_diff']:.2e}" for n, s in result["c2"].items() if s["max_abs_diff"] is not None
            )
            print(f"{family}: rc {result['rc']}, {result['seconds']} s, C2 max |dlogp| {c2 or '-'}", flush=True)
    report["ok"] = all(r["rc"] == 0 for r in report["families"].values())
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
