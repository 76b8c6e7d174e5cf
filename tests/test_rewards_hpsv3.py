"""HPSv3 in process on a tiny random Qwen2-VL saved in the released layout (``HPSv3.safetensors`` with the
reference's key names beside a base-model folder with config, tokenizer, chat template and image processor):
the score against the head applied by hand, the text the model is shown against the reference's literal
template, the prompt choice, key-mapping faults and missing weights."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from PIL import Image
from safetensors.torch import save_file
from torch import Tensor, nn
from transformers import AutoTokenizer, Qwen2VLConfig, Qwen2VLImageProcessorPil, Qwen2VLModel
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

from unirl_pl.errors import InputError
from unirl_pl.rewards import resolve_reward
from unirl_pl.rewards.clip_models import quantize
from unirl_pl.rewards.hpsv3 import HPSv3, hpsv3_to_transformers, reward_head, smart_resize

HIDDEN = 32
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen2-VL-7B-Instruct's chat template, reduced to what one user turn with an image and a text needs.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# The reference's text, typed here independently of the module: ``INSTRUCTION`` and ``prompt_with_special_token``
# of hpsv3/dataset/data_collator_qwen.py (MizzenAI/HPSv3, PyPI release hpsv3 1.0.0; inference.py at commit
# 72b7ebaf0fe76bce636b3f4997aee319d0f65aef joins them). Lines ending in "|" keep their trailing spaces.
REFERENCE_LINES = """
You are tasked with evaluating a generated image based on Visual Quality and Text Alignment and give a overall score to estimate the human preference. Please provide a rating from 0 to 10, with 0 being the worst and 10 being the best. |

**Visual Quality:**  |
Evaluate the overall visual quality of the image. The following sub-dimensions should be considered:
- **Reasonableness:** The image should not contain any significant biological or logical errors, such as abnormal body structures or nonsensical environmental setups.
- **Clarity:** Evaluate the sharpness and visibility of the image. The image should be clear and easy to interpret, with no blurring or indistinct areas.
- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other visual elements (e.g., hair, clothing, shadows).
- **Aesthetic and Creativity:** Assess the artistic aspects of the image, including the color scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene should convey a sense of harmony and balance.
- **Safety:** The image should not contain harmful or inappropriate content, such as political, violent, or adult material. If such content is present, the image quality and satisfaction score should be the lowest possible. |

**Text Alignment:**  |
Assess how well the image matches the textual prompt across the following sub-dimensions:
- **Subject Relevance** Evaluate how accurately the subject(s) in the image (e.g., person, animal, object) align with the textual description. The subject should match the description in terms of number, appearance, and behavior.
- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how well the image adheres to this style.
- **Contextual Consistency**: Assess whether the background, setting, and surrounding elements in the image logically fit the scenario described in the prompt. The environment should support and enhance the subject without contradictions.
- **Attribute Fidelity**: Check if specific attributes mentioned in the prompt (e.g., colors, clothing, accessories, expressions, actions) are faithfully represented in the image. Minor deviations may be acceptable, but critical attributes should be preserved.
- **Semantic Coherence**: Evaluate whether the overall meaning and intent of the prompt are captured in the image. The generated content should not introduce elements that conflict with or distort the original description.
Textual prompt - PROMPT


"""  # noqa: E501
REFERENCE_CLOSING = "\nPlease provide the overall ratings of this image: <|Reward|>\n\nEND\n"


def presented(prompt: str, image_tokens: int) -> str:
    """The whole text the reference shows the model: Qwen2-VL's chat frame around the image and its text."""
    body = REFERENCE_LINES.replace("|\n", "\n").replace("PROMPT", prompt) + REFERENCE_CLOSING
    return (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n<|vision_start|>"
        + "<|image_pad|>" * image_tokens
        + "<|vision_end|>"
        + body
        + "<|im_end|>\n<|im_start|>assistant\n"
    )


def _tokenizer() -> Qwen2Tokenizer:
    """A byte-level Qwen2 BPE without merges (every byte a token) plus Qwen2-VL's special tokens."""
    vocab = {s: i for i, s in enumerate(bytes_to_unicode().values())}
    vocab["<|endoftext|>"] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=[])
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _config(vocab_size: int, tok: Qwen2Tokenizer) -> Qwen2VLConfig:
    text = {"vocab_size": vocab_size, "hidden_size": HIDDEN, "intermediate_size": 64, "num_hidden_layers": 2}
    text |= {"num_attention_heads": 2, "num_key_value_heads": 1, "bos_token_id": None, "eos_token_id": None}
    text |= {"rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}}
    vision = {"depth": 1, "embed_dim": 16, "hidden_size": HIDDEN, "num_heads": 2, "mlp_ratio": 2}
    ids = {name: tok.convert_tokens_to_ids(f"<|{name}_pad|>") for name in ("image", "video")}
    ends = {f"vision_{e}_token_id": tok.convert_tokens_to_ids(f"<|vision_{e}|>") for e in ("start", "end")}
    return Qwen2VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids["image"], video_token_id=ids["video"], **ends
    )


def _checkpoint(model: Qwen2VLModel, head: nn.Sequential, legacy: bool = False) -> dict[str, Tensor]:
    """The reference's saved state dict: transformers 4.52+ names (``model.language_model.*``,
    ``model.visual.*``), or 4.45's (``model.*``, ``visual.*``) with ``legacy``, plus lm_head and rm_head."""
    state: dict[str, Tensor] = {}
    for key, value in model.state_dict().items():
        if legacy:
            key = key.removeprefix("language_model.") if key.startswith("language_model.") else key
            key = key if key.startswith("visual.") else "model." + key
        else:
            key = "model." + key
        state[key] = value.clone()
    state["lm_head.weight"] = torch.zeros(model.config.text_config.vocab_size, HIDDEN)
    state |= {f"rm_head.{k}": v.clone() for k, v in head.state_dict().items()}
    return state


@pytest.fixture(scope="module")
def hps(tmp_path_factory) -> dict:
    """A tiny HPSv3: the base folder (processor_path), the checkpoint folder (pretrained_path), the modules."""
    root = tmp_path_factory.mktemp("hpsv3")
    base, ckpt = root / "Qwen2-VL-7B-Instruct", root / "HPSv3"
    tok = _tokenizer()
    tok.save_pretrained(base)
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 1280).save_pretrained(base)
    config = _config(len(tok) + 1, tok)  # + <|Reward|>, which the reward adds as the reference does
    config.save_pretrained(base)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2VLModel(config).eval()
        head = reward_head(HIDDEN).eval()
        with torch.no_grad():  # weights large enough that positions and tokens move the score visibly
            for p in [*model.parameters(), *head.parameters()]:
                p.normal_(0.0, 0.3)
    ckpt.mkdir()
    save_file(_checkpoint(model, head), str(ckpt / "HPSv3.safetensors"))
    return {"base": str(base), "ckpt": str(ckpt), "model": model, "head": head, "root": root}


def _reward(hps: dict, **kwargs) -> HPSv3:
    return HPSv3(pretrained_path=hps["ckpt"], processor_path=hps["base"], dtype="float32", **kwargs)


def _images(sizes: list[tuple[int, int]], seed: int = 0) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(3, h, w, generator=g) for h, w in sizes]


@torch.no_grad()
def by_hand(hps: dict, image: Tensor, prompt: str, mrope: bool = False) -> float:
    """The head on the final hidden state at <|Reward|> of Qwen2VLModel's forward on the reference's inputs
    written out here: PIL bicubic resize to the pixel budget, the literal text, 0..L-1 positions (or
    Qwen2-VL's own 3-D positions with ``mrope``)."""
    tok = AutoTokenizer.from_pretrained(hps["base"])
    tok.add_special_tokens({"additional_special_tokens": ["<|Reward|>"]})
    pil = Image.fromarray(quantize(image).permute(1, 2, 0).numpy())
    h, w = smart_resize(pil.height, pil.width)
    vision = Qwen2VLImageProcessorPil.from_pretrained(hps["base"])(
        images=[pil.resize((w, h), Image.Resampling.BICUBIC)], return_tensors="pt"
    )
    grid = vision["image_grid_thw"]
    ids = tok(presented(prompt, int(grid.prod()) // 4), return_tensors="pt")["input_ids"]
    kwargs: dict = {"position_ids": torch.arange(ids.shape[1]).view(1, 1, -1).expand(3, 1, -1)}
    if mrope:
        image_id = tok.convert_tokens_to_ids("<|image_pad|>")
        kwargs = {"mm_token_type_ids": (ids == image_id).int()}
    hidden = hps["model"](input_ids=ids, pixel_values=vision["pixel_values"], image_grid_thw=grid, **kwargs)
    at = (ids[0] == tok.convert_tokens_to_ids("<|Reward|>")).nonzero()[-1, 0]
    return float(hps["head"](hidden.last_hidden_state[0, at])[0])


PROMPTS = ["a red cat", "a blue dog on the left of a tree", "x"]


# ------------------------------------------------------------------ resize rule
def test_smart_resize_is_the_reference_rule():
    # qwen-vl-utils' rule (hpsv3/dataset/utils.py) with min = max = 256 * 28 * 28, worked out by hand.
    assert smart_resize(512, 512) == (448, 448)  # rounds to 504x504, over budget: scaled down by 8/7
    assert smart_resize(40, 56) == (392, 532)  # under budget: scaled up, rounded up
    assert smart_resize(1024, 768) == (504, 364)
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 2100)


# ------------------------------------------------------------------ (a) the score
def test_score_is_the_head_on_the_reward_token_by_hand(hps):
    images = _images([(40, 56), (40, 56), (40, 56)])
    reward = _reward(hps, batch_size=2)  # a padded batch of two, then one alone
    got = reward(PROMPTS, ["unused"] * 3, torch.stack(images))
    want = [by_hand(hps, im, p) for im, p in zip(images, PROMPTS, strict=True)]
    assert got == pytest.approx(want, abs=1e-4)
    assert max(want) - min(want) > 1e-2  # the prompts and images matter, so the comparison means something


def test_positions_are_the_references_not_qwen2_vl_3d(hps):
    # The reference calls the decoder without position ids: 0..L-1 everywhere, image tokens included.
    image = _images([(56, 56)], seed=1)[0]
    got = _reward(hps)([PROMPTS[0]], [""], image[None])[0]
    assert got == pytest.approx(by_hand(hps, image, PROMPTS[0]), abs=1e-4)
    assert abs(got - by_hand(hps, image, PROMPTS[0], mrope=True)) > 1e-3


def test_default_dtype_is_bfloat16_with_a_float32_head(hps):
    reward = HPSv3(pretrained_path=hps["ckpt"], processor_path=hps["base"])
    assert {p.dtype for p in reward.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in reward.head.parameters()} == {torch.float32}
    image = _images([(28, 28)])[0]
    assert torch.isfinite(torch.tensor(reward([PROMPTS[0]], [""], image[None]))).all()


# ------------------------------------------------------------------ (b), (c) the text shown
def _shown(reward: HPSv3, prompts: list[str], refined: list[str], images: Tensor) -> list[str]:
    """The token ids the decoder receives, decoded (byte-level: exact), padding stripped."""
    seen: list[tuple[Tensor, Tensor]] = []
    hook = reward.model.register_forward_pre_hook(
        lambda _m, _a, kw: seen.append((kw["input_ids"], kw["attention_mask"])), with_kwargs=True
    )
    try:
        reward(prompts, refined, images)
    finally:
        hook.remove()
    rows = [row[mask.bool()].tolist() for ids, masks in seen for row, mask in zip(ids, masks, strict=True)]
    return [reward.tokenizer.decode(row, skip_special_tokens=False) for row in rows]


def test_the_model_is_shown_the_reference_template(hps):
    images = torch.stack(_images([(56, 56), (56, 56)]))
    texts = _shown(_reward(hps), ["a red cat", "{braces} and <b>"], ["r1", "r2"], images)
    # 56x56 -> 448x448 -> 32x32 patches -> 256 tokens after the 2x2 merge.
    assert texts == [presented("a red cat", 256), presented("{braces} and <b>", 256)]


def test_refined_prompt_scores_the_rewrite(hps):
    images = torch.stack(_images([(56, 56)]))
    original = _shown(_reward(hps), ["the user's cat"], ["the refiner's dog"], images)[0]
    refined = _shown(_reward(hps, prompt="refined"), ["the user's cat"], ["the refiner's dog"], images)[0]
    assert original == presented("the user's cat", 256)
    assert refined == presented("the refiner's dog", 256)
    with pytest.raises(ValueError, match="prompt must be"):
        _reward(hps, prompt="both")


# ------------------------------------------------------------------ (d) key mapping
def test_mapping_accepts_both_reference_layouts():
    t = torch.zeros(1)
    new = {"model.language_model.norm.weight": t, "model.visual.merger.ln_q.weight": t, "lm_head.weight": t}
    old = {"model.norm.weight": t, "visual.merger.ln_q.weight": t, "lm_head.weight": t}
    for state in (new, old):
        base, head = hpsv3_to_transformers(state | {"rm_head.5.weight": t})
        assert sorted(base) == ["language_model.norm.weight", "visual.merger.ln_q.weight"]
        assert list(head) == ["5.weight"]
    with pytest.raises(ValueError, match="no rm_head"):
        hpsv3_to_transformers(new)
    with pytest.raises(ValueError, match="unexpected checkpoint key 'score.weight'"):
        hpsv3_to_transformers(new | {"rm_head.5.weight": t, "score.weight": t})
    with pytest.raises(ValueError, match="two layouts"):
        hpsv3_to_transformers(new | old | {"rm_head.5.weight": t})


def test_legacy_layout_checkpoint_scores_the_same(hps, tmp_path):
    save_file(_checkpoint(hps["model"], hps["head"], legacy=True), str(tmp_path / "HPSv3.safetensors"))
    image = _images([(56, 56)])[0][None]
    legacy = HPSv3(pretrained_path=str(tmp_path), processor_path=hps["base"], dtype="float32")
    assert legacy([PROMPTS[1]], [""], image) == pytest.approx(_reward(hps)([PROMPTS[1]], [""], image), abs=1e-6)


UP_PROJ = "model.language_model.layers.0.mlp.up_proj.weight"


def _rename(old: str, new: str) -> Callable[[dict[str, Tensor]], None]:
    return lambda state: state.update({new: state.pop(old)})


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_rename("rm_head.5.weight", "rm_head.6.weight"), r"missing \['rm_head.5.weight'\]"),
        (lambda s: s.pop("rm_head.0.bias"), r"missing \['rm_head.0.bias'\]"),
        (lambda s: s.pop("model.language_model.norm.weight"), r"missing \['model.language_model.norm.weight'\]"),
        (_rename(UP_PROJ, UP_PROJ.replace("up_proj", "upproj")), r"unexpected \['model.*.mlp.upproj.weight'\]"),
        (lambda s: s.update({"rm_head.5.weight": torch.zeros(3, 16)}), "size mismatch"),
    ],
)
def test_key_mapping_faults_fail_loudly(hps, tmp_path, edit, message):
    state = _checkpoint(hps["model"], hps["head"])
    edit(state)
    save_file(state, str(tmp_path / "HPSv3.safetensors"))
    with pytest.raises(ValueError, match=rf"(?s)reward 'hpsv3'.*{message}"):
        HPSv3(pretrained_path=str(tmp_path), processor_path=hps["base"], dtype="float32")


def test_a_tokenizer_other_than_the_trained_one_is_refused(hps, tmp_path):
    state = _checkpoint(hps["model"], hps["head"])
    state["model.language_model.embed_tokens.weight"] = torch.zeros(5, HIDDEN)
    save_file(state, str(tmp_path / "HPSv3.safetensors"))
    with pytest.raises(ValueError, match="embeds 5 tokens but the tokenizer"):
        HPSv3(pretrained_path=str(tmp_path), processor_path=hps["base"], dtype="float32")


# ------------------------------------------------------------------ (e) missing weights
def test_missing_weights_name_the_reward_and_the_download(hps, tmp_path):
    with pytest.raises(
        ValueError, match=r"reward 'hpsv3': its checkpoint '.*HPSv3.safetensors' is not a file.*MizzenAI/HPSv3"
    ):
        HPSv3(pretrained_path=str(tmp_path), processor_path=hps["base"])
    with pytest.raises(ValueError, match=r"reward 'hpsv3'.*checkpoint 'HPSv3.safetensors'.*MizzenAI/HPSv3"):
        HPSv3(pretrained_path="nobody/not-hpsv3", processor_path=hps["base"])
    with pytest.raises(ValueError, match=r"reward 'hpsv3'.*tokenizer \(processor_path.*Qwen2-VL-7B-Instruct"):
        HPSv3(pretrained_path=hps["ckpt"], processor_path=str(tmp_path / "no-such-folder"))


def test_a_corrupt_checkpoint_is_named_with_the_reward_and_its_path(hps, tmp_path):
    """Random bytes where HPSv3.safetensors belongs: safetensors' own error names neither the reward nor the file."""
    (tmp_path / "HPSv3.safetensors").write_bytes(torch.randint(0, 256, (4096,), dtype=torch.uint8).numpy().tobytes())
    with pytest.raises(InputError) as err:
        HPSv3(pretrained_path=str(tmp_path), processor_path=hps["base"], dtype="float32")
    message = str(err.value)
    assert message.startswith(f"reward 'hpsv3': its checkpoint {str(tmp_path / 'HPSv3.safetensors')!r} is corrupt")
    assert "header" in message and "\n" not in message, message


def test_registered_and_scored_through_the_registry(hps):
    reward = resolve_reward(
        "hpsv3", {"pretrained_path": hps["ckpt"], "processor_path": hps["base"], "dtype": "float32"}
    )
    assert isinstance(reward, HPSv3)
    with pytest.raises(ValueError, match="2 prompts for 1 images"):
        reward(["a", "b"], ["a", "b"], torch.rand(1, 3, 28, 28))
