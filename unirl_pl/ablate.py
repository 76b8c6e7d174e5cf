"""``python -m unirl_pl ablate``: every training mode over several seeds, held-out scores as mean ± std.

Each (mode, seed) is one run in a fresh subprocess of this CLI, so runs share no state (RNG, caches,
threads) and a crash ends only that run:

- ``joint``, ``prompt_only``, ``generator_only``: ``fit`` with ``--model.mode=<mode>``;
- ``base`` and ``base_no_refiner`` (no RL): ``validate`` of the recipe's starting weights, with the
  refiner in front of the DiT (``base``: where all three training modes start, since every mode runs
  the whole pipeline and differs only in which experts learn) and without it (``base_no_refiner``,
  ``--model.llm=null``: what the refiner is worth), with the CSVLogger given on the command line so it
  writes a ``metrics.csv``. Their scores equal those of a fit's validation with untrained weights (a
  fit with both learning rates 0, checked against it, logs identical held-out metrics).

Every run gets ``--seed_everything=<s> --data.seed=<s>``, its own logger folder
``<out>/runs/<mode>_s<seed>/version_N`` and (fit) checkpoint folder ``<out>/ckpt/<mode>_s<seed>``;
its stdout and stderr go to ``<out>/logs/<mode>_s<seed>.{out,err}``.

Splits: the recipe's own validation prompts are the main split (``--val-name``, default ``composition``),
validated during each fit and plotted against RL steps. Every ``--extra-val NAME=FILE`` split (default:
the shipped ShapesWorld ``vocabulary`` split) is scored after a run finishes by one more ``validate``
subprocess: of the fit's ``last.ckpt``, or of the starting weights for the base rows, with
``--data.val_prompts=FILE``; it logs to ``<out>/runs/<mode>_s<seed>_<NAME>``. The held-out strict and soft
scores, overall and per category (``val/<term>/{strict,soft}/<category>``, see
:meth:`unirl_pl.rewards.shapes.ShapesGenEval.breakdown`), are read from each run's ``metrics.csv``:
the last validation row for the table, every validation row for the curve. After each finished run
``<out>/ablation.csv``, ``<out>/ablation.md`` and ``<out>/ablation.png`` are rewritten, so an
interrupted or partly failed ablation keeps what finished. A failed run makes the command exit 1,
naming the run and showing the tail of its stderr; the other runs still run (``--fail-fast`` stops).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unirl_pl.threads import set_threads

MODES: tuple[str, ...] = ("base", "base_no_refiner", "joint", "prompt_only", "generator_only")
# No-RL rows: the recipe's starting weights, validated with these overrides.
BASE_MODES: dict[str, tuple[str, ...]] = {
    "base": ("--model.mode=joint",),
    "base_no_refiner": ("--model.mode=generator_only", "--model.llm=null"),
}
DEFAULT_EXTRA_VAL = ("vocabulary", Path(__file__).resolve().parent / "assets" / "shapes" / "prompts_vocabulary.jsonl")
PROG = "python -m unirl_pl ablate"
# A smoke setting: two RL steps, a validation after each, one small held-out batch, short rollouts.
QUICK: tuple[str, ...] = (
    "--trainer.max_steps=2",
    "--trainer.val_check_interval=1",
    "--trainer.limit_val_batches=1",
    "--data.val_batch_size=8",
    "--data.prompts_per_step=2",
    "--data.samples_per_prompt=2",
    "--model.rollout.num_steps=4",
    "--model.rollout.sde_window=[0,2]",
)
# ``val/<term>/<strict|soft>/<category>``, as the module logs a reward term's breakdown.
METRIC_RE = re.compile(r"^val/(?P<term>[^/]+)/(?P<score>strict|soft)/(?P<category>[^/]+)$")
SCORES = ("strict", "soft")
STDERR_TAIL = 25
COLORS = {
    "base": (110, 110, 110),
    "base_no_refiner": (150, 150, 90),
    "joint": (31, 119, 180),
    "prompt_only": (255, 127, 14),
    "generator_only": (44, 160, 44),
}

Series = dict[str, list[tuple[int, float]]]


@dataclass
class Run:
    """One (mode, seed) run on one validation split: its command, where it writes, and what it gave.

    ``split`` is empty for the run itself (fit, or validate for base) and names the split of an
    extra validation of that run's result.
    """

    mode: str
    seed: int
    command: list[str]
    save_dir: Path
    log_out: Path
    log_err: Path
    split: str = ""
    returncode: int | None = None
    seconds: float = math.nan
    version_dir: Path | None = None
    final: dict[str, float] = field(default_factory=dict)  # metric -> value at the last validation
    final_step: int | None = None
    series: Series = field(default_factory=dict)  # metric -> [(RL steps done, value), ...]

    @property
    def name(self) -> str:
        return run_name(self.mode, self.seed, self.split)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and bool(self.final)


def run_name(mode: str, seed: int, split: str = "") -> str:
    return f"{mode}_s{seed}" + (f"_{split}" if split else "")


# ------------------------------------------------------------------ commands
def last_callback_is_checkpoint(config: Path) -> bool:
    """Whether the recipe's last ``trainer.callbacks`` entry is a ``ModelCheckpoint`` (or ``RunCheckpoint``).

    ``--trainer.callbacks.dirpath=...`` sets ``dirpath`` of the last callback in the list, so it is
    given only when that callback is the checkpoint one.
    """
    import yaml

    try:
        recipe = yaml.safe_load(config.read_text()) or {}
    except (OSError, yaml.YAMLError):
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
) -> list[str]:
    """The command line of one run (the base rows validate, the other modes fit); overrides come last."""
    name = run_name(mode, seed)
    runs = out / "runs"
    common = [f"--seed_everything={seed}", f"--data.seed={seed}"]
    if split is not None:
        # Score the finished run on another prompt file: the fit's last checkpoint (base: the start).
        split_name, prompts = split
        head = ["validate", "--config", config, *BASE_MODES.get(mode, (f"--model.mode={mode}",)), *common]
        if mode not in BASE_MODES:
            head.append(f"--ckpt_path={out / 'ckpt' / name / 'last.ckpt'}")
        head += [f"--data.val_prompts={prompts}", "--trainer.logger=lightning.pytorch.loggers.CSVLogger"]
        head += [f"--trainer.logger.init_args.save_dir={runs}"]
        head += [f"--trainer.logger.init_args.name={run_name(mode, seed, split_name)}"]
        return [sys.executable, "-m", "unirl_pl", *head, *(QUICK if quick else ()), *extra]
    if mode in BASE_MODES:
        # validate keeps a logger only when the command line gives one (cli.UniRLCLI); no RL, so the
        # recipe's starting weights, with the refiner in front (base) or without it (base_no_refiner).
        head = ["validate", "--config", config, *BASE_MODES[mode], *common]
        head += ["--trainer.logger=lightning.pytorch.loggers.CSVLogger"]
    else:
        head = ["fit", "--config", config, f"--model.mode={mode}", *common]
    head += [f"--trainer.logger.init_args.save_dir={runs}", f"--trainer.logger.init_args.name={name}"]
    if mode not in BASE_MODES and checkpoint_dirpath:
        head.append(f"--trainer.callbacks.dirpath={out / 'ckpt' / name}")
    return [sys.executable, "-m", "unirl_pl", *head, *(QUICK if quick else ()), *extra]


# ------------------------------------------------------------------ reading metrics.csv
def _versions(folder: Path) -> dict[Path, float]:
    return {p: p.stat().st_mtime for p in folder.glob("version_*") if p.is_dir()} if folder.is_dir() else {}


def _version_number(path: Path) -> int:
    try:
        return int(path.name.split("_", 1)[1])
    except (IndexError, ValueError):
        return -1


def read_validation(path: Path, *, fit: bool) -> tuple[dict[str, float], int | None, Series]:
    """The held-out breakdown of a ``metrics.csv``: (last validation's values, its x, every validation).

    Keys are ``<term>/<strict|soft>/<category>``. x is the number of RL steps done: a fit logs its
    validation after step N at ``step`` N - 1; ``validate`` (base) runs before any step, so x = 0.
    """
    final: dict[str, float] = {}
    final_step: int | None = None
    series: Series = {}
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            values = {}
            for key, value in row.items():
                found = METRIC_RE.match(key or "")
                if found and value not in ("", None):
                    values[key[len("val/") :]] = float(value)
            if not values:
                continue
            step = int(float(row.get("step") or 0))
            x = step + 1 if fit else 0
            for key, value in values.items():
                series.setdefault(key, []).append((x, value))
            final, final_step = values, x
    return final, final_step, series


def metric_order(keys: set[str] | list[str]) -> list[str]:
    """``<term>/<score>/<category>`` keys: by term, then overall first and the ShapesWorld category order."""
    try:
        from unirl_pl.shapes.scenes import CATEGORIES
    except ImportError:  # pragma: no cover - the package always has it
        CATEGORIES = ()
    rank = {name: i for i, name in enumerate(("overall", *CATEGORIES))}

    def key(metric: str) -> tuple[Any, ...]:
        term, score, category = metric.split("/")
        return (term, rank.get(category, len(rank)), category, SCORES.index(score))

    return sorted(keys, key=key)


# ------------------------------------------------------------------ aggregation
def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1; nan for a single value)."""
    n = len(values)
    if not n:
        return math.nan, math.nan
    mean = sum(values) / n
    if n == 1:
        return mean, math.nan
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))


def aggregate(runs: list[Run], modes: list[str], split: str = "") -> dict[str, dict[str, tuple[float, float, int]]]:
    """``mode -> metric -> (mean, std, n_seeds)`` over the finished runs of one split."""
    table: dict[str, dict[str, tuple[float, float, int]]] = {}
    for mode in modes:
        done = [r for r in runs if r.mode == mode and r.split == split and r.ok]
        keys = {k for r in done for k in r.final}
        table[mode] = {}
        for metric in metric_order(keys):
            values = [r.final[metric] for r in done if metric in r.final]
            table[mode][metric] = (*mean_std(values), len(values))
    return table


def _fmt(value: float) -> str:
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.6g}"


def split_names(runs: list[Run], main: str) -> dict[str, str]:
    """``Run.split -> the name written in the outputs``: the main split first, then the extra ones."""
    names = {"": main}
    for run in runs:
        names.setdefault(run.split, run.split)
    return names


def write_csv(path: Path, runs: list[Run], modes: list[str], main: str = "composition") -> None:
    """Per split: one row per mode x seed x metric (``stat=value``), then ``stat=mean`` and ``stat=std``
    rows per mode x metric; ``split`` is ``main`` for the recipe's own validation."""
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(
            ["split", "mode", "seed", "stat", "metric", "value", "rl_steps", "n_seeds", "wall_s", "run_dir"]
        )
        for split, label in split_names(runs, main).items():
            _write_split_rows(writer, [r for r in runs if r.split == split], modes, label)


def _write_split_rows(writer: Any, runs: list[Run], modes: list[str], label: str) -> None:
    table = aggregate(runs, modes, runs[0].split if runs else "")
    for mode in modes:
        done = [r for r in runs if r.mode == mode and r.ok]
        for run in done:
            for metric in metric_order(run.final):
                value = _fmt(run.final[metric])
                writer.writerow(
                    [
                        label,
                        mode,
                        run.seed,
                        "value",
                        metric,
                        value,
                        run.final_step,
                        1,
                        f"{run.seconds:.1f}",
                        run.version_dir,
                    ]
                )
        steps = sorted({r.final_step for r in done if r.final_step is not None})
        for stat, index in (("mean", 0), ("std", 1)):
            for metric, stats in table[mode].items():
                last = steps[-1] if steps else ""
                writer.writerow([label, mode, "", stat, metric, _fmt(stats[index]), last, stats[2], "", ""])


def _cell(mean: float, std: float) -> str:
    if math.isnan(mean):
        return "–"
    return f"{mean:.3f} ± {'–' if math.isnan(std) else f'{std:.3f}'}"


def _columns(metrics: list[str]) -> list[tuple[str, str]]:
    """``(metric, header)`` per table column; the reward term is named only when there are several."""
    terms = {m.split("/")[0] for m in metrics}
    out = []
    for metric in metrics:
        term, score, category = metric.split("/")
        header = f"{score} {category}" if len(terms) == 1 else f"{term} {score} {category}"
        out.append((metric, header))
    return out


def write_markdown(
    path: Path, runs: list[Run], modes: list[str], meta: dict[str, str], main: str = "composition"
) -> None:
    """Per split (the main one first), a table with one row per mode and a column per metric as
    ``mean ± std`` over seeds."""
    lines = [
        "# Ablation: held-out scores by mode",
        "",
        *(f"- {key}: {value}" for key, value in meta.items()),
        "",
        "Each cell is `mean ± std` over seeds of the held-out score at the run's last validation "
        "(std: sample standard deviation, n - 1; `–` with a single seed). Strict = every constraint of "
        "the scene holds (GenEval accuracy); soft = fraction of constraints that hold. `base` = the "
        "recipe's starting weights validated before any RL step, refiner in front of the DiT (where every "
        "mode starts: all run the whole pipeline and differ only in which experts learn); "
        "`base_no_refiner` = the same DiT on the user's prompts, no refiner.",
    ]
    for split, label in split_names(runs, main).items():
        note = " (the recipe's validation prompts)" if not split else " (scored after each run)"
        lines += ["", f"## {label} split{note}", "", *_table([r for r in runs if r.split == split], modes, split)]
    failed = [r for r in runs if r.returncode is not None and not r.ok]
    if failed:
        lines += ["", "Failed runs (not in the tables):", ""]
        lines += [f"- `{r.name}`: exit {r.returncode}, stderr in `{r.log_err}`" for r in failed]
    path.write_text("\n".join(lines) + "\n")


def _table(runs: list[Run], modes: list[str], split: str) -> list[str]:
    table = aggregate(runs, modes, split)
    columns = _columns(metric_order({m for row in table.values() for m in row}))
    lines = [
        "| mode | seeds | RL steps | wall s (mean) | " + " | ".join(h for _, h in columns) + " |",
        "|---|---|---|---|" + "---|" * len(columns),
    ]
    for mode in modes:
        done = [r for r in runs if r.mode == mode and r.ok]
        if not done:
            lines.append("| " + " | ".join([mode, "–", "–", "–", *("–" for _ in columns)]) + " |")
            continue
        steps = sorted({r.final_step for r in done if r.final_step is not None})
        wall = sum(r.seconds for r in done) / len(done)
        cells = [_cell(*table[mode][m][:2]) if m in table[mode] else "–" for m, _ in columns]
        seeds = " ".join(str(r.seed) for r in done)
        step_text = "/".join(str(s) for s in steps) or "–"
        lines.append("| " + " | ".join([mode, seeds, step_text, f"{wall:.0f}", *cells]) + " |")
    return lines


# ------------------------------------------------------------------ the plot (PIL: no matplotlib)
def _font(size: int):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: a fixed bitmap font
        return ImageFont.load_default()


def _nice_ticks(lo: float, hi: float, target: int = 6) -> list[float]:
    span = max(hi - lo, 1e-9)
    raw = span / target
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    return [round(first + i * step, 10) for i in range(int((hi - first) / step + 1e-9) + 1)]


def curve_stats(runs: list[Run], mode: str, metric: str) -> list[tuple[int, float, float, int]]:
    """``(x, mean, std, n)`` of ``metric`` over the finished seeds of ``mode``, per validation x."""
    by_x: dict[int, list[float]] = {}
    for run in runs:
        if run.mode == mode and run.ok:
            for x, value in run.series.get(metric, []):
                by_x.setdefault(x, []).append(value)
    out = []
    for x in sorted(by_x):
        mean, std = mean_std(by_x[x])
        out.append((x, mean, 0.0 if math.isnan(std) else std, len(by_x[x])))
    return out


def draw_plot(path: Path, runs: list[Run], modes: list[str], size: tuple[int, int] = (960, 560)) -> None:
    """Held-out strict (overall) against RL steps: a line per mode (mean over seeds), a band of ± one std.

    A base row is validated before any step, so it is a dashed horizontal line (its value at step 0)
    with its band across the whole axis.
    """
    from PIL import Image, ImageDraw

    width, height = size
    left, right, top, bottom = 84, 230, 56, 64
    img = Image.new("RGBA", size, "white")
    draw = ImageDraw.Draw(img)
    title_font, font, small = _font(20), _font(15), _font(13)
    runs = [r for r in runs if not r.split]  # the curve is the main split's, validated during each fit
    keys = {k for r in runs if r.ok for k in r.series}
    strict = metric_order({k for k in keys if k.split("/")[1:] == ["strict", "overall"]})
    n_seeds = len({r.seed for r in runs if r.ok})
    draw.text((left, 14), "Held-out strict accuracy (overall) vs RL steps", fill="black", font=title_font)
    if not strict:
        draw.text((left, height // 2), "no held-out strict score logged yet", fill="black", font=font)
        img.convert("RGB").save(path)
        return
    metric = strict[0]
    curves = {mode: curve_stats(runs, mode, metric) for mode in modes}
    curves = {mode: c for mode, c in curves.items() if c}
    xs = [x for c in curves.values() for x, *_ in c]
    lows = [m - s for c in curves.values() for _, m, s, _ in c]
    highs = [m + s for c in curves.values() for _, m, s, _ in c]
    x0, x1 = min(xs), max(xs)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    y0, y1 = max(0.0, min(lows)), min(1.0, max(highs))
    pad = (y1 - y0) * 0.1 or 0.05
    y0, y1 = max(0.0, y0 - pad), min(1.0, y1 + pad)
    if y1 - y0 < 0.05:
        y0, y1 = max(0.0, y0 - 0.025), min(1.0, y1 + 0.025)
    plot = (left, top, width - right, height - bottom)

    def xy(x: float, y: float) -> tuple[float, float]:
        px = plot[0] + (x - x0) / (x1 - x0) * (plot[2] - plot[0])
        py = plot[1] + (y1 - min(max(y, y0), y1)) / (y1 - y0) * (plot[3] - plot[1])
        return px, py

    # Grid and ticks.
    for value in _nice_ticks(y0, y1):
        _, py = xy(x0, value)
        draw.line([plot[0], py, plot[2], py], fill=(228, 228, 228))
        label = f"{value:.2f}"
        w = draw.textlength(label, font=small)
        draw.text((plot[0] - 8 - w, py - 7), label, fill="black", font=small)
    integer_ticks = [t for t in _nice_ticks(x0, x1, 8) if float(t).is_integer()] or [x0, x1]
    for value in integer_ticks:
        px, _ = xy(value, y0)
        draw.line([px, plot[1], px, plot[3]], fill=(240, 240, 240))
        label = f"{value:.0f}"
        draw.text((px - draw.textlength(label, font=small) / 2, plot[3] + 6), label, fill="black", font=small)
    draw.rectangle(plot, outline="black")
    xlabel = "RL steps done (validation after step N; base = before any step)"
    draw.text(
        ((plot[0] + plot[2]) / 2 - draw.textlength(xlabel, font=font) / 2, height - bottom + 30),
        xlabel,
        fill="black",
        font=font,
    )
    ylabel = f"held-out strict ({metric})"
    label_img = Image.new("RGBA", (int(draw.textlength(ylabel, font=font)) + 4, 20), (255, 255, 255, 0))
    ImageDraw.Draw(label_img).text((2, 0), ylabel, fill="black", font=font)
    label_img = label_img.rotate(90, expand=True)
    img.alpha_composite(label_img, (8, int((plot[1] + plot[3]) / 2 - label_img.height / 2)))

    # Bands first (translucent), then lines and markers on top.
    overlay = Image.new("RGBA", size, (255, 255, 255, 0))
    band = ImageDraw.Draw(overlay)
    for mode, curve in curves.items():
        color = COLORS.get(mode, (148, 103, 189))
        if mode in BASE_MODES or len(curve) == 1:
            _, mean, std, _ = curve[0]
            lo_y, hi_y = xy(x0, mean + std)[1], xy(x0, mean - std)[1]
            band.rectangle([plot[0], lo_y, plot[2], hi_y], fill=(*color, 40))
        else:
            upper = [xy(x, m + s) for x, m, s, _ in curve]
            lower = [xy(x, m - s) for x, m, s, _ in reversed(curve)]
            band.polygon(upper + lower, fill=(*color, 55))
    img.alpha_composite(overlay)
    draw = ImageDraw.Draw(img)
    for mode, curve in curves.items():
        color = COLORS.get(mode, (148, 103, 189))
        if mode in BASE_MODES or len(curve) == 1:
            x, mean, _, _ = curve[0]
            _, py = xy(x0, mean)
            px = plot[0]
            while px < plot[2]:  # dashed
                draw.line([px, py, min(px + 10, plot[2]), py], fill=color, width=3)
                px += 16
            cx, cy = xy(x, mean)
            draw.ellipse([cx - 5, cy - 5, cx + 5, cy + 5], fill=color)
            continue
        draw.line([xy(x, m) for x, m, _, _ in curve], fill=color, width=3)
        for x, m, _, _ in curve:
            cx, cy = xy(x, m)
            draw.ellipse([cx - 5, cy - 5, cx + 5, cy + 5], fill=color)

    # Legend, right of the plot.
    lx, ly = plot[2] + 16, plot[1]
    draw.text((lx, ly), "mode (mean;", fill="black", font=small)
    draw.text((lx, ly + 16), "band = ± 1 std)", fill="black", font=small)
    ly += 44
    for mode, curve in curves.items():
        color = COLORS.get(mode, (148, 103, 189))
        draw.rectangle([lx, ly + 2, lx + 26, ly + 16], fill=tuple(255 - (255 - c) * 55 // 255 for c in color))
        draw.line([lx, ly + 9, lx + 26, ly + 9], fill=color, width=3)
        n = max(c[3] for c in curve)
        draw.text((lx + 34, ly + 1), f"{mode} (n={n})", fill="black", font=font)
        ly += 28
    draw.text((lx, ly + 8), f"{n_seeds} seed(s)", fill=(80, 80, 80), font=small)
    img.convert("RGB").save(path)


# ------------------------------------------------------------------ running
def _tail(path: Path, lines: int = STDERR_TAIL) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no stderr written)"
    # Progress bars redraw with carriage returns; keep the last state of each line.
    rows = [row.rsplit("\r", 1)[-1] for row in text.splitlines()]
    return "\n".join(rows[-lines:]) or "(stderr is empty)"


def execute(run: Run, env: dict[str, str]) -> None:
    """Run ``run.command``; then find the logger version folder it made and read its metrics."""
    run.log_out.parent.mkdir(parents=True, exist_ok=True)
    folder = run.save_dir / run.name
    before = _versions(folder)
    start = time.perf_counter()
    with run.log_out.open("w") as out, run.log_err.open("w") as err:
        out.write(" ".join(run.command) + "\n\n")
        out.flush()
        proc = subprocess.Popen(run.command, stdout=out, stderr=err, env=env)
        try:
            run.returncode = proc.wait()
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


def write_outputs(out: Path, runs: list[Run], modes: list[str], meta: dict[str, str], main: str) -> None:
    write_csv(out / "ablation.csv", runs, modes, main)
    write_markdown(out / "ablation.md", runs, modes, meta, main)
    draw_plot(out / "ablation.png", runs, modes)


def finished(runs: list[Run], extra_runs: dict[str, list[Run]]) -> list[Run]:
    """The runs that ran, each followed by its extra-split validations."""
    return [x for r in runs if r.returncode is not None for x in (r, *extra_runs[r.name])]


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
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Run every mode over several seeds (one subprocess each) and tabulate held-out "
        "strict/soft scores as mean ± std. Arguments after -- are passed to every run.",
        epilog="example: python -m unirl_pl ablate --config recipes/joint.yaml --seeds 0 1 2 -- --trainer.max_steps=20",
    )
    parser.add_argument("--config", required=True, help="the recipe every run uses (e.g. recipes/joint.yaml)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds (default: 0 1 2)")
    parser.add_argument(
        "--modes", nargs="+", choices=MODES, default=list(MODES), help="modes (default: all; base = no RL)"
    )
    parser.add_argument("--out", default="runs/ablation", help="output folder (default: runs/ablation)")
    parser.add_argument("--quick", action="store_true", help="smoke setting: 2 steps, tiny batches (seconds a run)")
    parser.add_argument("--fail-fast", action="store_true", help="stop at the first failed run")
    parser.add_argument(
        "--val-name", default="composition", help="name of the recipe's own validation split (default: composition)"
    )
    parser.add_argument(
        "--extra-val",
        nargs="*",
        type=parse_split,
        default=[(DEFAULT_EXTRA_VAL[0], DEFAULT_EXTRA_VAL[1])] if DEFAULT_EXTRA_VAL[1].is_file() else [],
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
    return args, extra


def main(argv: list[str] | None = None) -> int:
    """Run the ablation; the exit status: 0 when every run finished, 1 when one failed, 130 on Ctrl-C."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    args, extra = parse_args(list(sys.argv[1:] if argv is None else argv))
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = last_callback_is_checkpoint(Path(args.config))
    runs = [
        Run(
            mode=mode,
            seed=seed,
            command=build_command(
                args.config, mode, seed, out, quick=args.quick, extra=extra, checkpoint_dirpath=checkpoint
            ),
            save_dir=out / "runs",
            log_out=out / "logs" / f"{run_name(mode, seed)}.out",
            log_err=out / "logs" / f"{run_name(mode, seed)}.err",
        )
        for seed in args.seeds
        for mode in args.modes
    ]
    if not checkpoint and args.extra_val and any(m not in BASE_MODES for m in args.modes):
        print(f"{PROG}: --extra-val needs the fit's last.ckpt: the recipe's last callback must be a ModelCheckpoint")
        return 2
    extra_runs: dict[str, list[Run]] = {
        run.name: [
            Run(
                mode=run.mode,
                seed=run.seed,
                command=build_command(args.config, run.mode, run.seed, out, quick=args.quick, extra=extra, split=split),
                save_dir=out / "runs",
                log_out=out / "logs" / f"{run_name(run.mode, run.seed, split[0])}.out",
                log_err=out / "logs" / f"{run_name(run.mode, run.seed, split[0])}.err",
                split=split[0],
            )
            for split in args.extra_val
        ]
        for run in runs
    }
    meta = {
        "recipe": f"`{args.config}`",
        "seeds": " ".join(map(str, args.seeds)),
        "setting": "`--quick` (smoke: " + " ".join(QUICK) + ")" if args.quick else "the recipe's",
        "extra overrides": f"`{' '.join(extra)}`" if extra else "none",
        "command of each run": f"`{out / 'logs'}/<mode>_s<seed>[_<split>].out` (first line)",
        "splits": ", ".join(
            [f"{args.val_name} (the recipe's validation prompts)"] + [f"{n} (`{p}`)" for n, p in args.extra_val]
        ),
    }
    env = dict(os.environ)
    set_threads(env=env)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    console = Console(stderr=True)
    console.print(
        f"ablation: {len(runs)} runs ({' '.join(args.modes)} x seeds {' '.join(map(str, args.seeds))}) -> {out}"
    )
    if not checkpoint:
        console.print(
            "note: the recipe's last callback is not a ModelCheckpoint; checkpoints keep their default folder"
        )
    failed: list[Run] = []
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
    with Progress(*columns, console=console, speed_estimate_period=24 * 3600) as progress:
        task = progress.add_task("ablation", total=len(runs) * (1 + len(args.extra_val)), current="")
        try:
            for run in runs:
                progress.update(task, current=f"running [cyan]{run.name}[/]")
                execute(run, env)
                if run.ok:
                    score = {k.split("/", 1)[1]: v for k, v in run.final.items()}
                    progress.console.print(
                        f"[green]done[/] {run.name}: {run.seconds:.0f} s, held-out strict "
                        f"{score.get('strict/overall', math.nan):.3f} / soft {score.get('soft/overall', math.nan):.3f}"
                    )
                else:
                    failed.append(run)
                    why = f"exit {run.returncode}" if run.returncode else "no held-out metrics in its metrics.csv"
                    progress.console.print(f"[red]FAILED[/] {run.name} ({why}); stderr: {run.log_err}")
                progress.advance(task)
                for split_run in extra_runs[run.name] if run.ok else ():
                    progress.update(task, current=f"scoring [cyan]{split_run.name}[/]")
                    execute(split_run, env)
                    split_run.final_step = run.final_step
                    if not split_run.ok:
                        failed.append(split_run)
                        progress.console.print(f"[red]FAILED[/] {split_run.name}; stderr: {split_run.log_err}")
                    progress.advance(task)
                done = [r for r in runs if r.returncode is not None]
                write_outputs(
                    out, done + [x for r in done for x in extra_runs[r.name]], args.modes, meta, args.val_name
                )
                if failed and args.fail_fast:
                    break
        except KeyboardInterrupt:
            write_outputs(out, finished(runs, extra_runs), args.modes, meta, args.val_name)
            console.print(f"interrupted; finished runs are in {out / 'ablation.md'}")
            return 130
        progress.update(task, current="")
    console.print(f"wrote {out / 'ablation.csv'}, {out / 'ablation.md'}, {out / 'ablation.png'}")
    if failed:
        for run in failed:
            why = f"exit status {run.returncode}" if run.returncode else "no held-out metrics logged"
            print(
                f"error: run {run.name} failed ({why}). Command: {' '.join(run.command)}\n"
                f"Last lines of its stderr ({run.log_err}):\n{_tail(run.log_err)}\n",
                file=sys.stderr,
            )
        names = ", ".join(r.name for r in failed)
        print(f"error: {len(failed)} runs failed: {names}; the others' results are kept", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
