"""Editing prompt files: each bad source image refused in one line naming the file, the line and the reason before
anything trains; good images read once, kept with their row through shuffling, sharding and evaluation."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from unirl_pl.data import PromptDataModule, _FixedPrompts, _PromptStream
from unirl_pl.errors import InputError
from unirl_pl.layout import GroupLayout
from unirl_pl.source_images import check_edit_setup, load_sources, read_source_image


def _png(path: Path, color: tuple[int, int, int], size: tuple[int, int] = (8, 6), mode: str = "RGB") -> Path:
    image = Image.new("RGB", size, color)
    (image if mode == "RGB" else image.convert(mode)).save(path)
    return path


def _rows(folder: Path, rows: list[dict], name: str = "edits.jsonl") -> str:
    path = folder / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _bomb(path: Path, side: int) -> Path:
    """A valid PNG header claiming ``side`` x ``side`` greyscale pixels over a few hundred bytes of zeros."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    body = zlib.compress(b"\0" * (side + 1) * 4)  # a few rows only: nothing but the header is read
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", body) + chunk(b"IEND", b""))
    return path


def test_rows_keep_their_images_read_once(tmp_path: Path) -> None:
    _png(tmp_path / "red.png", (255, 0, 0))
    (tmp_path / "sub").mkdir()
    _png(tmp_path / "sub" / "grey.png", (90, 90, 90), mode="L")
    rows = [
        {"prompt": "make it blue", "image": "red.png"},
        {"prompt": "add a dog", "image": "sub/grey.png"},
        {"prompt": "make it green", "image": "red.png"},
    ]
    dm = PromptDataModule(prompts=_rows(tmp_path, rows), val_prompts=_rows(tmp_path, rows[:2], "val.jsonl"))
    sources = dm.train_sources
    assert sources is not None and dm.edits
    assert sources[0] is sources[2], "a file two rows name is read once"
    assert sources[0].pixels.shape == (3, 6, 8) and sources[0].pixels.dtype == torch.float32
    assert torch.allclose(sources[0].pixels[:, 0, 0], torch.tensor([1.0, 0.0, 0.0]))
    assert torch.allclose(sources[1].pixels[:, 0, 0], torch.full((3,), 90 / 255)), "greyscale read as RGB"
    assert sources[0].digest != sources[1].digest
    # Shuffled and sharded streams pick the image by the same item as the prompt.
    by_prompt = {row["prompt"]: row["image"] for row in rows}
    layout = GroupLayout(2, 0, 1)
    for rank in range(2):
        stream = iter(_PromptStream(dm.train_prompts, 2, 7, rank, 2, 0, layout, dm.train_metadata, sources))
        for _ in range(3):
            batch = next(stream)
            assert batch.sources is not None
            for prompt, source in zip(batch.prompts, batch.sources, strict=True):
                assert source.path.endswith(by_prompt[prompt])
    shard = _FixedPrompts(dm.train_prompts, 2, 1, 2, 0, dm.train_metadata, sources)[0]
    assert shard.prompts == ["add a dog", "add a dog"] and shard.real == 1, "rank 1's shard, padded with its own"
    assert shard.real_sources is not None and [s.path for s in shard.real_sources] == [sources[1].path]
    val = dm.val_dataloader().dataset[0]
    assert [s.path for s in val.sources] == [sources[0].path, sources[1].path]


def test_text_prompt_files_have_no_sources(tmp_path: Path) -> None:
    dm = PromptDataModule(prompts=_rows(tmp_path, [{"prompt": "a cat", "tag": "single"}]))
    assert dm.train_sources is None and not dm.edits and dm.val_sources is None


def _refusal(tmp_path: Path, name: str, make: object = None, max_pixels: int = 4096 * 4096, **row: object) -> str:
    rows = [{"prompt": "ok", "image": "good.png"}, {"prompt": "edit", "image": name, **row}]
    _png(tmp_path / "good.png", (0, 0, 255))
    source = _rows(tmp_path, rows)
    with pytest.raises(InputError) as err:
        PromptDataModule(prompts=source, max_image_pixels=max_pixels)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{source}:2: "), message
    return message


def test_each_bad_image_is_refused_with_file_line_and_reason(tmp_path: Path) -> None:
    assert "does not exist" in _refusal(tmp_path, "missing.png")
    (tmp_path / "notes.png").write_text("not an image at all")
    assert "not an image" in _refusal(tmp_path, "notes.png")
    _png(tmp_path / "big.png", (1, 2, 3), size=(64, 64))
    Image.new("CMYK", (4, 4)).save(tmp_path / "cmyk.jpg")
    assert "mode 'CMYK'" in _refusal(tmp_path, "cmyk.jpg")
    _png(tmp_path / "alpha.png", (5, 5, 5), mode="RGBA")
    assert "mode 'RGBA'" in _refusal(tmp_path, "alpha.png")
    assert "over data.max_image_pixels=4000" in _refusal(tmp_path, "big.png", max_pixels=4000)
    _bomb(tmp_path / "bomb.png", 60_000)  # past Pillow's own limit: refused as it opens
    assert "decompression bomb (its header" in _refusal(tmp_path, "bomb.png", max_pixels=10**10)
    _bomb(tmp_path / "small_bomb.png", 8_000)  # under Pillow's limit, but 64M pixels from a ~100-byte file
    assert "decompression bomb: its" in _refusal(tmp_path, "small_bomb.png", max_pixels=10**10)
    assert "needs a string field 'image'" in _refusal(tmp_path, "x.png", image=None)
    assert "needs a string field 'image'" in _refusal(tmp_path, "x.png", image=3)


def test_truncated_image_is_refused_as_corrupt(tmp_path: Path) -> None:
    """Pillow reads a truncated PNG's header and fails only when it decodes the pixels."""
    data = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    Image.fromarray(data).save(tmp_path / "noisy.png")
    raw = (tmp_path / "noisy.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(InputError, match=r"x\.jsonl:3: source image .*cut\.png' is corrupt"):
        read_source_image(tmp_path / "cut.png", "x.jsonl:3", 4096)


def test_rows_without_an_image_in_an_editing_file_are_refused(tmp_path: Path) -> None:
    _png(tmp_path / "a.png", (0, 0, 0))
    source = _rows(tmp_path, [{"prompt": "x", "image": "a.png"}, {"prompt": "y"}])
    with pytest.raises(InputError, match=r":2: every row of an editing prompt file needs a string field 'image'"):
        load_sources(source, [{"prompt": "x", "image": "a.png"}, None], 100)


def test_blank_lines_do_not_shift_the_line_numbers(tmp_path: Path) -> None:
    _png(tmp_path / "a.png", (0, 0, 0))
    path = tmp_path / "gaps.jsonl"
    path.write_text('{"prompt": "x", "image": "a.png"}\n\n\n{"prompt": "y", "image": "gone.png"}\n')
    with pytest.raises(InputError, match=r"gaps\.jsonl:4: source image .*gone\.png' does not exist"):
        PromptDataModule(prompts=str(path))


def test_an_editing_file_for_a_text_to_image_generator_is_refused(tmp_path: Path) -> None:
    class TextOnly:
        takes_source_images = False

    class Edits:
        takes_source_images = True

    _png(tmp_path / "a.png", (0, 0, 0))
    dm = PromptDataModule(prompts=_rows(tmp_path, [{"prompt": "x", "image": "a.png"}]))
    with pytest.raises(ValueError, match=r"hold source images .* but model.generator \(TextOnly\) generates from text"):
        check_edit_setup(dm, TextOnly())
    check_edit_setup(dm, Edits())
    check_edit_setup(PromptDataModule(), TextOnly())


def test_a_vlm_refiner_that_does_not_see_the_sources_is_warned_about(tmp_path: Path) -> None:
    class Edits:
        takes_source_images = True

    class Refiner:
        def __init__(self, sees: bool) -> None:
            self.sees_images = sees

    _png(tmp_path / "a.png", (0, 0, 0))
    dm = PromptDataModule(prompts=_rows(tmp_path, [{"prompt": "x", "image": "a.png"}]))
    with pytest.warns(UserWarning, match="load_image_processor: true"):
        check_edit_setup(dm, Edits(), Refiner(False))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_edit_setup(dm, Edits(), Refiner(True))
        check_edit_setup(PromptDataModule(), Edits(), Refiner(False))


def test_grids_show_each_result_beside_its_source(tmp_path: Path) -> None:
    from unirl_pl.callbacks.writer import beside_sources

    _png(tmp_path / "red.png", (255, 0, 0), size=(4, 2))
    source = read_source_image(tmp_path / "red.png", "x:1", 100)
    results = np.zeros((1, 6, 6, 3), dtype=np.uint8)
    pair = beside_sources(results, [source])
    assert pair.shape == (1, 6, 12, 3), "the source, resized to the result, on its left"
    assert (pair[0, :, :6] == [255, 0, 0]).all() and (pair[0, :, 6:] == 0).all()
    assert beside_sources(results, None) is results
