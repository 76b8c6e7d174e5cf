"""The VLM refiner sees the source image (editing): a tiny Qwen2.5-VL (and Qwen3-VL) asked with an image per row
decodes as the model's own ``generate`` does, re-scores its tokens exactly (C2), keeps each row's image with it
through ``slice``/``take``, and expands the image placeholder as the processor would."""

from __future__ import annotations

# The hub reads HF_HUB_OFFLINE at import time, so it is set before the imports below.
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from tests.vlm_lm import make_vlm
from unirl_pl.experts import TinyCausalLMExpert, VLMRefinerExpert
from unirl_pl.experts.chat import GENEVAL_INSTRUCTION, ChatFormat, format_requests
from unirl_pl.experts.vlm import source_image_pil
from unirl_pl.loops import ARDecode
from unirl_pl.loops.config import RolloutConfig
from unirl_pl.records import LMRecord

CHAT = ChatFormat(instruction=GENEVAL_INSTRUCTION, answer_tag="answer")
PROMPTS = ["red circle", "two blue squares on the left of a big green cube", "a small yellow star"]
PROMPTRL_PIXELS = 200704  # G-U-N/UniRL edit trainer: the processor's min_pixels = max_pixels


def _image(seed: int, height: int, width: int) -> tuple[np.ndarray, torch.Tensor]:
    """An 8-bit RGB image (H, W, 3) and its (3, H, W) float32 tensor in [0, 1], as a source image file gives."""
    levels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return levels, torch.from_numpy(levels).permute(2, 0, 1).float() / 255.0


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {family: make_vlm(family, tmp_path_factory.mktemp(family)) for family in ("qwen2_5_vl", "qwen3_vl")}


@pytest.fixture(scope="module")
def expert(folders: dict[str, str]) -> VLMRefinerExpert:
    built = VLMRefinerExpert(pretrained_path=folders["qwen2_5_vl"], chat=CHAT, load_image_processor=True)
    built.build()
    return built


def _loop(expert: Any, max_new_tokens: int = 8, **config: Any) -> ARDecode:
    return ARDecode(expert, RolloutConfig(max_new_tokens=max_new_tokens, temperature=1.0, **config))


def _image_pad(expert: VLMRefinerExpert) -> int:
    return int(expert.tokenizer.convert_tokens_to_ids("<|image_pad|>"))


# ---------------------------------------------------------------- the request and the processor


def test_the_request_is_the_templates_image_turn_expanded_as_the_processor_does(folders, expert) -> None:
    _, small = _image(0, 56, 84)
    enc = expert.tokenize_requests(PROMPTS[:2], images=[small, None])
    tokenizer = expert.tokenizer
    # The image row: the chat template's rendering of an image item before the instruction, its placeholder
    # repeated prod(grid) / merge**2 times (56 x 84 -> a 4 x 6 patch grid -> 6 tokens).
    grid = enc["image_grid_thw"][0]
    assert grid.tolist() == [1, 4, 6]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": GENEVAL_INSTRUCTION}]}]
    messages[0]["content"][1]["text"] = GENEVAL_INSTRUCTION.replace("{prompt}", PROMPTS[0])
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Please provide" in rendered
    expected = rendered.replace("<|image_pad|>", "<|image_pad|>" * 6)
    row = enc["input_ids"][0][enc["attention_mask"][0].bool()]
    assert row.tolist() == tokenizer(expected, add_special_tokens=False)["input_ids"]
    assert int((row == _image_pad(expert)).sum()) == int(grid.prod()) // expert.image_processor.merge_size**2 == 6
    # The row without an image is exactly its text-only request.
    text_only = tokenizer(format_requests(tokenizer, [PROMPTS[1]], CHAT), add_special_tokens=False)["input_ids"][0]
    assert enc["input_ids"][1][enc["attention_mask"][1].bool()].tolist() == text_only
    assert enc["pixel_values"][1] is None and enc["image_grid_thw"][1] is None


def test_pixels_are_the_processors_own_and_the_pixel_bounds_set_the_grid(folders) -> None:
    folder = folders["qwen2_5_vl"]
    bounded = VLMRefinerExpert(
        pretrained_path=folder,
        chat=CHAT,
        load_image_processor=True,
        image_min_pixels=PROMPTRL_PIXELS,
        image_max_pixels=PROMPTRL_PIXELS,
    )
    bounded.build()
    processor = AutoImageProcessor.from_pretrained(folder, min_pixels=PROMPTRL_PIXELS, max_pixels=PROMPTRL_PIXELS)
    square, square_t = _image(1, 448, 448)
    wide, wide_t = _image(2, 300, 600)
    # Exactly what the processor gives for the image file's 8-bit pixels.
    for levels, tensor in ((square, square_t), (wide, wide_t)):
        ours, grid = bounded.prepare_image(tensor)
        theirs = processor(images=[Image.fromarray(levels)], return_tensors="pt")
        assert torch.equal(ours, theirs["pixel_values"]) and torch.equal(grid, theirs["image_grid_thw"][0])
    assert np.array_equal(np.asarray(source_image_pil(wide_t)), wide)
    # 200704 = 448^2 = (16 * 28)^2: a 448 x 448 image is a 32 x 32 grid of 14-pixel patches, 16 x 16 = 256 tokens.
    enc = bounded.tokenize_requests(["red circle", "red circle"], images=[square_t, wide_t])
    assert [g.tolist() for g in enc["image_grid_thw"]][0] == [1, 32, 32]
    height, width = smart_resize(300, 600, factor=28, min_pixels=PROMPTRL_PIXELS, max_pixels=PROMPTRL_PIXELS)
    assert enc["image_grid_thw"][1].tolist() == [1, height // 14, width // 14] == [1, 24, 46]
    counts = (enc["input_ids"] == _image_pad(bounded)).sum(1).tolist()
    assert counts == [256, 24 * 46 // 4]
    # The checkpoint's own bounds (max 64 tokens) cap the same 448 x 448 image at a 16 x 16 grid.
    plain = VLMRefinerExpert(pretrained_path=folder, chat=CHAT, load_image_processor=True)
    plain.build()
    assert plain.prepare_image(square_t)[1].tolist() == [1, 16, 16]


# ---------------------------------------------------------------- decode and re-score


def test_greedy_decode_matches_the_models_own_generate(expert) -> None:
    # Multimodal positions in the prefill, last position + 1 in the cached steps (the model's rope_deltas), with
    # the left padding of a batch that mixes image sizes and a text-only row.
    (_, a), (_, b) = _image(3, 56, 56), _image(4, 84, 112)
    images = [a, None, b]
    texts, record = _loop(expert).sample(PROMPTS, [0, 1, 2], [0, 0, 0], "serve", seed=0, images=images)
    assert int((record.attention_mask[:, : record.prompt_len] == 0).sum()) > 0
    enc = expert.tokenize_requests(PROMPTS, images=images)
    vision = record.vision_inputs()
    assert vision is not None
    model = expert.model.get_base_model()  # LoRA B is zero at build: the same policy
    out = model.generate(
        input_ids=enc["input_ids"],
        attention_mask=enc["attention_mask"],
        pixel_values=vision[0],
        image_grid_thw=vision[1],
        mm_token_type_ids=(enc["input_ids"] == _image_pad(expert)).int(),
        do_sample=False,
        max_new_tokens=8,
        eos_token_id=expert.stop_token_ids,
        pad_token_id=expert.pad_token_id,
        output_logits=True,
        return_dict_in_generate=True,
    )
    generated = out.sequences[:, record.prompt_len :]
    assert generated.shape == record.gen_ids.shape
    live = record.gen_mask
    assert torch.equal(generated[live], record.gen_ids[live])
    logp = torch.stack(out.logits, 1).float().log_softmax(-1).gather(-1, generated[..., None])[..., 0]
    assert float((logp - record.old_logp)[live].abs().max()) <= 1e-5


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_c2_with_images_of_different_sizes_and_a_text_only_row(folders, expert, family) -> None:
    if family == "qwen2_5_vl":
        refiner = expert
    else:
        refiner = VLMRefinerExpert(pretrained_path=folders[family], chat=CHAT, load_image_processor=True)
        refiner.build()
    (_, a), (_, b) = _image(5, 56, 56), _image(6, 84, 140)
    prompts = [*PROMPTS, PROMPTS[0]]
    images = [a, None, b, a]  # the last row shares the first row's image object, as a prompt's samples do
    for chunk in (8, 2):
        loop = _loop(refiner, lm_micro_batch_size=chunk)
        _, record = loop.sample(prompts, [0, 1, 2, 0], [0, 0, 0, 1], "rollout", seed=1, images=images)
        assert record.has_images and record.pixel_values[0] is record.pixel_values[3]
        assert record.image_grid_thw[1] is None
        with torch.no_grad():
            rescored = loop.score(record)
        assert bool(record.gen_mask.any())
        assert float((rescored - record.old_logp).abs().max()) <= 1e-5
    # The training re-score (with grad: the requests' KV cache is part of the graph) gives the same log-probs and
    # the gradient of one teacher-forced forward over the whole sequence (positions continued past the request).
    # A sampled <|image_pad|> would be an image slot to the one forward: take a seed that samples none (the tiny
    # model's vocabulary is small enough that some seeds do).
    for seed in range(2, 12):
        _, record = _loop(refiner).sample(prompts, [0, 1, 2, 0], [0, 0, 0, 1], "rollout", seed=seed, images=images)
        if not bool((record.gen_ids == _image_pad(refiner)).any()):
            break
    assert not bool((record.gen_ids == _image_pad(refiner)).any())
    with torch.enable_grad():
        scored = _loop(refiner).score(record)
        assert float((scored.detach() - record.old_logp).abs().max()) <= 1e-5
        scored.sum().backward()
    lora = {name: p for name, p in refiner.named_parameters() if "lora_B" in name}
    ours = {name: p.grad.clone() for name, p in lora.items()}
    refiner.zero_grad(set_to_none=True)
    p, vision = record.prompt_len, record.vision_inputs()
    assert vision is not None
    head = refiner.rope_positions(record.input_ids[:, :p], record.attention_mask[:, :p], vision[1])
    steps = torch.arange(1, record.gen_ids.shape[1] + 1)
    with torch.enable_grad():
        logits = refiner(
            input_ids=record.input_ids,
            attention_mask=record.attention_mask,
            position_ids=torch.cat([head, head[..., -1:] + steps], dim=-1),
            pixel_values=vision[0],
            image_grid_thw=vision[1],
        ).logits[:, p - 1 : -1]
        one = logits.float().log_softmax(-1).gather(-1, record.gen_ids[..., None])[..., 0]
        torch.where(record.gen_mask, one, torch.zeros_like(one)).sum().backward()
    assert any(float(g.abs().max()) > 0 for g in ours.values())
    for name, param in lora.items():
        assert torch.allclose(ours[name], param.grad, atol=1e-5, rtol=1e-4), name
    refiner.zero_grad(set_to_none=True)


def test_a_generated_image_placeholder_is_text_in_the_rescore(expert, monkeypatch) -> None:
    # A sampled <|image_pad|> is not an image slot: fed as a token in decode, it must be one in the re-score too
    # (in one forward with the pixels the model would count it as an image slot and refuse).
    pad_id, forward = _image_pad(expert), expert.forward

    def favour_image_pad(*args: Any, **kwargs: Any) -> Any:
        out = forward(*args, **kwargs)
        out.logits[..., pad_id] += 6.0
        return out

    monkeypatch.setattr(expert, "forward", favour_image_pad)
    _, a = _image(7, 56, 56)
    loop = _loop(expert, max_new_tokens=6)
    _, record = loop.sample(PROMPTS[:2], [0, 1], [0, 0], "rollout", seed=2, images=[a, a])
    assert int((record.gen_ids[record.gen_mask] == pad_id).sum()) >= 2
    with torch.no_grad():
        assert float((loop.score(record) - record.old_logp).abs().max()) <= 1e-5
        vision = record.vision_inputs()
        assert vision is not None
        with pytest.raises(ValueError, match="Image features and image tokens do not match"):
            expert.model(
                input_ids=record.input_ids,
                attention_mask=record.attention_mask,
                pixel_values=vision[0],
                image_grid_thw=vision[1],
            )


def test_the_refiners_logprobs_depend_on_the_image(expert) -> None:
    (_, a), (_, b) = _image(8, 56, 56), _image(9, 56, 56)
    loop = _loop(expert)
    _, record = loop.sample(PROMPTS[:1], [0], [0], "rollout", seed=3, images=[a])
    swapped = LMRecord(**{**record.__dict__, "pixel_values": [expert.prepare_image(b)[0]]})
    with torch.no_grad():
        same, other = loop.score(record), loop.score(swapped)
    live = record.gen_mask
    assert float((same - record.old_logp).abs().max()) <= 1e-5
    assert float((other - same)[live].abs().max()) > 1e-3


def test_a_row_decodes_the_same_alone_and_in_a_batch_with_other_images(expert) -> None:
    (_, a), (_, b), (_, c) = _image(10, 56, 56), _image(11, 84, 112), _image(12, 112, 56)
    loop = _loop(expert)
    _, alone = loop.sample([PROMPTS[0]], [5], [1], "rollout", seed=4, images=[a])
    _, batch = loop.sample(
        [PROMPTS[1], PROMPTS[0], PROMPTS[2]], [3, 5, 7], [0, 1, 0], "rollout", seed=4, images=[b, a, c]
    )
    t = alone.gen_ids.shape[1]
    assert torch.equal(batch.gen_mask[1, :t], alone.gen_mask[0]) and not bool(batch.gen_mask[1, t:].any())
    assert torch.equal(batch.gen_ids[1, :t][alone.gen_mask[0]], alone.gen_ids[0][alone.gen_mask[0]])
    assert float((batch.old_logp[1, :t] - alone.old_logp[0]).abs().max()) <= 1e-5
    assert torch.equal(batch.pixel_values[1], alone.pixel_values[0])


def test_slice_and_take_keep_each_rows_image(expert) -> None:
    (_, a), (_, b) = _image(13, 56, 56), _image(14, 84, 56)
    loop = _loop(expert)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[0]]
    _, record = loop.sample(prompts, [0, 1, 2, 3], [0, 0, 0, 0], "rollout", seed=5, images=[a, None, b, b])
    with torch.no_grad():
        whole = loop.score(record)
        index = torch.tensor([3, 0, 1])
        taken = record.take(index)
        assert [g is None for g in taken.image_grid_thw] == [False, False, True]
        assert taken.pixel_values[0] is record.pixel_values[3] and taken.pixel_values[1] is record.pixel_values[0]
        assert torch.allclose(loop.score(taken), whole[index], atol=1e-5, rtol=0)
        part = record.slice(1, 3)
        assert part.image_grid_thw[0] is None and part.pixel_values[1] is record.pixel_values[2]
        assert torch.allclose(loop.score(part), whole[1:3], atol=1e-5, rtol=0)
        text_only = record.slice(1, 2)  # a micro-batch with no image runs the text-only forward
        assert not text_only.has_images and text_only.vision_inputs() is None
        assert torch.allclose(loop.score(text_only), whole[1:2], atol=1e-5, rtol=0)


def test_rows_without_images_decode_as_before(expert) -> None:
    loop = _loop(expert)
    _, plain = loop.sample(PROMPTS[:2], [0, 1], [0, 0], "rollout", seed=6)
    _, nones = loop.sample(PROMPTS[:2], [0, 1], [0, 0], "rollout", seed=6, images=[None, None])
    assert torch.equal(plain.input_ids, nones.input_ids) and torch.equal(plain.old_logp, nones.old_logp)
    assert plain.pixel_values == [] and nones.pixel_values == [] and not nones.has_images


# ---------------------------------------------------------------- refusals


def _one_line(excinfo: pytest.ExceptionInfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def test_refusals_name_the_setting(folders, expert) -> None:
    _, a = _image(15, 56, 56)
    text_refiner = TinyCausalLMExpert(chat=None)
    text_refiner.build()
    with pytest.raises(ValueError, match="VLMRefinerExpert with load_image_processor: true") as excinfo:
        _loop(text_refiner).sample(["red circle"], [0], [0], "rollout", seed=0, images=[a])
    _one_line(excinfo)
    blind = VLMRefinerExpert(pretrained_path=folders["qwen2_5_vl"], chat=CHAT)
    blind.build()
    with pytest.raises(ValueError, match="load_image_processor is false") as excinfo:
        _loop(blind).sample(["red circle"], [0], [0], "rollout", seed=0, images=[a])
    _one_line(excinfo)
    with pytest.raises(ValueError, match="set load_image_processor: true") as excinfo:
        blind.tokenize_requests(["red circle"], images=[a])
    _one_line(excinfo)
    with pytest.raises(ValueError, match="2 source images for 1 prompts"):
        _loop(expert).sample(["red circle"], [0], [0], "rollout", seed=0, images=[a, a])
    with pytest.raises(ValueError, match=r"float \(3, H, W\) tensor in \[0, 1\], got \(56, 56, 3\)"):
        expert.tokenize_requests(["red circle"], images=[a.permute(1, 2, 0)])
    with pytest.raises(ValueError, match=r"values in \[0, 1\]"):
        expert.tokenize_requests(["red circle"], images=[a * 255])
    bare = VLMRefinerExpert(pretrained_path=folders["qwen2_5_vl"], load_image_processor=True)
    bare.build()
    with pytest.raises(ValueError, match="chat.use_chat_template: true"):
        bare.tokenize_requests(["red circle"], images=[a])


def test_pixel_bound_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="image_max_pixels bounds .* set load_image_processor: true") as excinfo:
        VLMRefinerExpert(pretrained_path="unused", image_max_pixels=PROMPTRL_PIXELS)
    _one_line(excinfo)
    with pytest.raises(ValueError, match="image_min_pixels must be a positive integer"):
        VLMRefinerExpert(pretrained_path="unused", load_image_processor=True, image_min_pixels=0)
    with pytest.raises(ValueError, match="image_max_pixels must be a positive integer"):
        VLMRefinerExpert(pretrained_path="unused", load_image_processor=True, image_max_pixels=True)
    with pytest.raises(ValueError, match=r"image_min_pixels \(401408\) exceeds image_max_pixels \(200704\)"):
        VLMRefinerExpert(
            pretrained_path="unused", load_image_processor=True, image_min_pixels=401408, image_max_pixels=200704
        )
