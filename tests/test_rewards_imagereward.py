"""ImageReward in process on a tiny BLIP saved in the released checkpoint's layout (``blip.visual_encoder.*``,
``blip.text_encoder.*``, ``mlp.layers.*``) with a BERT vocab.txt, loaded from disk as a user would: the
conversion keeps every tensor, the score equals the reference's forward written out from the original tensors
and the transformers modules by hand, the prompt choice, the reference's preprocessing and constants, and clear
errors for missing weights.

Reference: THUDM/ImageReward at c1392c6dd0fd6ecd6d416c96959ab744a6d0a8fb (ImageReward/ImageReward.py,
ImageReward/models/BLIP/{blip,vit,med}.py, train/src/config/med_config.json).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor, nn
from transformers import BertTokenizer, BlipConfig, BlipTextModel, BlipVisionModel

from unirl_pl.rewards import WeightedSum, resolve_reward
from unirl_pl.rewards.builtin import registered_rewards
from unirl_pl.rewards.clip_models import AestheticMLP
from unirl_pl.rewards.imagereward import (
    _VISION_BLOCK,
    _VISION_TOP,
    IGNORED_KEYS,
    IMAGE_MEAN,
    IMAGE_SIZE,
    IMAGE_STD,
    MAX_LENGTH,
    REWARD_MEAN,
    REWARD_STD,
    ImageReward,
    imagereward_blip_config,
    imagereward_to_transformers,
)

SIZE, PATCH, V_WIDTH, T_WIDTH, LAYERS, HEADS = 32, 8, 48, 32, 2, 2
WORDS = ["a", "red", "blue", "green", "cat", "dog", "photo", "of", "on", "the", "left", "big", "small", "square"]
LETTERS = "abcdefghijklmnopqrstuvwxyz"
# Every letter alone and as a continuation: any lowercase word tokenizes without [UNK].
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *LETTERS[1:], *(f"##{c}" for c in LETTERS)]
PROMPTS = ["a red cat", "a blue dog on the left of a big green square", "a photo of a cat", "Small Square", "dog"]
# 3 + 6 * 9 word pieces: cut at 35 tokens, so the reference's max_length shows in the score.
LONG = "a photo of" + " xylophone" * 6
# ImageReward.py (c1392c6), ImageReward.__init__: self.mean, self.std; _transform's Normalize.
REFERENCE_MEAN, REFERENCE_STD = 0.16717362830052426, 1.0333394966054072
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


def _config() -> BlipConfig:
    vision = {"hidden_size": V_WIDTH, "intermediate_size": 2 * V_WIDTH, "num_hidden_layers": LAYERS}
    vision |= {"num_attention_heads": HEADS, "image_size": SIZE, "patch_size": PATCH, "layer_norm_eps": 1e-6}
    text = {"vocab_size": len(VOCAB) + 2, "hidden_size": T_WIDTH, "encoder_hidden_size": V_WIDTH}  # + [DEC], [ENC]
    text |= {"intermediate_size": 2 * T_WIDTH, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS}
    text |= {"max_position_embeddings": 40, "layer_norm_eps": 1e-12, "is_decoder": True}
    # bert-base-uncased's [DEC] (BLIP's bos) and [SEP] in the tiny vocabulary.
    text |= {"pad_token_id": 0, "bos_token_id": len(VOCAB), "sep_token_id": 3, "eos_token_id": 3}
    return BlipConfig(text_config=text, vision_config=vision)


def _randomize(module: nn.Module) -> None:
    """Every tensor random, LayerNorm scales around 1: a swapped or dropped tensor then changes the score
    (the default init leaves the ViT's weights near 1e-10 and every LayerNorm alike)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if "norm" in name.lower() and name.endswith("weight") else 0.0))


def _to_original(vision: dict[str, Tensor], text: dict[str, Tensor], mlp: dict[str, Tensor]) -> dict[str, Tensor]:
    """The inverse of the conversion, written from the reference's module names (vit.py, med.py, ImageReward.py)."""
    top = {"embeddings.class_embedding": "cls_token", "embeddings.position_embedding": "pos_embed"}
    top |= {"embeddings.patch_embedding.weight": "patch_embed.proj.weight", "post_layernorm.weight": "norm.weight"}
    top |= {"embeddings.patch_embedding.bias": "patch_embed.proj.bias", "post_layernorm.bias": "norm.bias"}
    block = {"layer_norm1": "norm1", "layer_norm2": "norm2", "self_attn.qkv": "attn.qkv"}
    block |= {"self_attn.projection": "attn.proj", "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}
    out = {}
    for key, t in vision.items():
        found = re.fullmatch(r"encoder\.layers\.(\d+)\.(.+)\.(weight|bias)", key)
        name = top[key] if found is None else f"blocks.{found[1]}.{block[found[2]]}.{found[3]}"
        out[f"blip.visual_encoder.{name}"] = t
    out |= {f"blip.text_encoder.{k}": t for k, t in text.items()}
    out |= {f"mlp.{k}": t for k, t in mlp.items()}
    # What BLIP_Pretrain also saves: med.py's persistent position index and the contrastive projections.
    out["blip.text_encoder.embeddings.position_ids"] = torch.arange(40).expand(1, -1)
    out |= {"blip.vision_proj.weight": torch.randn(16, V_WIDTH), "blip.vision_proj.bias": torch.randn(16)}
    out |= {"blip.text_proj.weight": torch.randn(16, T_WIDTH), "blip.text_proj.bias": torch.randn(16)}
    return out


@pytest.fixture(scope="module")
def parts() -> dict[str, Any]:
    torch.manual_seed(0)
    config = _config()
    vision = BlipVisionModel(config.vision_config).eval()
    text = BlipTextModel(config.text_config, add_pooling_layer=False).eval()
    mlp = AestheticMLP(T_WIDTH).eval()  # ImageReward.py's MLP(768) layout at the tiny width
    for module in (vision, text, mlp):
        _randomize(module)
    with torch.no_grad():
        for linear in (m for m in mlp.layers if isinstance(m, nn.Linear)):  # output about unit size
            linear.weight.div_(linear.in_features**0.5 * 0.3)
    original = _to_original(vision.state_dict(), text.state_dict(), mlp.state_dict())
    return {"config": config, "vision": vision, "text": text, "mlp": mlp, "original": original}


@pytest.fixture(scope="module")
def files(parts, tmp_path_factory) -> dict[str, str]:
    """``ImageReward.pt`` in a folder, a BLIP config folder, and a tokenizer folder holding only vocab.txt."""
    root = tmp_path_factory.mktemp("imagereward")
    (root / "weights").mkdir()
    torch.save(parts["original"], root / "weights" / "ImageReward.pt")
    parts["config"].save_pretrained(root / "blip")
    (root / "bert").mkdir()
    (root / "bert" / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    return {"weights": str(root / "weights"), "blip": str(root / "blip"), "bert": str(root / "bert")}


@pytest.fixture(scope="module")
def scorer(files) -> ImageReward:
    return ImageReward(pretrained_path=files["weights"], tokenizer_path=files["bert"], blip_config_path=files["blip"])


def _images(n: int, seed: int = 0, size: tuple[int, int] = (SIZE, SIZE)) -> Tensor:
    return torch.rand(n, 3, *size, generator=torch.Generator().manual_seed(seed))


def _normalized(images: Tensor) -> Tensor:
    """The reference's pixels for images already at the ViT's size: 8-bit, then CLIP's normalization."""
    mean, std = torch.tensor(CLIP_MEAN).view(1, 3, 1, 1), torch.tensor(CLIP_STD).view(1, 3, 1, 1)
    return ((images.clamp(0, 1) * 255).round() / 255 - mean) / std


def _tokens(folder: str, texts: list[str]) -> tuple[Tensor, Tensor]:
    """ImageReward.score's tokenization: bert-base-uncased's tokenizer (here the tiny vocab), padded to 35."""
    out = BertTokenizer.from_pretrained(folder)(
        texts, padding="max_length", truncation=True, max_length=35, return_tensors="pt"
    )
    return out["input_ids"], out["attention_mask"]


# ------------------------------------------------------------------ the conversion
def test_the_conversion_keeps_every_tensor_and_leaves_none_out(parts):
    vision, text, mlp = imagereward_to_transformers(parts["original"])
    for got, module in ((vision, parts["vision"]), (text, parts["text"]), (mlp, parts["mlp"])):
        want = module.state_dict()
        assert set(got) == set(want), f"missing {sorted(set(want) - set(got))}, extra {sorted(set(got) - set(want))}"
        assert all(torch.equal(got[k], want[k]) for k in want)
    assert len(vision) + len(text) + len(mlp) + len(IGNORED_KEYS) == len(parts["original"])


@pytest.mark.parametrize(
    "table,key", [*((_VISION_TOP, k) for k in _VISION_TOP), *((_VISION_BLOCK, k) for k in _VISION_BLOCK)]
)
def test_every_rename_is_needed(parts, monkeypatch, table, key):
    monkeypatch.delitem(table, key)
    with pytest.raises(ValueError, match="keys outside ImageReward's layout"):
        imagereward_to_transformers(parts["original"])


def test_a_checkpoint_of_another_layout_is_refused(parts, files, tmp_path):
    with pytest.raises(ValueError, match=r"outside ImageReward's layout: \['blip.visual_encoder.head.weight'\]"):
        imagereward_to_transformers(parts["original"] | {"blip.visual_encoder.head.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="no mlp tensors; is it ImageReward-v1.0's ImageReward.pt"):
        imagereward_to_transformers({k: v for k, v in parts["original"].items() if not k.startswith("mlp.")})
    short = {k: v for k, v in parts["original"].items() if k != "blip.text_encoder.encoder.layer.1.output.dense.bias"}
    torch.save(short, tmp_path / "ImageReward.pt")
    with pytest.raises(ValueError, match="does not fit the BLIP config.*layer.1.output.dense.bias"):
        ImageReward(pretrained_path=str(tmp_path), tokenizer_path=files["bert"], blip_config_path=files["blip"])


# ------------------------------------------------------------------ the score
class _Reads(dict):
    """A state dict that records which keys were read."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> Tensor:
        self.read.add(key)
        return super().__getitem__(key)


def _reference_score(sd: _Reads, pixels: Tensor, ids: Tensor, mask: Tensor) -> Tensor:
    """ImageReward.score written out on the original tensors: vit.py's VisionTransformer.forward (eps 1e-6),
    med.py's BertModel.forward in mode 'multimodal' (additive -10000 padding mask), MLP, (x - mean) / std."""

    def ln(x: Tensor, name: str, eps: float) -> Tensor:
        return F.layer_norm(x, x.shape[-1:], sd[f"{name}.weight"], sd[f"{name}.bias"], eps)

    def lin(x: Tensor, name: str) -> Tensor:
        return F.linear(x, sd[f"{name}.weight"], sd[f"{name}.bias"])

    def heads(x: Tensor) -> Tensor:
        return x.view(x.shape[0], x.shape[1], HEADS, -1).transpose(1, 2)

    v = "blip.visual_encoder."
    x = F.conv2d(pixels, sd[f"{v}patch_embed.proj.weight"], sd[f"{v}patch_embed.proj.bias"], stride=PATCH)
    x = torch.cat([sd[f"{v}cls_token"].expand(len(x), -1, -1), x.flatten(2).transpose(1, 2)], 1) + sd[f"{v}pos_embed"]
    for i in range(LAYERS):
        b = f"{v}blocks.{i}."
        q, k, val = lin(ln(x, f"{b}norm1", 1e-6), f"{b}attn.qkv").chunk(3, dim=-1)
        attn = (heads(q) @ heads(k).transpose(-2, -1) * (V_WIDTH // HEADS) ** -0.5).softmax(-1)
        x = x + lin((attn @ heads(val)).transpose(1, 2).flatten(2), f"{b}attn.proj")
        x = x + lin(F.gelu(lin(ln(x, f"{b}norm2", 1e-6), f"{b}mlp.fc1")), f"{b}mlp.fc2")
    image_embeds = ln(x, f"{v}norm", 1e-6)

    t = "blip.text_encoder."
    h = (
        sd[f"{t}embeddings.word_embeddings.weight"][ids]
        + sd[f"{t}embeddings.position_embeddings.weight"][: ids.shape[1]]
    )
    h = ln(h, f"{t}embeddings.LayerNorm", 1e-12)
    pad = (1.0 - mask[:, None, None, :].float()) * -10000.0

    def attention(a: str, hidden: Tensor, context: Tensor, bias: Tensor | float) -> Tensor:
        q, k, val = (
            heads(lin(hidden, f"{a}.self.query")),
            heads(lin(context, f"{a}.self.key")),
            heads(lin(context, f"{a}.self.value")),
        )
        probs = (q @ k.transpose(-1, -2) / (T_WIDTH // HEADS) ** 0.5 + bias).softmax(-1)
        return ln(
            lin((probs @ val).transpose(1, 2).flatten(2), f"{a}.output.dense") + hidden, f"{a}.output.LayerNorm", 1e-12
        )

    for i in range(LAYERS):
        layer = f"{t}encoder.layer.{i}."
        h = attention(f"{layer}attention", h, h, pad)
        h = attention(f"{layer}crossattention", h, image_embeds, 0.0)  # image_atts all ones: (1 - 1) * -10000
        h = ln(
            lin(F.gelu(lin(h, f"{layer}intermediate.dense")), f"{layer}output.dense") + h,
            f"{layer}output.LayerNorm",
            1e-12,
        )
    r = h[:, 0]
    for j in (0, 2, 4, 6, 7):  # MLP: Linear, Dropout, Linear, Dropout, Linear, Dropout, Linear, Linear; no activations
        r = lin(r, f"mlp.layers.{j}")
    return (r.squeeze(-1) - REFERENCE_MEAN) / REFERENCE_STD


def test_the_score_is_the_reference_forward_written_out(parts, files, scorer):
    images, texts = _images(5, seed=1), [*PROMPTS[:4], LONG]  # different lengths: the padding mask matters
    got = torch.tensor(scorer(texts, ["unused"] * 5, images))
    sd = _Reads(parts["original"])
    with torch.no_grad():
        want = _reference_score(sd, _normalized(images), *_tokens(files["bert"], texts))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert set(parts["original"]) - sd.read == IGNORED_KEYS, "the forward reads every tensor but the ignored ones"
    assert got.std() > 0.05, "the tiny model separates the samples, so a wrong tensor shows"


def test_the_score_is_the_transformers_modules_by_hand(parts, files, scorer):
    images, texts = _images(3, seed=2), [PROMPTS[1], PROMPTS[4], PROMPTS[1]]
    ids, mask = _tokens(files["bert"], texts)
    with torch.no_grad():
        image_embeds = parts["vision"](pixel_values=_normalized(images)).last_hidden_state
        hidden = parts["text"](
            input_ids=ids,
            attention_mask=mask,
            encoder_hidden_states=image_embeds,
            encoder_attention_mask=torch.ones(image_embeds.shape[:-1], dtype=torch.long),
        ).last_hidden_state
        want = (parts["mlp"](hidden[:, 0]) - REFERENCE_MEAN) / REFERENCE_STD
    torch.testing.assert_close(torch.tensor(scorer(texts, texts, images)), want, rtol=0, atol=1e-5)


def test_the_original_prompt_is_scored_unless_refined_is_asked(files, scorer):
    images, originals, rewrites = _images(2, seed=3), PROMPTS[:2], PROMPTS[2:4]
    refined = ImageReward(
        pretrained_path=files["weights"], tokenizer_path=files["bert"], blip_config_path=files["blip"], prompt="refined"
    )
    on_originals = scorer(originals, rewrites, images)
    assert on_originals == pytest.approx(scorer(originals, originals, images), abs=0)
    assert refined(originals, rewrites, images) == pytest.approx(scorer(rewrites, rewrites, images), abs=0)
    assert refined(originals, rewrites, images) != pytest.approx(on_originals, abs=1e-3)


def test_a_sample_scores_the_same_alone_and_in_a_batch_and_in_bfloat16(files, scorer):
    images, texts = _images(5, seed=4), [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[3], PROMPTS[1]]
    alone = ImageReward(
        pretrained_path=files["weights"], tokenizer_path=files["bert"], blip_config_path=files["blip"], batch_size=1
    )
    together = torch.tensor(scorer(texts, texts, images))
    assert (together - torch.tensor(alone(texts, texts, images))).abs().max() <= 1e-5
    half = ImageReward(
        pretrained_path=files["weights"], tokenizer_path=files["bert"], blip_config_path=files["blip"], dtype="bfloat16"
    )
    assert next(half.model.vision_model.parameters()).dtype == torch.bfloat16
    assert next(half.model.mlp.parameters()).dtype == torch.float32, "the head scores the float32 [CLS] state"
    got = torch.tensor(half(texts, texts, images))
    assert 0 < (got - together).abs().max() < 0.2 * together.abs().max()


def test_the_registry_builds_it_and_a_weighted_sum_scores_it(files):
    assert "imagereward" in registered_rewards()
    args = {"pretrained_path": files["weights"], "tokenizer_path": files["bert"], "blip_config_path": files["blip"]}
    assert isinstance(resolve_reward("imagereward", args), ImageReward)
    total, parts = WeightedSum({"imagereward": 2.0}, {"imagereward": args})(PROMPTS[:2], PROMPTS[:2], _images(2))
    torch.testing.assert_close(total, 2 * parts["imagereward"])


# ------------------------------------------------------------------ preprocessing and constants
def test_the_constants_are_the_references(scorer):
    # ImageReward/ImageReward.py @ c1392c6: self.mean, self.std; _transform(224): Resize(224, BICUBIC),
    # CenterCrop(224), Normalize(CLIP mean, CLIP std); tokenizer(..., max_length=35); MLP(768).
    assert (REWARD_MEAN, REWARD_STD) == (REFERENCE_MEAN, REFERENCE_STD)
    assert (IMAGE_SIZE, IMAGE_MEAN, IMAGE_STD, MAX_LENGTH) == (224, CLIP_MEAN, CLIP_STD, 35)
    head = AestheticMLP(768).layers
    assert [(m.in_features, m.out_features) for m in head if isinstance(m, nn.Linear)] == [
        (768, 1024), (1024, 128), (128, 64), (64, 16), (16, 1)
    ]  # fmt: skip
    assert [m.p for m in head if isinstance(m, nn.Dropout)] == [0.2, 0.2, 0.1]
    assert [i for i, m in enumerate(head) if isinstance(m, nn.Linear)] == [0, 2, 4, 6, 7]
    # blip.py init_tokenizer: bos_token [DEC], then [ENC], after bert-base-uncased's vocabulary (30522, 30523).
    assert scorer.processor.convert_tokens_to_ids(["[DEC]", "[ENC]"]) == [len(VOCAB), len(VOCAB) + 1]
    assert scorer.processor("[ENC] cat")["input_ids"][1] == len(VOCAB) + 1
    # blip.py create_vit('large', 224): ViT-L/16, depth 24, 16 heads, eps 1e-6 (vit.py); med_config.json.
    config = imagereward_blip_config()
    v, t = config.vision_config, config.text_config
    assert (v.hidden_size, v.num_hidden_layers, v.num_attention_heads, v.intermediate_size) == (1024, 24, 16, 4096)
    assert (v.image_size, v.patch_size, v.layer_norm_eps, v.hidden_act) == (224, 16, 1e-6, "gelu")
    assert (t.vocab_size, t.hidden_size, t.num_hidden_layers, t.num_attention_heads) == (30524, 768, 12, 12)
    assert (t.intermediate_size, t.max_position_embeddings, t.layer_norm_eps) == (3072, 512, 1e-12)
    assert (t.encoder_hidden_size, t.hidden_act, t.pad_token_id, t.is_decoder) == (1024, "gelu", 0, True)


@pytest.mark.parametrize(
    "width,height,resized,box",
    [(64, 48, (42, 32), (5, 0, 37, 32)), (40, 70, (32, 56), (0, 12, 32, 44)), (45, 32, (45, 32), (6, 0, 38, 32))],
)
def test_images_are_resized_on_their_shorter_side_then_centre_cropped(scorer, width, height, resized, box):
    """torchvision's Resize(32) truncates the longer side (64 * 32 / 48 = 42.7 -> 42), leaves an image whose
    shorter side fits as it is, and CenterCrop rounds the offset half to even ((45 - 32) / 2 = 6.5 -> 6); PIL's
    bicubic does the resampling."""
    images = _images(1, seed=5, size=(height, width))
    u8 = (images[0].permute(1, 2, 0) * 255).round().byte().numpy()
    crop = Image.fromarray(u8).resize(resized, Image.Resampling.BICUBIC).crop(box)
    want = _normalized(torch.from_numpy(np.array(crop)).permute(2, 0, 1)[None].float() / 255)
    torch.testing.assert_close(scorer.pixels(images), want, rtol=0, atol=1e-6)
    square = _images(2, seed=6)
    torch.testing.assert_close(scorer.pixels(square), _normalized(square), rtol=0, atol=1e-6)


# ------------------------------------------------------------------ missing weights
def test_missing_weights_are_errors_that_say_what_to_download(files, tmp_path):
    common = {"tokenizer_path": files["bert"], "blip_config_path": files["blip"]}
    need = (
        r"reward 'imagereward': its checkpoint '.*ImageReward.pt' is not a file; it is ImageReward-v1.0's "
        r"ImageReward.pt, from https://huggingface.co/THUDM/ImageReward"
    )
    with pytest.raises(ValueError, match=need):
        ImageReward(pretrained_path=str(tmp_path), **common)  # a folder without the checkpoint
    with pytest.raises(ValueError, match=need):
        ImageReward(pretrained_path=str(tmp_path / "gone" / "ImageReward.pt"), **common)
    with pytest.raises(
        ValueError, match=r"cannot load its checkpoint 'ImageReward.pt' \(pretrained_path; .*THUDM/ImageReward\)"
    ):
        ImageReward(pretrained_path="nobody/no-such-imagereward", **common)  # HF_HUB_OFFLINE: not in the cache
    with pytest.raises(
        ValueError, match=r"'imagereward': cannot load its BERT tokenizer \(tokenizer_path; bert-base-uncased"
    ):
        ImageReward(pretrained_path=files["weights"], tokenizer_path=str(tmp_path / "no-bert"))


def test_the_model_follows_the_images_device(scorer):
    images, texts = _images(3, seed=7), PROMPTS[:3]
    cpu = scorer(texts, texts, images)
    assert next(scorer.model.parameters()).device == images.device
    if torch.cuda.is_available():  # on the GPU machine: moved to the images' GPU, the same scores
        gpu = scorer(texts, texts, images.cuda())
        assert next(scorer.model.parameters()).is_cuda and next(scorer.model.mlp.parameters()).is_cuda
        assert gpu == pytest.approx(cpu, abs=1e-4)
        scorer(texts, texts, images)  # and back, for the tests after this one
