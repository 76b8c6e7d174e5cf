"""ShapesWorld-Edit prompt files: the JSONL rows an editing run trains and validates on, with their source PNGs.

An editing prompt file (:mod:`unirl_pl.source_images`) names one source image per row, ``{"prompt":
"<instruction>", "image": "<png path relative to the file>", ...}``; every field of the row reaches the rewards
as that sample's metadata, so the ``shapes_edit`` reward rebuilds the edit (``edits.edit_of``) from the very row
the sample was drawn from. :func:`write_edit_files` writes two such files:

* ``edits_train.jsonl``: ``make_edit_set(n_train, seed, "train")``, train compositions in train words;
* ``edits_heldout.jsonl``: ``make_edit_set(n_heldout, seed + 1, "heldout", phrasing="train")``: held-out
  compositions phrased in train words, so the split measures composition transfer and not vocabulary (as
  the text-to-image ``composition`` split does);

and ``sources/<split>_<i:03d>.png``, the rendered source of row ``i``. Placement defaults to ``slots=2``, the
2x2 grid the pretrained DiT knows. The same arguments give the same bytes (the PNGs carry no metadata chunk),
so the files can ship under ``unirl_pl/assets`` with a manifest hash and be regenerated to check them::

    python -m unirl_pl.shapes.edit_files unirl_pl/assets/shapes_edit [--train N] [--heldout N] [--seed S]
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from unirl_pl.shapes.edits import edit_of, make_edit_set, render_source
from unirl_pl.shapes.prompts import write_jsonl

SOURCES_DIR = "sources"
# The file each split is written to, in the order they are written and reported.
EDIT_FILES: dict[str, str] = {"train": "edits_train.jsonl", "heldout": "edits_heldout.jsonl"}
# A source PNG this module writes; only such files are removed as stale, never anything else in the folder.
_SOURCE_NAME = re.compile(r"^(train|heldout)_\d{3,}\.png$")


def write_png(image: np.ndarray, path: str | os.PathLike[str]) -> None:
    """Write an (H, W, 3) uint8 image as an RGB PNG with no ancillary chunks (no time, no text, no dpi).

    Pillow adds none unless asked, and its zlib output is a function of the pixels and the compression level
    alone, so equal images give equal files: the manifest hash of a shipped source then only changes when
    its pixels do.
    """
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"expected an (H, W, 3) uint8 image, got {image.dtype} {image.shape}")
    Image.fromarray(np.ascontiguousarray(image)).convert("RGB").save(path, format="PNG", compress_level=9)


def edit_file_rows(n: int, seed: int, split: str, phrasing: str | None = None, slots: int = 2) -> list[dict[str, Any]]:
    """``make_edit_set``'s rows, each with ``"image": "sources/<split>_<i:03d>.png"`` right after its prompt."""
    rows = make_edit_set(n, seed, split, phrasing=phrasing, slots=slots)
    return [
        {"prompt": row["prompt"], "image": f"{SOURCES_DIR}/{split}_{i:03d}.png", **row} for i, row in enumerate(rows)
    ]


def write_edit_files(
    out_dir: str | os.PathLike[str], n_train: int = 200, n_heldout: int = 100, seed: int = 0, slots: int = 2
) -> dict[str, int]:
    """Write ``edits_train.jsonl``, ``edits_heldout.jsonl`` and their source PNGs into ``out_dir``.

    Returns ``{file name: rows written}``. Each PNG is rendered from the row as a reader parses it back (a
    JSON round trip through ``edit_of``), so the image a run conditions on is exactly the source the reward
    rebuilds from that row's metadata. Source PNGs of an earlier, larger write are removed: a shipped folder
    must hold only what its manifest lists, and a stale ``train_250.png`` would be an unlisted file.
    """
    out = Path(out_dir)
    sources = out / SOURCES_DIR
    sources.mkdir(parents=True, exist_ok=True)
    splits = {
        "train": edit_file_rows(n_train, seed, "train", slots=slots),
        "heldout": edit_file_rows(n_heldout, seed + 1, "heldout", phrasing="train", slots=slots),
    }
    written: dict[str, int] = {}
    wanted: set[str] = set()
    for split, rows in splits.items():
        for row in rows:
            write_png(render_source(edit_of(json.loads(json.dumps(row)))), out / row["image"])
            wanted.add(Path(row["image"]).name)
        write_jsonl(rows, out / EDIT_FILES[split])
        written[EDIT_FILES[split]] = len(rows)
    for stale in sources.iterdir():
        if _SOURCE_NAME.match(stale.name) and stale.name not in wanted:
            stale.unlink()
    return written


def main(argv: list[str] | None = None) -> int:
    """``python -m unirl_pl.shapes.edit_files OUT_DIR``: write the files and say what was written."""
    cli = argparse.ArgumentParser(prog="python -m unirl_pl.shapes.edit_files", description=__doc__.splitlines()[0])
    cli.add_argument("out_dir", help="folder to write into (the shipped one is unirl_pl/assets/shapes_edit)")
    cli.add_argument("--train", type=int, default=200, help="rows of edits_train.jsonl (default 200)")
    cli.add_argument("--heldout", type=int, default=100, help="rows of edits_heldout.jsonl (default 100)")
    cli.add_argument("--seed", type=int, default=0, help="seed of the train rows; held-out rows use seed + 1")
    args = cli.parse_args(argv)
    written = write_edit_files(args.out_dir, args.train, args.heldout, args.seed)
    for name, n in written.items():
        print(f"{Path(args.out_dir) / name}: {n} rows, {n} source images under {Path(args.out_dir) / SOURCES_DIR}")
    if Path(args.out_dir).resolve().is_relative_to(Path(__file__).resolve().parents[1] / "assets"):
        print("shipped assets changed: rewrite their manifest with python -m unirl_pl.manifest --write")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
