"""Images a person looks at: ``predict`` results (``ImageWriter``) and a captioned grid per validation
(``ValidationImages``), both drawn by :func:`captioned_grid`."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.loggers import MLFlowLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities import rank_zero_only
from PIL import Image, ImageDraw, ImageFont

LINE_H = 12  # pixels per caption line of PIL's default font
_CAPTION_LINES = 4


def to_frames(images: torch.Tensor) -> tuple[np.ndarray, np.ndarray | None]:
    """Float images ``(N, 3, H, W)`` or videos ``(N, F, 3, H, W)`` in [0, 1] as uint8 arrays.

    Returns ``(tiles, frames)``: ``tiles`` is ``(N, H, W', 3)`` (a video's frames side by side, W' = F * W)
    for a grid; ``frames`` is ``(N, F, H, W, 3)`` for a video and None for images.
    """
    pixels = (images.detach().float().clamp(0, 1) * 255).round().byte().cpu()
    if pixels.ndim == 5:
        frames = pixels.permute(0, 1, 3, 4, 2).numpy()
        return np.concatenate(list(frames.transpose(1, 0, 2, 3, 4)), axis=2), frames
    return pixels.permute(0, 2, 3, 1).numpy(), None


def beside_sources(images: np.ndarray, sources: list[Any] | None) -> np.ndarray:
    """Each of ``images`` (uint8 ``(N, H, W, 3)``) with its edit's source image (a
    :class:`~unirl_pl.source_images.SourceImage`) resized to the same size on its left; ``images`` without sources."""
    if not sources:
        return images
    height, width = images.shape[1:3]
    pairs = []
    for image, source in zip(images, sources, strict=True):
        left = Image.fromarray(source.data.permute(1, 2, 0).numpy()).resize((width, height), Image.BILINEAR)
        pairs.append(np.concatenate([np.asarray(left), image], axis=1))
    return np.stack(pairs)


def captioned_grid(images: np.ndarray, rows: list[dict[str, Any]], tile: int = 128, columns: int = 4) -> Image.Image:
    """A sheet of ``images`` (uint8 ``(N, H, W, 3)``), each enlarged to ``tile`` pixels high (nearest
    neighbour, so pixels stay crisp) with its ``prompt``, ``refined`` prompt and ``reward`` under it."""
    font = ImageFont.load_default()
    text_h = _CAPTION_LINES * LINE_H
    cols = min(columns, len(images))
    n_rows = (len(images) + cols - 1) // cols
    # Tiles keep the aspect ratio; a video's tile is its frames in a row.
    tile_w = -(-tile * images.shape[2] // images.shape[1])
    sheet = Image.new("RGB", (cols * tile_w, n_rows * (tile + text_h)), "white")
    draw = ImageDraw.Draw(sheet)
    width = max(8, tile // 6)
    for i, (img, row) in enumerate(zip(images, rows, strict=True)):
        x, y = (i % cols) * tile_w, (i // cols) * (tile + text_h)
        piece = Image.fromarray(np.ascontiguousarray(img))
        sheet.paste(piece.resize((tile_w, tile), Image.NEAREST), (x, y))
        lines = [
            textwrap.shorten(row["prompt"], width),
            "-> " + textwrap.shorten(row["refined"] or "(empty)", width - 3),
            f"reward {row['reward']:.2f}",
        ]
        for j, line in enumerate(lines):
            draw.text((x + 2, y + tile + 1 + j * LINE_H), line, fill="black", font=font)
    return sheet


def log_image(trainer: pl.Trainer, tag: str, image: Image.Image, step: int) -> None:
    """Show ``image`` as ``tag`` at ``step`` in every attached logger that shows images: TensorBoard,
    Weights & Biases and MLflow. Other loggers (``CSVLogger``) are skipped: the callers save the PNG anyway."""
    rgb = image.convert("RGB")
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            logger.experiment.add_image(tag, np.asarray(rgb), step, dataformats="HWC")
        elif isinstance(logger, WandbLogger):
            logger.log_image(key=tag, images=[rgb], step=step)
        elif isinstance(logger, MLFlowLogger):
            # An artifact is a file path, so the step goes into the name or each image replaces the last. The
            # artifact_file form, not the newer key/step one, so that the oldest mlflow the extra allows has it.
            logger.experiment.log_image(logger.run_id, rgb, artifact_file=f"{tag}_step{step}.png")


_OWN_FILE = re.compile(r"(grid_\d+_\d{4,}|\d+_\d{4,}_\d{2,})\.(png|webp)")


class ImageWriter(BasePredictionWriter):
    """Save each predicted image as ``<output_dir>/<rank>_<batch>_<i>.png`` plus one JSONL row per image.

    Each ``predict`` run starts by removing what an earlier run wrote there (``predictions.jsonl`` and
    the files named like this writer's own; other files are left alone), so ``predictions.jsonl``
    lists exactly the images next to it. Give each run its own ``output_dir`` to keep earlier results.
    Videos (``(N, F, 3, H, W)``) become animated WebP files.

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

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "predict":
            return
        if trainer.is_global_zero:
            self.clear()
        trainer.strategy.barrier("ImageWriter.clear")

    def clear(self) -> None:
        """Remove ``predictions.jsonl`` and this writer's image files from ``output_dir``."""
        if not self.output_dir.is_dir():
            return
        (self.output_dir / "predictions.jsonl").unlink(missing_ok=True)
        for path in self.output_dir.iterdir():
            if path.is_file() and _OWN_FILE.fullmatch(path.name):
                path.unlink()

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
        images, frames = to_frames(prediction["images"])
        sources = prediction.get("sources") if frames is None else None
        rows = []
        with (self.output_dir / "predictions.jsonl").open("a") as f:
            for i, img in enumerate(images):
                name = f"{trainer.global_rank}_{batch_idx:04d}_{i:02d}." + ("png" if frames is None else "webp")
                if frames is None:
                    Image.fromarray(np.ascontiguousarray(img)).save(self.output_dir / name)
                else:
                    clip = [Image.fromarray(np.ascontiguousarray(frame)) for frame in frames[i]]
                    clip[0].save(self.output_dir / name, save_all=True, append_images=clip[1:], duration=125, loop=0)
                row = {
                    "file": name,
                    "prompt": prediction["prompts"][i],
                    "refined": prediction["refined"][i],
                    "reward": prediction["rewards"][i],
                }
                if sources:  # an edit: which source image the result was made from
                    row["source"] = sources[i].path
                rows.append(row)
                f.write(json.dumps(row) + "\n")
        if self.grid:
            sheet = captioned_grid(beside_sources(images, sources), rows, self.tile, self.columns)
            sheet.save(self.output_dir / f"grid_{trainer.global_rank}_{batch_idx:04d}.png")


class ValidationImages(pl.Callback):
    """At each validation during ``fit``, save a captioned grid of the first validation batch as
    ``<log_dir>/images/val_step<N>.png`` (N = the global step), and show it in TensorBoard, W&B or MLflow
    when such a logger is attached (:func:`log_image`). Rank 0 only; the sanity check is skipped.

    Reads the dict the module's ``validation_step`` returns (``prompts``, ``refined``, ``images``,
    ``rewards``, and an edit's ``sources``, drawn left of each result); a step that returns nothing writes nothing.

    Args:
        max_images: At most this many images of the batch go into the grid.
        tile: Height in pixels of each image in the grid.
        columns: Images per grid row.
    """

    def __init__(self, max_images: int = 16, tile: int = 128, columns: int = 8) -> None:
        if max_images < 1 or tile < 16 or columns < 1:
            raise ValueError(f"need max_images >= 1, tile >= 16 and columns >= 1, got {max_images}, {tile}, {columns}")
        self.max_images, self.tile, self.columns = max_images, tile, columns
        self.folder = Path("images")  # <log_dir>/images, set in setup()
        self.written: list[Path] = []

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Here, on every rank: trainer.log_dir is a collective (a broadcast), never to be read on rank 0 alone.
        self.folder = Path(trainer.log_dir or trainer.default_root_dir) / "images"

    @rank_zero_only
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit" or batch_idx != 0 or dataloader_idx != 0:
            return
        if not isinstance(outputs, dict) or "images" not in outputs or not len(outputs["images"]):
            return
        n = min(self.max_images, len(outputs["images"]))
        images, _ = to_frames(outputs["images"][:n])
        rewards = outputs.get("rewards")
        rewards = rewards.tolist() if isinstance(rewards, torch.Tensor) else list(rewards or [float("nan")] * n)
        rows = [
            {"prompt": p, "refined": r, "reward": float(w)}
            for p, r, w in zip(outputs["prompts"][:n], outputs["refined"][:n], rewards[:n], strict=True)
        ]
        sources = outputs.get("sources")
        sheet = captioned_grid(beside_sources(images, sources[:n] if sources else None), rows, self.tile, self.columns)
        path = self.folder / f"val_step{trainer.global_step}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        sheet.save(path)
        self.written.append(path)
        log_image(trainer, "val/images", sheet, trainer.global_step)
