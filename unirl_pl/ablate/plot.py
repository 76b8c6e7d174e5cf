"""The ablation's pictures, drawn with PIL (no matplotlib): ``ablation.png`` and ``strict_vs_cpu.png``.

``ablation.png``: held-out strict (overall, main split) against RL steps, a line per group (the mean over
seeds at each validation) in a band of ± one std; a base row, validated before any step, is a dashed
horizontal line. ``strict_vs_cpu.png`` (with ``--vary``): the same score against the training CPU seconds
spent to reach it, a dot per run and validation and a line per group through the means.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unirl_pl.ablate.metrics import strict_overall
from unirl_pl.ablate.runs import BASE_MODES, Run
from unirl_pl.ablate.stats import mean_std

SIZE = (960, 560)
LEFT, RIGHT, TOP, BOTTOM = 84, 230, 56, 64
MODE_COLORS = {
    "base": (110, 110, 110),
    "base_no_refiner": (150, 150, 90),
    "joint": (31, 119, 180),
    "prompt_only": (255, 127, 14),
    "generator_only": (44, 160, 44),
}
# For groups with arms: distinct hues, in the order of the table's rows.
PALETTE = (
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (127, 127, 127),
    (188, 189, 34),
    (23, 190, 207),
)


def colors(groups: list[str]) -> dict[str, tuple[int, int, int]]:
    """A color per group: each mode's own when the groups are plain modes, else the palette in order."""
    if all(g in MODE_COLORS for g in groups):
        return {g: MODE_COLORS[g] for g in groups}
    return {g: PALETTE[i % len(PALETTE)] for i, g in enumerate(groups)}


def _font(size: int) -> Any:
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: a fixed bitmap font
        return ImageFont.load_default()


def nice_ticks(lo: float, hi: float, target: int = 6) -> list[float]:
    """Round tick values (steps of 1, 2, 2.5 or 5 times a power of ten) covering ``[lo, hi]``."""
    span = max(hi - lo, 1e-9)
    raw = span / target
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    return [round(first + i * step, 10) for i in range(int((hi - first) / step + 1e-9) + 1)]


def score_range(lows: list[float], highs: list[float]) -> tuple[float, float]:
    """The y range of a score in [0, 1]: the data with a tenth of padding, at least 0.05 tall."""
    y0, y1 = max(0.0, min(lows)), min(1.0, max(highs))
    pad = (y1 - y0) * 0.1 or 0.05
    y0, y1 = max(0.0, y0 - pad), min(1.0, y1 + pad)
    if y1 - y0 < 0.05:
        y0, y1 = max(0.0, y0 - 0.025), min(1.0, y1 + 0.025)
    return y0, y1


@dataclass
class Frame:
    """A plot area in pixels (left, top, right, bottom) and the data range it shows."""

    box: tuple[int, int, int, int]
    x0: float
    x1: float
    y0: float
    y1: float

    def xy(self, x: float, y: float) -> tuple[float, float]:
        left, top, right, bottom = self.box
        px = left + (x - self.x0) / (self.x1 - self.x0) * (right - left)
        py = top + (self.y1 - min(max(y, self.y0), self.y1)) / (self.y1 - self.y0) * (bottom - top)
        return px, py


def draw_frame(img: Any, frame: Frame, title: str, xlabel: str, ylabel: str, *, integer_x: bool) -> None:
    """Title, grid, ticks, the box and both axis labels (the y label turned upright)."""
    from PIL import Image, ImageDraw

    draw = ImageDraw.Draw(img)
    title_font, font, small = _font(20), _font(15), _font(13)
    left, top, right, bottom = frame.box
    draw.text((LEFT, 14), title, fill="black", font=title_font)
    y_ticks = nice_ticks(frame.y0, frame.y1)
    # As many decimals as the ticks need (0.425, not 0.42), at least two.
    decimals = next((d for d in (2, 3, 4) if all(abs(round(t, d) - t) < 1e-9 for t in y_ticks)), 4)
    for value in y_ticks:
        _, py = frame.xy(frame.x0, value)
        draw.line([left, py, right, py], fill=(228, 228, 228))
        label = f"{value:.{decimals}f}"
        draw.text((left - 8 - draw.textlength(label, font=small), py - 7), label, fill="black", font=small)
    ticks = nice_ticks(frame.x0, frame.x1, 8)
    if integer_x:
        ticks = [t for t in ticks if float(t).is_integer()] or [frame.x0, frame.x1]
    for value in ticks:
        px, _ = frame.xy(value, frame.y0)
        draw.line([px, top, px, bottom], fill=(240, 240, 240))
        label = f"{value:.0f}" if float(value).is_integer() else f"{value:g}"
        draw.text((px - draw.textlength(label, font=small) / 2, bottom + 6), label, fill="black", font=small)
    draw.rectangle(frame.box, outline="black")
    width = (left + right) / 2 - draw.textlength(xlabel, font=font) / 2
    draw.text((width, bottom + 30), xlabel, fill="black", font=font)
    label_img = Image.new("RGBA", (int(draw.textlength(ylabel, font=font)) + 4, 20), (255, 255, 255, 0))
    ImageDraw.Draw(label_img).text((2, 0), ylabel, fill="black", font=font)
    label_img = label_img.rotate(90, expand=True)
    img.alpha_composite(label_img, (8, int((top + bottom) / 2 - label_img.height / 2)))


def canvas(size: tuple[int, int], labels: list[str]) -> tuple[tuple[int, int], tuple[int, int, int, int]]:
    """The image size and plot box for ``size``, widened so that the longest legend label fits on the right."""
    from PIL import Image, ImageDraw

    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    legend = 50 + max((measure.textlength(text, font=_font(15)) for text in labels), default=0) + 12
    width = size[0] + max(0, int(legend) - RIGHT)
    return (width, size[1]), (LEFT, TOP, width - max(RIGHT, int(legend)), size[1] - BOTTOM)


def _blank(path: Path, title: str, message: str, size: tuple[int, int]) -> None:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(img)
    draw.text((LEFT, 14), title, fill="black", font=_font(20))
    draw.text((LEFT, size[1] // 2), message, fill="black", font=_font(15))
    img.save(path)


def curve_stats(runs: list[Run], group: str, metric: str) -> list[tuple[int, float, float, int]]:
    """``(x, mean, std, n)`` of ``metric`` over the finished seeds of ``group``, per validation x."""
    by_x: dict[int, list[float]] = {}
    for run in runs:
        if run.group == group and run.ok:
            for x, value in run.series.get(metric, []):
                by_x.setdefault(x, []).append(value)
    out = []
    for x in sorted(by_x):
        mean, std = mean_std(by_x[x])
        out.append((x, mean, 0.0 if math.isnan(std) else std, len(by_x[x])))
    return out


def draw_plot(path: Path, runs: list[Run], groups: list[str], size: tuple[int, int] = SIZE) -> None:
    """Held-out strict (overall) against RL steps: a line per group (mean over seeds), a band of ± one std.

    A base row is validated before any step, so it is a dashed horizontal line (its value at step 0)
    with its band across the whole axis.
    """
    from PIL import Image, ImageDraw

    title = "Held-out strict accuracy (overall) vs RL steps"
    runs = [r for r in runs if not r.split]  # the curve is the main split's, validated during each fit
    metric = strict_overall({k for r in runs if r.ok for k in r.series})
    if metric is None:
        _blank(path, title, "no held-out strict score logged yet", size)
        return
    flat = {r.group for r in runs if r.mode in BASE_MODES}
    curves = {g: c for g in groups if (c := curve_stats(runs, g, metric))}
    xs = [x for c in curves.values() for x, *_ in c]
    x0, x1 = min(xs), max(xs)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    y0, y1 = score_range(
        [m - s for c in curves.values() for _, m, s, _ in c], [m + s for c in curves.values() for _, m, s, _ in c]
    )
    legend = {g: f"{g} (n={max(c[3] for c in curve)})" for g, curve in curves.items()}
    size, box = canvas(size, list(legend.values()))
    frame = Frame(box, x0, x1, y0, y1)
    img = Image.new("RGBA", size, "white")
    xlabel = "RL steps done (validation after step N; base = before any step)"
    draw_frame(img, frame, title, xlabel, f"held-out strict ({metric})", integer_x=True)
    palette = colors(groups)
    left, top, right, _ = frame.box
    # Bands first (translucent), then lines and markers on top.
    overlay = Image.new("RGBA", size, (255, 255, 255, 0))
    band = ImageDraw.Draw(overlay)
    for group, curve in curves.items():
        color = palette[group]
        if group in flat or len(curve) == 1:
            _, mean, std, _ = curve[0]
            band.rectangle([left, frame.xy(x0, mean + std)[1], right, frame.xy(x0, mean - std)[1]], fill=(*color, 40))
        else:
            upper = [frame.xy(x, m + s) for x, m, s, _ in curve]
            lower = [frame.xy(x, m - s) for x, m, s, _ in reversed(curve)]
            band.polygon(upper + lower, fill=(*color, 55))
    img.alpha_composite(overlay)
    draw = ImageDraw.Draw(img)
    for group, curve in curves.items():
        color = palette[group]
        if group in flat or len(curve) == 1:
            x, mean, _, _ = curve[0]
            py, px = frame.xy(x0, mean)[1], float(left)
            while px < right:  # dashed
                draw.line([px, py, min(px + 10, right), py], fill=color, width=3)
                px += 16
            points = [frame.xy(x, mean)]
        else:
            points = [frame.xy(x, m) for x, m, _, _ in curve]
            draw.line(points, fill=color, width=3)
        for cx, cy in points:
            draw.ellipse([cx - 5, cy - 5, cx + 5, cy + 5], fill=color)
    n_seeds = len({r.seed for r in runs if r.ok})
    _legend(draw, (right + 16, top), ["mode (mean;", "band = ± 1 std)"], legend, palette, f"{n_seeds} seed(s)")
    img.convert("RGB").save(path)


def _legend(draw: Any, at: tuple[int, int], title: list[str], labels: dict[str, str], palette: dict, foot: str) -> None:
    font, small = _font(15), _font(13)
    lx, ly = at
    for line in title:
        draw.text((lx, ly), line, fill="black", font=small)
        ly += 16
    ly += 12
    for group, text in labels.items():
        color = palette[group]
        draw.rectangle([lx, ly + 2, lx + 26, ly + 16], fill=tuple(255 - (255 - c) * 55 // 255 for c in color))
        draw.line([lx, ly + 9, lx + 26, ly + 9], fill=color, width=3)
        draw.text((lx + 34, ly + 1), text, fill="black", font=font)
        ly += 28
    draw.text((lx, ly + 8), foot, fill=(80, 80, 80), font=small)


def draw_strict_vs_cpu(path: Path, runs: list[Run], groups: list[str], size: tuple[int, int] = SIZE) -> None:
    """Held-out strict (overall, main split) against CPU seconds.

    With the training clock (``ablate`` adds it to every fit): a dot per run and validation at the training
    CPU seconds spent so far, and a line per group through the means at each validation. Without it: a dot
    per run at its last validation and whole-process CPU seconds, a ring with a cross at each group's mean.
    """
    from PIL import Image, ImageDraw

    from unirl_pl.ablate.report import cost_curves, cost_points

    runs = [r for r in runs if not r.split and r.ok and not math.isnan(r.cpu_seconds)]
    metric = strict_overall({k for r in runs for k in r.final})
    clocked = bool(runs) and all(r.train_cpu for r in runs)
    title = f"Held-out strict accuracy (overall) vs {'training ' if clocked else ''}CPU seconds"
    if clocked:
        per_run = {r.name: [(cpu, strict) for _, cpu, strict in cost_points(r)] for r in runs}
        lines = {g: [(cpu, mean) for _, cpu, mean, _, _ in curve] for g, curve in cost_curves(runs, groups).items()}
    else:
        per_run = {r.name: [(r.cpu_seconds, r.final[metric])] for r in runs if metric in r.final}
        lines = {}
    points = {g: [p for r in runs if r.group == g for p in per_run.get(r.name, [])] for g in groups}
    points = {g: p for g, p in points.items() if p}
    if metric is None or not points:
        _blank(path, title, "no run with a held-out strict score and its CPU seconds yet", size)
        return
    xs = [x for p in points.values() for x, _ in p]
    ys = [y for p in points.values() for _, y in p]
    x1 = max(xs) * 1.08 or 1.0
    x0 = 0.0 if clocked else max(0.0, min(xs) - (x1 - min(xs)) * 0.1)
    n_runs = {g: sum(1 for r in runs if r.group == g) for g in points}
    legend = {g: f"{g} (n={n_runs[g]})" for g in points}
    size, box = canvas(size, list(legend.values()))
    frame = Frame(box, x0, x1, *score_range(ys, ys))
    img = Image.new("RGBA", size, "white")
    if clocked:
        xlabel = "training CPU seconds spent (validation excluded)"
    else:
        xlabel = "CPU seconds of the run (user + system)"
    draw_frame(img, frame, title, xlabel, f"held-out strict ({metric})", integer_x=False)
    draw = ImageDraw.Draw(img)
    palette = colors(groups)
    for group, found in points.items():
        for x, y in found:
            cx, cy = frame.xy(x, y)
            draw.ellipse([cx - 3, cy - 3, cx + 3, cy + 3], fill=palette[group])
    for group, path_xy in lines.items():
        if group in points and path_xy:
            xy = [frame.xy(x, y) for x, y in path_xy]
            if len(xy) > 1:
                draw.line(xy, fill=palette[group], width=3)
            for cx, cy in xy:
                draw.ellipse([cx - 6, cy - 6, cx + 6, cy + 6], outline=palette[group], width=3)
    if not clocked:
        for group, found in points.items():
            cx, cy = frame.xy(sum(x for x, _ in found) / len(found), sum(y for _, y in found) / len(found))
            draw.ellipse([cx - 10, cy - 10, cx + 10, cy + 10], outline=palette[group], width=3)
            draw.line([cx - 14, cy, cx + 14, cy], fill=palette[group], width=2)
            draw.line([cx, cy - 14, cx, cy + 14], fill=palette[group], width=2)
    right, top = frame.box[2], frame.box[1]
    head = ["dot = a run at a", "validation; line =", "mean per step"] if clocked else ["dot = a run;", "ring = mean"]
    _legend(draw, (right + 16, top), head, legend, palette, "main split")
    img.convert("RGB").save(path)
