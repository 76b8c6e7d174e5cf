"""Writes ``predict`` results: one PNG per image and a ``predictions.jsonl`` with prompts and rewards."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
from lightning.pytorch.callbacks import BasePredictionWriter
from PIL import Image


class ImageWriter(BasePredictionWriter):
    """Save each predicted image as ``<output_dir>/<rank>_<batch>_<i>.png`` plus one JSONL row per image.

    Args:
        output_dir: Folder for the PNG files and ``predictions.jsonl`` (created if missing).
    """

    def __init__(self, output_dir: str = "outputs/predict") -> None:
        super().__init__(write_interval="batch")
        self.output_dir = Path(output_dir)

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
        images = (prediction["images"].float().clamp(0, 1) * 255).round().byte().permute(0, 2, 3, 1).cpu().numpy()
        with (self.output_dir / "predictions.jsonl").open("a") as f:
            for i, img in enumerate(images):
                name = f"{trainer.global_rank}_{batch_idx:04d}_{i:02d}.png"
                Image.fromarray(np.ascontiguousarray(img)).save(self.output_dir / name)
                row = {
                    "file": name,
                    "prompt": prediction["prompts"][i],
                    "refined": prediction["refined"][i],
                    "reward": prediction["rewards"][i],
                }
                f.write(json.dumps(row) + "\n")
