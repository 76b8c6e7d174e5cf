"""Writes ``predict`` results: one PNG per image (an animated WebP per video), a captioned grid per batch,
and ``predictions.jsonl``."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
from lightning.pytorch.callbacks import BasePredictionWriter
from PIL import Image, ImageDraw, ImageFont


class ImageWriter(BasePredictionWriter):
    """Save each predicted image as ``<output_dir>/<rank>_<batch>_<i>.png`` plus one JSONL row per image.

    With ``grid``, each batch also becomes ``grid_<rank>_<batch>.png``: every image enlarged to
    ``tile`` pixels with its prompt, refined prompt and reward written under it, so a person can
    judge a checkpoint at a glance.

    Args:
        output_dir: Folder for the PNG files and ``predictions.jsonl`` (created if missing).
        grid: Also write a captioned grid per batch.
        tile: Side in pixels of each image in the grid (nearest-neighbour upscaling keeps pixels crisp).
        columns: Images per grid row.
    """

    def __init__(
        self, output_dir: str = "outputs/predict", grid: bool = True, tile: int = 128, columns: int = 4
    ) -> None:
        super().__init__(write_interval="batch")
        if tile < 16 or columns < 1:
            raise ValueError(f"need tile >= 16 and columns >= 1, got {tile}, {columns}")
        self.output_dir = Path(output_dir)
        self.grid, self.tile, self.columns = grid, tile, columns

    def write_on_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        prediction: Any,
        batch_indices: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        pixels = (prediction["images"].float().clamp(0, 1) * 255).round().byte().cpu()
        video = pixels.ndim == 5
        # Videos (N, F, 3, H, W): an animated WebP each, and the grid shows their frames side by side.
        frames = pixels.permute(0, 1, 3, 4, 2).numpy() if video else pixels.permute(0, 2, 3, 1).numpy()[:, None]
        images = np.concatenate(list(frames.transpose(1, 0, 2, 3, 4)), axis=2) if video else frames[:, 0]
        rows = []
        with (self.output_dir / "predictions.jsonl").open("a") as f:
            for i, img in enumerate(images):
                name = f"{trainer.global_rank}_{batch_idx:04d}_{i:02d}." + ("webp" if video else "png")
                if video:
                    clip = [Image.fromarray(np.ascontiguousarray(frame)) for frame in frames[i]]
                    clip[0].save(self.output_dir / name, save_all=True, append_images=clip[1:], duration=125, loop=0)
                else:
                    Image.fromarray(np.ascontiguousarray(img)).save(self.output_dir / name)
                row = {
                    "file": name,
                    "prompt": prediction["prompts"][i],
                    "refined": prediction["refined"][i],
                    "reward": prediction["rewards"][i],
                }
                rows.append(row)
                f.write(json.dumps(row) + "\n")
        if self.grid:
            self._grid(images, rows).save(self.output_dir / f"grid_{trainer.global_rank}_{batch_idx:04d}.png")

    def _grid(self, images: np.ndarray, rows: list[dict[str, Any]]) -> Image.Image:
        font = ImageFont.load_default()
        text_h = 4 * 12
        cols = min(self.columns, len(images))
        n_rows = (len(images) + cols - 1) // cols
        # Tiles keep the aspect ratio; a video's tile is its frames in a row.
        tile_w = -(-self.tile * images.shape[2] // images.shape[1])
        sheet = Image.new("RGB", (cols * tile_w, n_rows * (self.tile + text_h)), "white")
        draw = ImageDraw.Draw(sheet)
        width = max(8, self.tile // 6)
        for i, (img, row) in enumerate(zip(images, rows, strict=True)):
            x, y = (i % cols) * tile_w, (i // cols) * (self.tile + text_h)
            tile = Image.fromarray(np.ascontiguousarray(img))
            sheet.paste(tile.resize((tile_w, self.tile), Image.NEAREST), (x, y))
            lines = [
                textwrap.shorten(row["prompt"], width),
                "-> " + textwrap.shorten(row["refined"] or "(empty)", width - 3),
                f"reward {row['reward']:.2f}",
            ]
            for j, line in enumerate(lines):
                draw.text((x + 2, y + self.tile + 1 + j * 12), line, fill="black", font=font)
        return sheet
