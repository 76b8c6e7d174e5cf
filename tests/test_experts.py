"""Tests of the model components: tiny offline builds, determinism, LoRA wiring, path loading."""

# The hub reads HF_HUB_OFFLINE at import time, so it is set before the imports below.
# ruff: noqa: E402
import os

os.environ["HF_HUB_OFFLINE"] = "1"

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline
from peft import PeftModel
from transformers import AutoModelForCausalLM

from unirl_pl.experts import (
    DEFAULT_WORDS,
    CausalLMExpert,
    FlowTransformerExpert,
    TextEncoderExpert,
    TinyCausalLMExpert,
    VAEExpert,
    build_word_tokenizer,
)
from unirl_pl.experts._common import seeded_cpu_init

PROMPTS = ["two red circles", "a blue square on the left of a yellow ring"]


def _built(factory: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    expert = factory()
    expert.build()
    return expert


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def _perturb_lora_b(expert: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, param in expert.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(7))


def _lm_batch(expert: CausalLMExpert) -> dict[str, torch.Tensor]:
    batch = expert.tokenizer(PROMPTS, return_tensors="pt", padding=True)
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


def _dit_inputs(batch: int = 2) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(batch, 4, 16, 16, generator=g)
    sigma = torch.rand(batch, generator=g)
    hidden = torch.randn(batch, 24, 32, generator=g)
    pooled = torch.randn(batch, 32, generator=g)
    return latents, sigma, hidden, pooled


# ---------------------------------------------------------------- tokenizer


def test_word_tokenizer_round_trip_and_special_ids() -> None:
    tok = build_word_tokenizer()
    assert len(DEFAULT_WORDS) == len(set(DEFAULT_WORDS)) >= 200
    assert {"red", "crimson", "circle", "circles", "boxes", "two", "left", ",", "."} <= set(DEFAULT_WORDS)
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id, tok.bos_token_id) == (0, 1, 2, 3)
    assert len(tok) == len(DEFAULT_WORDS) + 4
    assert tok.decode(tok.encode("two red circles")) == "two red circles"
    ids = tok.encode("Two RED circles, left.")
    assert tok.convert_ids_to_tokens(ids) == ["two", "red", "circles", ",", "left", "."]
    assert tok.encode("a zebra")[1] == tok.unk_token_id
    left = tok(PROMPTS, padding=True)["input_ids"]
    assert left[0][0] == tok.pad_token_id
    right = build_word_tokenizer(padding_side="right")(PROMPTS, padding=True)["input_ids"]
    assert right[0][-1] == tok.pad_token_id
    with pytest.raises(ValueError, match="padding_side"):
        build_word_tokenizer(padding_side="middle")


# ---------------------------------------------------------------- shared properties


FACTORIES: dict[str, Callable[[], torch.nn.Module]] = {
    "llm": TinyCausalLMExpert,
    "dit": FlowTransformerExpert,
    "text_encoder": TextEncoderExpert,
    "vae": VAEExpert,
}


@pytest.mark.parametrize("name", list(FACTORIES))
def test_build_is_lazy_deterministic_idempotent_and_rng_neutral(name: str) -> None:
    factory = FACTORIES[name]
    lazy = factory()
    assert lazy.model is None and not list(lazy.parameters())
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a = _built(factory)
    assert torch.equal(torch.get_rng_state(), state)
    model = a.model
    a.build()
    assert a.model is model
    torch.manual_seed(456)
    # Construction is pinned to CPU even inside a meta-device context (Lightning's configure_model).
    with torch.device("meta"):
        b = _built(factory)
    assert all(p.device.type == "cpu" for p in b.parameters())
    _assert_same_weights(a, b)


@pytest.mark.parametrize("name", ["llm", "dit"])
def test_only_lora_weights_train(name: str) -> None:
    expert = _built(FACTORIES[name])
    trainable = [n for n, p in expert.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert all(p.dtype == torch.float32 for p in expert.parameters() if p.requires_grad)


def test_low_precision_base_keeps_float32_lora() -> None:
    llm = _built(lambda: TinyCausalLMExpert(dtype="bfloat16"))
    dit = _built(lambda: FlowTransformerExpert(dtype="bfloat16"))
    for expert in (llm, dit):
        dtypes = {n: p.dtype for n, p in expert.named_parameters()}
        assert all(d == torch.float32 for n, d in dtypes.items() if "lora_" in n)
        assert all(d == torch.bfloat16 for n, d in dtypes.items() if "lora_" not in n)
    assert llm(**_lm_batch(llm)).logits.isfinite().all()
    latents, sigma, hidden, pooled = _dit_inputs()
    assert dit.velocity(latents, sigma, hidden, pooled).dtype == torch.float32


@pytest.mark.parametrize("name", ["text_encoder", "vae"])
def test_frozen_components_stay_frozen_and_in_eval(name: str) -> None:
    expert = _built(FACTORIES[name])
    assert not any(p.requires_grad for p in expert.parameters())
    expert.train()
    assert expert.training and not expert.model.training


@pytest.mark.parametrize(
    ("factory", "match"),
    [
        (lambda: TinyCausalLMExpert(lora_rank=0), "lora_rank"),
        (lambda: TinyCausalLMExpert(dtype="float8"), "unknown dtype"),
        (lambda: TinyCausalLMExpert(hidden_size=30, num_attention_heads=4), "divisible"),
        (lambda: FlowTransformerExpert(lora_init="pissa"), "lora_init"),
        (lambda: FlowTransformerExpert(caption_projection_dim=48), "caption_projection_dim"),
        (lambda: FlowTransformerExpert(sample_size=15), "patch_size"),
        (lambda: FlowTransformerExpert(qk_norm="l2"), "qk_norm"),
        (lambda: TextEncoderExpert(max_length=1), "max_length"),
        (lambda: VAEExpert(block_out_channels=[32, 12]), "norm_num_groups"),
    ],
)
def test_bad_arguments_are_refused(factory: Callable[[], torch.nn.Module], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        factory()


# ---------------------------------------------------------------- LM


def test_llm_forward_cache_and_reference() -> None:
    expert = _built(TinyCausalLMExpert)
    batch = _lm_batch(expert)
    out = expert(**batch)
    assert out.logits.shape == (*batch["input_ids"].shape, len(expert.tokenizer))
    assert expert.pad_token_id == 0 and expert.eos_token_id == 1

    # Incremental decoding through the cache equals the full forward (left padding needs positions).
    position_ids = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    first = expert(**batch, position_ids=position_ids, use_cache=True)
    nxt = first.logits[:, -1].argmax(-1, keepdim=True)
    mask = torch.cat([batch["attention_mask"], torch.ones_like(nxt)], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    step = expert(nxt, mask, position_ids=positions[:, -1:], past_key_values=first.cache, use_cache=True)
    full = expert(torch.cat([batch["input_ids"], nxt], dim=1), mask, position_ids=positions)
    torch.testing.assert_close(step.logits[:, -1], full.logits[:, -1], atol=1e-5, rtol=1e-5)

    with torch.no_grad(), expert.adapter_disabled():
        ref = expert(**batch).logits
    torch.testing.assert_close(ref, out.logits, atol=0, rtol=0)

    # B = 0 at init, yet the loss still reaches B through A.
    out.logits.logsumexp(-1).mean().backward()
    grads = [p.grad for n, p in expert.named_parameters() if "lora_B" in n]
    assert any(g is not None and g.abs().sum() > 0 for g in grads)

    _perturb_lora_b(expert)
    with torch.no_grad():
        policy = expert(**batch).logits
        with expert.adapter_disabled():
            ref_after = expert(**batch).logits
            with expert.adapter_disabled():  # nesting keeps the outer reference in place
                pass
            ref_nested = expert(**batch).logits
        torch.testing.assert_close(expert(**batch).logits, policy, atol=0, rtol=0)
    assert (policy - ref).abs().max() > 1e-4
    torch.testing.assert_close(ref_after, ref, atol=0, rtol=0)
    torch.testing.assert_close(ref_nested, ref, atol=0, rtol=0)
    assert all(p.requires_grad for n, p in expert.named_parameters() if "lora_" in n)


def test_llm_adapter_toggle_keeps_requires_grad() -> None:
    expert = _built(TinyCausalLMExpert)
    expert.requires_grad_(False)  # e.g. a generator-only run freezes the LM
    with torch.no_grad(), expert.adapter_disabled():
        expert(**_lm_batch(expert))
    assert not any(p.requires_grad for p in expert.parameters())


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
def test_llm_loads_from_path_and_adapter_round_trips(tmp_path: Path) -> None:
    tiny = _built(TinyCausalLMExpert)
    batch = _lm_batch(tiny)
    with torch.no_grad():
        expected = tiny(**batch).logits
    donor = _built(TinyCausalLMExpert)
    donor.model.unload().save_pretrained(tmp_path / "base")
    donor.tokenizer.save_pretrained(tmp_path / "base")
    loaded = _built(lambda: CausalLMExpert(pretrained_path=str(tmp_path / "base")))
    assert loaded.tokenizer.padding_side == "left"
    assert loaded.tokenizer(PROMPTS)["input_ids"] == tiny.tokenizer(PROMPTS)["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).logits, expected, atol=1e-6, rtol=1e-6)

    _perturb_lora_b(tiny)
    tiny.save_adapter(str(tmp_path / "adapter"))
    with torch.no_grad():
        expected = tiny(**batch).logits
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
        peft_model = PeftModel.from_pretrained(base, tmp_path / "adapter")
        got = peft_model(**batch).logits
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    fresh = _built(TinyCausalLMExpert)
    fresh.load_adapter(str(tmp_path / "adapter"))
    with torch.no_grad():
        torch.testing.assert_close(fresh(**batch).logits, expected, atol=0, rtol=0)


# ---------------------------------------------------------------- DiT


def test_dit_velocity_and_reference() -> None:
    expert = _built(FlowTransformerExpert)
    latents, sigma, hidden, pooled = _dit_inputs()
    assert expert.latent_shape == (4, 16, 16)
    v = expert.velocity(latents, sigma, hidden, pooled)
    assert v.shape == latents.shape and v.dtype == torch.float32
    with torch.no_grad():
        scalar = expert.velocity(latents, torch.tensor(0.5), hidden, pooled)
        per_sample = expert.velocity(latents, torch.full((2,), 0.5), hidden, pooled)
    torch.testing.assert_close(scalar, per_sample, atol=0, rtol=0)
    with torch.no_grad(), expert.adapter_disabled():
        ref = expert.velocity(latents, sigma, hidden, pooled)
    torch.testing.assert_close(ref, v, atol=0, rtol=0)
    assert any(p.requires_grad for p in expert.parameters())

    v.square().mean().backward()
    grads = [p.grad for n, p in expert.named_parameters() if "lora_B" in n]
    assert any(g is not None and g.abs().sum() > 0 for g in grads)

    _perturb_lora_b(expert)
    with torch.no_grad():
        policy = expert.velocity(latents, sigma, hidden, pooled)
        with expert.adapter_disabled():
            ref_after = expert.velocity(latents, sigma, hidden, pooled)
            with expert.adapter_disabled():  # nesting keeps the outer reference in place
                pass
            ref_nested = expert.velocity(latents, sigma, hidden, pooled)
        torch.testing.assert_close(expert.velocity(latents, sigma, hidden, pooled), policy, atol=0, rtol=0)
    assert (policy - ref).abs().max() > 1e-4
    torch.testing.assert_close(ref_after, ref, atol=0, rtol=0)
    torch.testing.assert_close(ref_nested, ref, atol=0, rtol=0)


def _plain_dit(expert: FlowTransformerExpert) -> SD3Transformer2DModel:
    with seeded_cpu_init(expert.init_seed):
        return SD3Transformer2DModel(**expert.tiny_config())


def test_dit_loads_from_pipeline_folder_and_adapter_round_trips(tmp_path: Path) -> None:
    tiny = _built(FlowTransformerExpert)
    inputs = _dit_inputs()
    _plain_dit(tiny).save_pretrained(tmp_path / "transformer")
    loaded = _built(lambda: FlowTransformerExpert(pretrained_path=str(tmp_path), subfolder="transformer"))
    with torch.no_grad():
        torch.testing.assert_close(loaded.velocity(*inputs), tiny.velocity(*inputs), atol=0, rtol=0)

    _perturb_lora_b(tiny)
    tiny.save_adapter(str(tmp_path / "lora"))
    latents, sigma, hidden, pooled = inputs
    with torch.no_grad():
        expected = tiny.velocity(*inputs)

        # The SD3 pipeline's reader: lora_state_dict + load_lora_into_transformer with the metadata
        # (which carries lora_alpha; without it the scale would silently be 1).
        state_dict, metadata = StableDiffusion3Pipeline.lora_state_dict(
            str(tmp_path / "lora"), return_lora_metadata=True
        )
        bare = _plain_dit(tiny)
        StableDiffusion3Pipeline.load_lora_into_transformer(state_dict, transformer=bare, metadata=metadata)
        got = bare(latents, hidden, pooled, sigma * 1000, return_dict=False)[0]
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)

        bare = _plain_dit(tiny)
        bare.load_lora_adapter(str(tmp_path / "lora"), use_safetensors=True)
        got = bare(latents, hidden, pooled, sigma * 1000, return_dict=False)[0]
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)

        fresh = _built(FlowTransformerExpert)
        fresh.load_adapter(str(tmp_path / "lora"))
        torch.testing.assert_close(fresh.velocity(*inputs), expected, atol=0, rtol=0)


# ---------------------------------------------------------------- text encoder


def test_dit_qk_norm_reaches_the_attention_and_the_saved_config(tmp_path: Path) -> None:
    expert = FlowTransformerExpert(qk_norm="rms_norm")
    expert.build()
    attn = expert.model.transformer_blocks[0].attn
    assert type(attn.norm_q).__name__ == type(attn.norm_k).__name__ == "RMSNorm"
    plain = FlowTransformerExpert()
    plain.build()
    assert plain.model.transformer_blocks[0].attn.norm_q is None
    expert.model.save_pretrained(tmp_path / "transformer")
    loaded = FlowTransformerExpert(pretrained_path=str(tmp_path), subfolder="transformer")
    loaded.build()
    assert loaded.model.config.qk_norm == "rms_norm"


def test_text_encoder_fixed_length_and_eos_pooling() -> None:
    expert = _built(TextEncoderExpert)
    texts = [*PROMPTS, " ".join(["red circle"] * 40), ""]  # short, truncated, empty (unconditional)
    hidden, pooled = expert.encode(texts)
    assert hidden.shape == (4, 24, expert.hidden_size) and pooled.shape == (4, expert.pooled_size)
    assert not hidden.requires_grad and not pooled.requires_grad
    ids = expert.tokenize(texts)
    eos = expert.tokenizer.eos_token_id
    assert ids.shape == (4, 24) and ids[2, -1] == eos and ids[3, 0] == eos
    assert (ids == eos).sum(1).tolist() == [1, 1, 1, 1]
    # Pooled features are the projection of the hidden state at the end-of-text token.
    eos_pos = (ids == eos).int().argmax(1)
    with torch.no_grad():
        projected = expert.model.text_projection(hidden[torch.arange(4), eos_pos])
    torch.testing.assert_close(projected, pooled)
    alone_hidden, alone_pooled = expert.encode(PROMPTS[:1])
    torch.testing.assert_close(alone_hidden[0], hidden[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(alone_pooled[0], pooled[0], atol=1e-5, rtol=1e-5)


def test_text_encoder_loads_from_pipeline_folder(tmp_path: Path) -> None:
    tiny = _built(TextEncoderExpert)
    tiny.model.save_pretrained(tmp_path / "text_encoder")
    tiny.tokenizer.save_pretrained(tmp_path / "tokenizer")
    loaded = TextEncoderExpert(pretrained_path=str(tmp_path), subfolder="text_encoder", tokenizer_subfolder="tokenizer")
    assert (loaded.hidden_size, loaded.pooled_size) == (32, 32)
    loaded.build()
    assert not any(p.requires_grad for p in loaded.parameters())
    for got, expected in zip(loaded.encode(PROMPTS), tiny.encode(PROMPTS), strict=True):
        torch.testing.assert_close(got, expected, atol=0, rtol=0)


# ---------------------------------------------------------------- VAE


def test_vae_decode_range_and_encode_shape() -> None:
    expert = _built(VAEExpert)
    assert (expert.downsample_factor, expert.latent_channels) == (2, 4)
    latents = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    images = expert.decode(latents)
    assert images.shape == (2, 3, 32, 32) and images.dtype == torch.float32
    assert images.min() >= 0.0 and images.max() <= 1.0 and images.std() > 0
    assert expert.encode(images).shape == (2, 4, 16, 16)


def test_vae_loads_from_pipeline_folder(tmp_path: Path) -> None:
    tiny = _built(VAEExpert)
    tiny.model.save_pretrained(tmp_path / "vae")
    loaded = VAEExpert(pretrained_path=str(tmp_path), subfolder="vae", latent_channels=16)
    assert loaded.latent_channels == 4  # read from the checkpoint, not the tiny-model argument
    loaded.build()
    latents = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(loaded.decode(latents), tiny.decode(latents), atol=0, rtol=0)
