"""OCR reward: the Flow-GRPO text score on rendered text, and the pieces it is built from."""

import sys
import time

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from unirl_pl.rewards.ocr import OCRReward, edit_distance, ocr_score, quoted_text


def _render(text: str, width: int = 256, height: int = 96) -> torch.Tensor:
    """Big black ``text`` centred on white, as a (3, H, W) float tensor in [0, 1]."""
    image = Image.new("RGB", (width, height), "white")
    if text:
        # Pillow >= 10.1 ships a scalable default TrueType font, so no system font is needed.
        font = ImageFont.load_default(size=56)
        ImageDraw.Draw(image).text((width / 2, height / 2), text, fill="black", font=font, anchor="mm")
    return torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255


def test_edit_distance_and_score():
    assert edit_distance("kitten", "sitting") == 3
    assert edit_distance("", "abc") == edit_distance("abc", "") == 3
    assert quoted_text('a sign that says "HELLO" at night') == "HELLO"
    assert quoted_text("a sign that says \u201cHi There\u201d") == "Hi There"
    assert quoted_text("a cat") is None
    assert ocr_score("hello", "HELLO") == 1.0
    assert ocr_score("Open Now! HELLO world", "hello") == 1.0  # target inside other text
    assert ocr_score("he llo", "HELLO") == 1.0  # spaces are not scored
    assert ocr_score("HELL", "HELLO") == pytest.approx(0.8)
    assert ocr_score("a very long unrelated sentence", "HELLO") == 0.0  # capped, never negative
    assert ocr_score("anything", "") == 0.0


@pytest.mark.slow
def test_ocr_reward_reads_rendered_text():
    from unirl_pl.rewards import resolve_reward

    reward = resolve_reward("ocr", {"num_threads": 1})
    prompt = 'a sign that says "HELLO"'
    images = torch.stack([_render("HELLO"), _render(""), _render("WORLD"), _render("HELLO")])
    start = time.perf_counter()
    hello, blank, world, no_quote = reward([prompt, prompt, prompt, "a plain sign"], [""] * 4, images)
    elapsed = time.perf_counter() - start
    print(f"ocr scores hello={hello:.3f} blank={blank:.3f} world={world:.3f}; {elapsed / 3:.2f}s per image")
    assert hello > 0.9
    assert blank < 0.3
    assert world < hello
    assert no_quote == 0.0  # no quoted text: scored 0 without running OCR


@pytest.mark.slow
def test_ocr_reward_video_averages_frames():
    from unirl_pl.rewards.ocr import OCRReward

    reward = OCRReward(num_threads=1, video_frames=2)
    # Two frames with the text and two blank ones; the 2 evenly spaced frames read are 0 and 3.
    video = torch.stack([_render("HELLO"), _render(""), _render(""), _render("HELLO")]).unsqueeze(0)
    (score,) = reward(['"HELLO"'], [""], video)
    assert score > 0.9
    video = torch.stack([_render("HELLO"), _render("")]).unsqueeze(0)
    (score,) = reward(['"HELLO"'], [""], video)
    assert 0.4 < score < 0.6


def test_missing_package_names_the_extra(monkeypatch):
    from unirl_pl.rewards import resolve_reward

    monkeypatch.setitem(sys.modules, "rapidocr_onnxruntime", None)  # makes the import fail
    with pytest.raises(ImportError, match=r"pip install -e \.\[ocr\]"):
        resolve_reward("ocr")


def test_an_english_recognition_model_reaches_rapidocr(tmp_path, monkeypatch):
    """rec_model_path / rec_keys_path replace the wheel's Chinese+English model in the engine RapidOCR builds."""
    import rapidocr_onnxruntime

    model, keys = tmp_path / "en_PP-OCRv4_rec.onnx", tmp_path / "en_dict.txt"
    model.write_bytes(b"onnx")
    keys.write_text("a\nb\n")
    built: list[dict] = []
    monkeypatch.setattr(rapidocr_onnxruntime, "RapidOCR", lambda **kwargs: built.append(kwargs) or object())
    assert OCRReward(rec_model_path=str(model), rec_keys_path=str(keys)).engine is not None
    assert built[-1]["rec_model_path"] == str(model) and built[-1]["rec_keys_path"] == str(keys)
    assert OCRReward().engine is not None
    assert "rec_model_path" not in built[-1], "the default keeps the wheel's model"
    with pytest.raises(ValueError, match="rec_model_path and rec_keys_path go together"):
        OCRReward(rec_model_path=str(model))
    with pytest.raises(ValueError, match="rec_keys_path .* is not a file"):
        OCRReward(rec_model_path=str(model), rec_keys_path=str(tmp_path / "missing.txt"))
