"""In-process CLIP scorers (PickScore, CLIPScore, aesthetic, HPSv2) on tiny random models saved in the real
layouts: each score against its formula computed by hand, batch invariance, prompt choice, dtype and
placement, videos, and clear errors for a missing path."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

from tests.pipelines import clip_tokenizer
from unirl_pl.errors import InputError
from unirl_pl.rewards import WeightedSum, resolve_reward
from unirl_pl.rewards.clip_models import Aesthetic, AestheticMLP, CLIPScore, PickScore, quantize, unique_texts
from unirl_pl.rewards.frames import reduce_frames, sample_frames
from unirl_pl.rewards.hpsv2 import HPSv2, open_clip_to_transformers

SIZE, WIDTH, EMBED, PATCH, LAYERS, HEADS = 32, 32, 16, 8, 2, 2
PROMPTS = ["a red cat", "a blue dog on the left", "a big green square", "a photo of a cat", "a small circle"]


def _config(hidden_act: str = "quick_gelu") -> CLIPConfig:
    tok = clip_tokenizer()
    common = {"hidden_size": WIDTH, "intermediate_size": 4 * WIDTH, "num_hidden_layers": LAYERS}
    common |= {"num_attention_heads": HEADS, "hidden_act": hidden_act, "projection_dim": EMBED}
    text = common | {"vocab_size": len(tok), "max_position_embeddings": 77, "eos_token_id": tok.eos_token_id}
    text |= {"bos_token_id": tok.bos_token_id, "pad_token_id": tok.pad_token_id}
    vision = common | {"image_size": SIZE, "patch_size": PATCH}
    return CLIPConfig(text_config=text, vision_config=vision, projection_dim=EMBED)


def _save_processor(path: Path) -> None:
    image = CLIPImageProcessor(size={"shortest_edge": SIZE}, crop_size={"height": SIZE, "width": SIZE})
    CLIPProcessor(image_processor=image, tokenizer=clip_tokenizer()).save_pretrained(path)


def save_tiny_clip(path: Path) -> str:
    """Save a tiny ``CLIPModel`` (:func:`_config`, initialised from seed 0) and its processor at ``path``, as
    openai CLIP folders are; return the path."""
    torch.manual_seed(0)
    CLIPModel(_config()).save_pretrained(path)
    _save_processor(path)
    return str(path)


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory) -> str:
    """A tiny CLIPModel with its processor, saved as PickScore_v1 / openai CLIP folders are."""
    path = tmp_path_factory.mktemp("clip")
    torch.manual_seed(0)
    model = CLIPModel(_config())
    with torch.no_grad():
        model.logit_scale.fill_(np.log(50.0))  # not the init value, so a dropped temperature shows
    model.save_pretrained(path)
    _save_processor(path)
    return str(path)


def _images(n: int, seed: int = 0, size: int = SIZE) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, size, size, generator=g)


def _by_hand(clip_dir: str, images: torch.Tensor, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(image embeddings, text embeddings, temperature) through CLIPModel.forward on pixels built by hand:
    the images are 32x32, the model's input size, so the processor only rescales and normalizes."""
    model = CLIPModel.from_pretrained(clip_dir).eval()
    proc = CLIPImageProcessor.from_pretrained(clip_dir)
    u8 = (images.clamp(0, 1) * 255).round() / 255
    mean, std = torch.tensor(proc.image_mean).view(1, 3, 1, 1), torch.tensor(proc.image_std).view(1, 3, 1, 1)
    tokens = clip_tokenizer()(texts, padding="max_length", max_length=77, return_tensors="pt")
    with torch.no_grad():
        out = model(
            input_ids=tokens["input_ids"], pixel_values=(u8 - mean) / std, attention_mask=tokens["attention_mask"]
        )
    return out.image_embeds, out.text_embeds, float(model.logit_scale.detach().exp())


# ------------------------------------------------------------------ PickScore and CLIPScore
def test_pickscore_is_temperature_times_cosine_by_hand(clip_dir):
    images = _images(3)
    scorer = PickScore(pretrained_path=clip_dir, processor_path=clip_dir)
    got = torch.tensor(scorer(PROMPTS[:3], ["x"] * 3, images))
    img, txt, temperature = _by_hand(clip_dir, images, PROMPTS[:3])
    cos = F.cosine_similarity(img, txt, dim=-1)
    assert temperature == pytest.approx(50.0, rel=1e-5)
    torch.testing.assert_close(got, temperature * cos, rtol=0, atol=1e-5)
    scaled = PickScore(pretrained_path=clip_dir, processor_path=clip_dir, scale=1 / 26)
    torch.testing.assert_close(torch.tensor(scaled(PROMPTS[:3], ["x"] * 3, images)), got / 26, rtol=0, atol=1e-6)


def test_clip_score_is_the_cosine_and_clamps_when_asked(clip_dir):
    images = _images(5, seed=1)
    img, txt, _ = _by_hand(clip_dir, images, PROMPTS)
    cos = F.cosine_similarity(img, txt, dim=-1)
    got = torch.tensor(CLIPScore(pretrained_path=clip_dir)(PROMPTS, PROMPTS, images))
    torch.testing.assert_close(got, cos, rtol=0, atol=1e-6)
    clamped = CLIPScore(pretrained_path=clip_dir, scale=2.5, clamp_negative=True)(PROMPTS, PROMPTS, images)
    torch.testing.assert_close(torch.tensor(clamped), 2.5 * cos.clamp_min(0), rtol=0, atol=1e-6)
    assert (cos < 0).any() and (cos > 0).any(), "the random model gives both signs, so the clamp is exercised"


def test_a_sample_scores_the_same_alone_and_in_a_batch_of_five(clip_dir):
    images = _images(5, seed=2)
    texts = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[4], PROMPTS[1]]  # repeated prompts, as in a group
    batched = PickScore(pretrained_path=clip_dir, processor_path=clip_dir, batch_size=5)
    alone = PickScore(pretrained_path=clip_dir, processor_path=clip_dir, batch_size=1)
    together = torch.tensor(batched(texts, texts, images))
    singles = torch.tensor([alone([t], [t], images[i : i + 1])[0] for i, t in enumerate(texts)])
    assert (together - singles).abs().max() <= 1e-5


def test_the_original_prompt_is_scored_unless_refined_is_asked(clip_dir):
    images = _images(2, seed=3)
    originals, rewrites = PROMPTS[:2], PROMPTS[2:4]
    default = CLIPScore(pretrained_path=clip_dir)
    refined = CLIPScore(pretrained_path=clip_dir, prompt="refined")
    on_originals = default(originals, rewrites, images)
    assert on_originals == pytest.approx(default(originals, originals, images), abs=0)
    assert refined(originals, rewrites, images) == pytest.approx(default(rewrites, rewrites, images), abs=1e-7)
    assert refined(originals, rewrites, images) != pytest.approx(on_originals, abs=1e-4)


def test_unique_texts_encodes_each_prompt_once():
    order, index = unique_texts(["b", "a", "b", "c", "a"])
    assert order == ["b", "a", "c"] and index.tolist() == [0, 1, 0, 2, 1]


def test_bfloat16_weights_score_close_to_float32_and_report_float32(clip_dir):
    images = _images(4, seed=4)
    fp32 = PickScore(pretrained_path=clip_dir, processor_path=clip_dir)
    bf16 = PickScore(pretrained_path=clip_dir, processor_path=clip_dir, dtype="bfloat16", device="cpu")
    assert next(bf16.model.parameters()).dtype == torch.bfloat16 and not bf16.model.training
    assert not any(p.requires_grad for p in bf16.model.parameters())
    a, b = torch.tensor(fp32(PROMPTS[:4], PROMPTS[:4], images)), torch.tensor(bf16(PROMPTS[:4], PROMPTS[:4], images))
    assert b.dtype == torch.float32 and (a - b).abs().max() < 0.05 * 50, "bf16 rounding, not a different formula"
    assert (a - b).abs().max() > 0, "the weights really are bfloat16"
    with pytest.raises(ValueError, match="'pickscore': dtype must be one of"):
        PickScore(pretrained_path=clip_dir, processor_path=clip_dir, dtype="fp8")


def test_the_model_follows_the_images_device(clip_dir):
    scorer = CLIPScore(pretrained_path=clip_dir)
    assert scorer.device is None
    scorer(PROMPTS[:1], PROMPTS[:1], _images(1))
    assert next(scorer.model.parameters()).device == torch.device("cpu")
    if torch.cuda.is_available():  # on the GPU machine: moved to the images' GPU, scores back on the CPU
        cpu = scorer(PROMPTS[:2], PROMPTS[:2], _images(2))
        gpu = scorer(PROMPTS[:2], PROMPTS[:2], _images(2).cuda())
        assert next(scorer.model.parameters()).is_cuda and gpu == pytest.approx(cpu, abs=1e-4)


def test_a_missing_path_is_an_error_naming_the_reward_and_the_path(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(
        ValueError, match=r"reward 'pickscore': cannot load its CLIP model \(pretrained_path\) from '.*no-such-model'"
    ):
        resolve_reward("pickscore", {"pretrained_path": missing, "processor_path": missing})
    with pytest.raises(ValueError, match="reward 'clip_score': cannot load"):
        resolve_reward("clip_score", {"pretrained_path": missing})
    with pytest.raises(ValueError, match="reward 'aesthetic' needs mlp_path"):
        resolve_reward("aesthetic", {})
    with pytest.raises(ValueError, match="reward 'aesthetic': its aesthetic MLP .* is not a file"):
        resolve_reward("aesthetic", {"mlp_path": missing})


def _random_bytes(path: Path) -> None:
    path.write_bytes(torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator()).numpy().tobytes())


def test_a_corrupt_checkpoint_is_named_with_the_reward_and_its_path(clip_dir, hps_files, tmp_path):
    """Random bytes where the weights belong: safetensors' "header too large" names neither the reward nor the file."""
    folder = tmp_path / "PickScore_v1"
    shutil.copytree(clip_dir, folder)
    _random_bytes(folder / "model.safetensors")
    with pytest.raises(InputError) as err:
        PickScore(pretrained_path=str(folder), processor_path=clip_dir)
    message = str(err.value)
    assert message.startswith(
        f"reward 'pickscore': its CLIP model (pretrained_path) {str(folder / 'model.safetensors')!r}"
    )
    assert "is corrupt" in message and "header" in message and "\n" not in message, message
    _, clip, _ = hps_files
    for name in ("HPS_v2.1_compressed.pt", "HPS_v2.1_compressed.safetensors"):
        _random_bytes(tmp_path / name)
        with pytest.raises(InputError, match=rf"^reward 'hpsv2': its checkpoint '.*{name}' is corrupt"):
            HPSv2(pretrained_path=str(tmp_path / name), clip_path=clip)


def test_registry_scorers_combine_in_a_weighted_sum(clip_dir):
    args = {
        "pickscore": {"pretrained_path": clip_dir, "processor_path": clip_dir},
        "clip_score": {"pretrained_path": clip_dir},
    }
    total, parts = WeightedSum({"pickscore": 1.0, "clip_score": 2.0}, args)(PROMPTS[:3], PROMPTS[:3], _images(3))
    torch.testing.assert_close(total, parts["pickscore"] + 2 * parts["clip_score"])


def test_quantize_rounds_to_eight_bits():
    x = torch.tensor([0.0, 0.5 / 255, 0.51 / 255, 1.0, 1.5, -0.2])
    assert quantize(x).tolist() == [0, 0, 1, 255, 255, 0]


# ------------------------------------------------------------------ videos
def test_videos_score_every_kth_frame_and_reduce_by_min_or_mean(clip_dir):
    videos = _images(2 * 5, seed=5).view(2, 5, 3, SIZE, SIZE)
    per_frame = CLIPScore(pretrained_path=clip_dir)
    frames = videos[:, ::2]  # frames 0, 2, 4
    texts = PROMPTS[:2]
    scores = torch.tensor(
        [[per_frame([texts[i]], [texts[i]], frames[i, j : j + 1])[0] for j in range(3)] for i in range(2)]
    )
    worst = CLIPScore(pretrained_path=clip_dir, frame_stride=2, frame_reduce="min")(texts, texts, videos)
    mean = CLIPScore(pretrained_path=clip_dir, frame_stride=2)(texts, texts, videos)
    torch.testing.assert_close(torch.tensor(worst), scores.min(1).values, rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.tensor(mean), scores.mean(1), rtol=0, atol=1e-5)
    assert sample_frames(videos, 3).shape[1] == 2 and reduce_frames(torch.tensor([[1.0, 3.0]]), "min").item() == 1.0
    with pytest.raises(ValueError, match="frame_stride must be >= 1"):
        CLIPScore(pretrained_path=clip_dir, frame_stride=0)


# ------------------------------------------------------------------ aesthetic
def test_aesthetic_is_the_laion_mlp_on_the_normalized_image_embedding(clip_dir, tmp_path):
    torch.manual_seed(1)
    mlp = AestheticMLP(EMBED)
    torch.save(mlp.state_dict(), tmp_path / "sac+logos+ava1-l14-linearMSE.pth")  # the release's layout
    assert sorted(mlp.state_dict()) == sorted(f"layers.{i}.{p}" for i in (0, 2, 4, 6, 7) for p in ("weight", "bias"))
    scorer = Aesthetic(mlp_path=str(tmp_path / "sac+logos+ava1-l14-linearMSE.pth"), pretrained_path=clip_dir)
    images = _images(3, seed=6)
    img, _, _ = _by_hand(clip_dir, images, PROMPTS[:3])
    x = F.normalize(img, dim=-1)
    layers = [mlp.layers[i] for i in (0, 2, 4, 6, 7)]
    for layer in layers:  # no activations between the layers, as in the released predictor
        x = x @ layer.weight.T + layer.bias
    torch.testing.assert_close(torch.tensor(scorer(PROMPTS[:3], PROMPTS[:3], images)), x.squeeze(-1), rtol=0, atol=1e-5)
    other = AestheticMLP(EMBED + 1)
    torch.save({"state_dict": {f"module.{k}": v for k, v in other.state_dict().items()}}, tmp_path / "wide.pt")
    with pytest.raises(ValueError, match="the MLP takes 17-d embeddings but the CLIP model"):
        Aesthetic(mlp_path=str(tmp_path / "wide.pt"), pretrained_path=clip_dir)


# ------------------------------------------------------------------ HPSv2 (open_clip checkpoint layout)
def _open_clip_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors under open_clip's CLIP names and shapes (what HPS_v2.1_compressed.pt holds)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int, scale: float = 0.1) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    state: dict[str, torch.Tensor] = {}

    def blocks(prefix: str) -> None:
        for i in range(LAYERS):
            p = f"{prefix}transformer.resblocks.{i}."
            state.update({p + "attn.in_proj_weight": r(3 * WIDTH, WIDTH), p + "attn.in_proj_bias": r(3 * WIDTH)})
            state.update({p + "attn.out_proj.weight": r(WIDTH, WIDTH), p + "attn.out_proj.bias": r(WIDTH)})
            for ln in ("ln_1", "ln_2"):
                state.update({p + f"{ln}.weight": 1 + r(WIDTH), p + f"{ln}.bias": r(WIDTH)})
            state.update({p + "mlp.c_fc.weight": r(4 * WIDTH, WIDTH), p + "mlp.c_fc.bias": r(4 * WIDTH)})
            state.update({p + "mlp.c_proj.weight": r(WIDTH, 4 * WIDTH), p + "mlp.c_proj.bias": r(WIDTH)})

    grid = (SIZE // PATCH) ** 2
    blocks("visual.")
    blocks("")
    state.update({"visual.conv1.weight": r(WIDTH, 3, PATCH, PATCH), "visual.class_embedding": r(WIDTH)})
    state.update({"visual.positional_embedding": r(grid + 1, WIDTH), "visual.proj": r(WIDTH, EMBED)})
    for ln in ("visual.ln_pre", "visual.ln_post", "ln_final"):
        state.update({f"{ln}.weight": 1 + r(WIDTH), f"{ln}.bias": r(WIDTH)})
    state.update({"token_embedding.weight": r(len(clip_tokenizer()), WIDTH), "positional_embedding": r(77, WIDTH)})
    state.update({"text_projection": r(WIDTH, EMBED), "logit_scale": torch.tensor(np.log(100.0), dtype=torch.float32)})
    return state


def _resblocks(state: dict, prefix: str, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """open_clip's residual attention blocks: x + attn(ln_1(x)), then x + mlp(ln_2(x)) with exact GELU."""
    for i in range(LAYERS):
        p = f"{prefix}transformer.resblocks.{i}."
        mha = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
        mha.load_state_dict({k.removeprefix(p + "attn."): v for k, v in state.items() if k.startswith(p + "attn.")})
        h = F.layer_norm(x, (WIDTH,), state[p + "ln_1.weight"], state[p + "ln_1.bias"])
        x = x + mha(h, h, h, need_weights=False, attn_mask=mask)[0]
        h = F.layer_norm(x, (WIDTH,), state[p + "ln_2.weight"], state[p + "ln_2.bias"])
        h = F.gelu(F.linear(h, state[p + "mlp.c_fc.weight"], state[p + "mlp.c_fc.bias"]))
        x = x + F.linear(h, state[p + "mlp.c_proj.weight"], state[p + "mlp.c_proj.bias"])
    return x


def _open_clip_hps(state: dict, pixels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """HPSv2's score written out from open_clip's forward: cos(normalize(image @ proj), normalize(text @ proj))."""
    ln = lambda x, n: F.layer_norm(x, (WIDTH,), state[f"{n}.weight"], state[f"{n}.bias"])  # noqa: E731
    x = F.conv2d(pixels, state["visual.conv1.weight"], stride=PATCH).flatten(2).transpose(1, 2)
    cls = state["visual.class_embedding"].expand(x.shape[0], 1, WIDTH)
    x = ln(torch.cat([cls, x], 1) + state["visual.positional_embedding"], "visual.ln_pre")
    image = ln(_resblocks(state, "visual.", x, None)[:, 0], "visual.ln_post") @ state["visual.proj"]
    causal = torch.full((77, 77), float("-inf")).triu(1)
    t = state["token_embedding.weight"][ids] + state["positional_embedding"]
    t = ln(_resblocks(state, "", t, causal), "ln_final")
    text = t[torch.arange(ids.shape[0]), ids.argmax(-1)] @ state["text_projection"]
    return (F.normalize(image, dim=-1) * F.normalize(text, dim=-1)).sum(-1)


@pytest.fixture(scope="module")
def hps_files(tmp_path_factory) -> tuple[str, str, dict]:
    """(checkpoint file in HPSv2's format, CLIP config + processor folder, the raw open_clip state)."""
    root = tmp_path_factory.mktemp("hps")
    state = _open_clip_state()
    torch.save({"state_dict": state}, root / "HPS_v2.1_compressed.pt")
    clip = root / "clip"
    _config(hidden_act="gelu").save_pretrained(clip)  # ViT-H-14 uses exact GELU, not OpenAI's quick GELU
    _save_processor(clip)
    return str(root / "HPS_v2.1_compressed.pt"), str(clip), state


def test_hpsv2_matches_open_clips_forward_written_out(hps_files):
    ckpt, clip, state = hps_files
    images = _images(3, seed=7)
    scorer = HPSv2(pretrained_path=ckpt, clip_path=clip)
    got = torch.tensor(scorer(PROMPTS[:3], PROMPTS[:3], images))
    proc = CLIPImageProcessor.from_pretrained(clip)
    mean, std = torch.tensor(proc.image_mean).view(1, 3, 1, 1), torch.tensor(proc.image_std).view(1, 3, 1, 1)
    pixels = ((images * 255).round() / 255 - mean) / std  # 32 px already: HPSv2's transform only normalizes
    tok = clip_tokenizer()
    ids = torch.tensor([tok(p)["input_ids"] + [0] * (77 - len(tok(p)["input_ids"])) for p in PROMPTS[:3]])
    with torch.no_grad():
        want = _open_clip_hps(state, pixels, ids)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # The folder form and the bare-file form load the same checkpoint.
    again = HPSv2(pretrained_path=str(Path(ckpt).parent), clip_path=clip)(PROMPTS[:3], PROMPTS[:3], images)
    assert again == pytest.approx(got.tolist(), abs=0)


def test_hpsv2_pads_a_non_square_image_after_resizing_its_longer_side(hps_files):
    ckpt, clip, _ = hps_files
    scorer = HPSv2(pretrained_path=ckpt, clip_path=clip)
    tall = torch.ones(1, 3, 2 * SIZE, SIZE)  # resized to 32 x 16, then 8 zero columns each side
    pixels = scorer.pixels(tall)
    ip = scorer.processor.image_processor
    black = (0 - torch.tensor(ip.image_mean)) / torch.tensor(ip.image_std)
    white = (1 - torch.tensor(ip.image_mean)) / torch.tensor(ip.image_std)
    assert pixels.shape == (1, 3, SIZE, SIZE)
    torch.testing.assert_close(pixels[0, :, :, :8].mean((1, 2)), black)
    torch.testing.assert_close(pixels[0, :, :, 8:24].mean((1, 2)), white)


def test_open_clip_conversion_covers_every_tensor_and_rejects_a_mismatched_config(hps_files, tmp_path):
    ckpt, clip, state = hps_files
    converted = open_clip_to_transformers(state)
    assert set(converted) == set(CLIPModel(_config("gelu")).state_dict()), "every CLIPModel weight, nothing else"
    small = tmp_path / "small"
    cfg = _config("gelu")
    cfg.vision_config.num_hidden_layers = 1
    cfg.save_pretrained(small)
    _save_processor(small)
    with pytest.raises(ValueError, match="reward 'hpsv2': the checkpoint does not fit the CLIP config"):
        HPSv2(pretrained_path=ckpt, clip_path=str(small))
    with pytest.raises(ValueError, match="reward 'hpsv2': its checkpoint .* is not a file"):
        HPSv2(pretrained_path=str(tmp_path), clip_path=clip)


def test_images_three_pixels_tall_are_read_channels_last(clip_dir):
    """The processor infers the channel axis from the shape unless told: a (3, W, 3) array would pass as
    channels first. Each image's pixels must equal the processor's on that image alone, told it is HWC."""
    from unirl_pl.rewards.clip_models import quantize

    scorer = resolve_reward("pickscore", {"pretrained_path": clip_dir, "processor_path": clip_dir})
    images = torch.rand(2, 3, 3, 40, generator=torch.Generator().manual_seed(1))
    proc = CLIPImageProcessor.from_pretrained(clip_dir)
    arrays = list(quantize(images).permute(0, 2, 3, 1).numpy())
    expected = proc(images=arrays, return_tensors="pt", input_data_format="channels_last")["pixel_values"]
    torch.testing.assert_close(scorer.pixels(images), expected, rtol=0, atol=0)
