"""Builders of tiny random diffusers pipeline folders for tests, made offline with the real classes.

Each ``make_*_pipeline(path)`` assembles the family's real diffusers pipeline (``StableDiffusion3Pipeline``,
``FluxPipeline``, ``WanPipeline``) from tiny randomly initialised components (widths 8-32, one or two
layers, tokenizers over a few hundred tokens) and ``save_pretrained``s it to ``path``, so the folder has
the same layout and ``model_index.json`` as a hub checkpoint and loads with ``from_pretrained``. Weights
come from a fixed seed without disturbing the caller's RNG; every builder runs in a few seconds on CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLFlux2,
    AutoencoderKLWan,
    FlowMatchEulerDiscreteScheduler,
    Flux2KleinPipeline,
    Flux2Transformer2DModel,
    FluxPipeline,
    FluxTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
    UniPCMultistepScheduler,
    WanPipeline,
    WanTransformer3DModel,
    ZImagePipeline,
    ZImageTransformer2DModel,
)
from tokenizers import AddedToken
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3Model,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
    UMT5Config,
    UMT5EncoderModel,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode

from tests.chat_lm import CHAT_SPECIAL_TOKENS, THINK_TOKENS
from unirl_pl.experts._common import seeded_cpu_init
from unirl_pl.experts.tokenizer import DEFAULT_WORDS, build_word_tokenizer

# CLIP's context length: the SD3 and FLUX pipelines pad CLIP prompts to ``tokenizer.model_max_length``.
CLIP_LENGTH = 77
# Pixel sizes the tiny pipelines are meant for (any multiple of the latent grid works).
IMAGE_SIZE = 32
VIDEO_SIZE = 16
VIDEO_FRAMES = 5
_WORDS = "a an the red green blue cat dog circle square photo of on left right big small".split()


def clip_tokenizer() -> CLIPTokenizer:
    """A byte-level CLIP BPE tokenizer with no merges: every byte is a token (with and without the
    end-of-word suffix), so any text tokenizes without an unknown token, all offline."""
    symbols = list(bytes_to_unicode().values())
    vocab = {token: i for i, token in enumerate([*symbols, *(s + "</w>" for s in symbols)])}
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=CLIP_LENGTH)


def t5_tokenizer() -> T5Tokenizer:
    """A T5 unigram tokenizer over a few words and single letters (``<pad>``=0, ``</s>``=1, ``<unk>``=2,
    no sentinel tokens), used for T5 and UMT5 encoders alike."""
    pieces = ["<pad>", "</s>", "<unk>", "▁"]
    pieces += [f"▁{word}" for word in _WORDS] + list("abcdefghijklmnopqrstuvwxyz")
    vocab = [(piece, 0.0 if i < 3 else -float(len(piece) < 3) - 1.0) for i, piece in enumerate(pieces)]
    return T5Tokenizer(vocab=vocab, extra_ids=0)


def _clip(hidden: int, projection: bool, seed: int) -> CLIPTextModel | CLIPTextModelWithProjection:
    tokenizer = clip_tokenizer()
    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        projection_dim=hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=CLIP_LENGTH,
        # CLIP pools at the first end-of-text token; the legacy id 2 would switch it to argmax pooling.
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with seeded_cpu_init(seed):
        return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config).eval()


def _t5_config(cls: type[T5Config], d_model: int) -> T5Config:
    return cls(
        vocab_size=len(t5_tokenizer()),
        d_model=d_model,
        d_kv=8,
        d_ff=2 * d_model,
        num_layers=1,
        num_heads=2,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )


def _image_vae(seed: int) -> AutoencoderKL:
    """A 2x-downsampling ``AutoencoderKL`` with 4 latent channels and a non-trivial scale and shift."""
    with seeded_cpu_init(seed):
        return AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=["DownEncoderBlock2D"] * 2,
            up_block_types=["UpDecoderBlock2D"] * 2,
            block_out_channels=[8, 8],
            layers_per_block=1,
            latent_channels=4,
            norm_num_groups=4,
            # Not 1 and 0, so that decode's un-scaling (latents / scaling + shift) is exercised.
            scaling_factor=1.5,
            shift_factor=0.1,
            use_quant_conv=False,
            use_post_quant_conv=False,
        ).eval()


def make_sd3_pipeline(path: str | Path, with_t5: bool = True, seed: int = 0) -> Path:
    """Save a tiny ``StableDiffusion3Pipeline`` (two CLIPs of widths 8 and 16, a T5 of width 32 unless
    ``with_t5`` is false, a 2x VAE, a one-layer MMDiT) to ``path`` and return it."""
    with seeded_cpu_init(seed):
        transformer = SD3Transformer2DModel(
            sample_size=IMAGE_SIZE // 2,
            patch_size=2,
            in_channels=4,
            out_channels=4,
            num_layers=1,
            attention_head_dim=8,
            num_attention_heads=4,
            joint_attention_dim=32,
            caption_projection_dim=32,
            pooled_projection_dim=8 + 16,
            pos_embed_max_size=IMAGE_SIZE,
        )
        t5 = T5EncoderModel(_t5_config(T5Config, 32)).eval() if with_t5 else None
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=_image_vae(seed + 1),
        text_encoder=_clip(8, True, seed + 2),
        tokenizer=clip_tokenizer(),
        text_encoder_2=_clip(16, True, seed + 3),
        tokenizer_2=clip_tokenizer(),
        text_encoder_3=t5,
        tokenizer_3=t5_tokenizer() if with_t5 else None,
    )
    pipe.save_pretrained(str(path))
    return Path(path)


def flux_components(guidance_embeds: bool, seed: int) -> dict[str, object]:
    """The tiny FLUX.1 components but the scheduler, as ``FluxPipeline`` and ``FluxKontextPipeline`` take them:
    CLIP width 16, T5 width 32, a 2x VAE with 4 channels, a DiT with one double and one single block (the
    guidance embedding with ``guidance_embeds``), from ``seed`` on."""
    with seeded_cpu_init(seed):
        transformer = FluxTransformer2DModel(
            patch_size=1,
            in_channels=4 * 4,  # 2x2-packed 4-channel latents
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            pooled_projection_dim=16,
            guidance_embeds=guidance_embeds,
            axes_dims_rope=(4, 6, 6),
        )
        t5 = T5EncoderModel(_t5_config(T5Config, 32)).eval()
    return {
        "vae": _image_vae(seed + 1),
        "text_encoder": _clip(16, False, seed + 2),
        "tokenizer": clip_tokenizer(),
        "text_encoder_2": t5,
        "tokenizer_2": t5_tokenizer(),
        "transformer": transformer,
    }


def make_flux_pipeline(path: str | Path, guidance_embeds: bool = True, seed: int = 0) -> Path:
    """Save a tiny ``FluxPipeline`` (:func:`flux_components`; ``guidance_embeds`` true is FLUX.1-dev-like, false
    schnell-like) and return it."""
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0), **flux_components(guidance_embeds, seed))
    pipe.save_pretrained(str(path))
    return Path(path)


# FLUX.2 [klein]'s scheduler (FLUX.2's): flow-matching Euler shifted by the mu the pipeline computes
# (``compute_empirical_mu``), exponential time shift.
KLEIN_SCHEDULER = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "time_shift_type": "exponential",
    "use_dynamic_shifting": True,
}

# Qwen3's chat template as Flux2KleinPipeline uses it: ChatML turns without a default system turn, and the
# empty think block that ``enable_thinking=False`` appends after the generation prompt.
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)
# Enough Qwen3 layers for the pipeline's default feature layers (9, 18, 27): hidden_states has layers + 1 entries.
KLEIN_TEXT_LAYERS = 28
KLEIN_TEXT_WIDTH = 16


def qwen3_tokenizer() -> object:
    """The offline word tokenizer (right padding, as Qwen's) with ChatML special tokens, the think tags and
    :data:`QWEN3_CHAT_TEMPLATE`."""
    tokenizer = build_word_tokenizer(words=(*DEFAULT_WORDS, *_WORDS, "user", "assistant"), padding_side="right")
    tokenizer.add_special_tokens({"additional_special_tokens": list(CHAT_SPECIAL_TOKENS)})
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    return tokenizer


def make_flux2_klein_pipeline(path: str | Path, distilled: bool = False, seed: int = 0) -> Path:
    """Save a tiny ``Flux2KleinPipeline`` and return it: a 28-layer Qwen3 of width 16 (so the default
    feature layers 9, 18, 27 exist; features 3 x 16 wide), a 2x ``AutoencoderKLFlux2`` with 4 latent
    channels (16 after its 2x2 patchify) and non-trivial batch-norm statistics, a Flux2 DiT with one double
    and one single block, and FLUX.2's dynamically shifting scheduler. ``distilled`` writes
    ``is_distilled: true`` (FLUX.2-klein-4B-like, no guidance); the default is the base model (true CFG)."""
    with seeded_cpu_init(seed):
        transformer = Flux2Transformer2DModel(
            patch_size=1,
            in_channels=4 * 4,  # the VAE's 4 channels after its 2x2 patchify
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=3 * KLEIN_TEXT_WIDTH,
            timestep_guidance_channels=16,
            axes_dims_rope=(4, 4, 4, 4),
            guidance_embeds=False,
        )
        vae = AutoencoderKLFlux2(
            down_block_types=["DownEncoderBlock2D"] * 2,
            up_block_types=["UpDecoderBlock2D"] * 2,
            block_out_channels=[8, 8],
            layers_per_block=1,
            latent_channels=4,
            norm_num_groups=4,
        ).eval()
        # Not 0 and 1, so that decode's batch-norm denormalisation is exercised.
        vae.bn.running_mean.copy_(0.3 * torch.randn(vae.bn.num_features))
        vae.bn.running_var.copy_(0.5 + torch.rand(vae.bn.num_features))
        tokenizer = qwen3_tokenizer()
        text_encoder = Qwen3ForCausalLM(
            Qwen3Config(
                vocab_size=len(tokenizer),
                hidden_size=KLEIN_TEXT_WIDTH,
                intermediate_size=32,
                num_hidden_layers=KLEIN_TEXT_LAYERS,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=8,
                max_position_embeddings=512,
                tie_word_embeddings=True,
                pad_token_id=tokenizer.pad_token_id,
            )
        ).eval()
    pipe = Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**KLEIN_SCHEDULER),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        is_distilled=distilled,
    )
    pipe.save_pretrained(str(path))
    return Path(path)


def _wan_transformer(in_channels: int = 4, num_layers: int = 1, head_dim: int = 12) -> WanTransformer3DModel:
    """A ``WanTransformer3DModel`` of ``num_layers`` layers (patch (1, 2, 2), 2 heads of ``head_dim``: width 24 by
    default, text width 32); seed the caller."""
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=head_dim,
        in_channels=in_channels,
        out_channels=in_channels,
        text_dim=32,
        freq_dim=32,
        ffn_dim=32,
        num_layers=num_layers,
        rope_max_seq_len=32,
    )


# A Wan2.1-style causal 3D VAE: 4x spatial and 2x temporal compression, 4 latent channels.
_WAN21_VAE = {
    "base_dim": 8,
    "z_dim": 4,
    "dim_mult": [1, 1, 1],
    "num_res_blocks": 1,
    "temperal_downsample": [False, True],
    "latents_mean": [0.1, -0.2, 0.3, 0.0],
    "latents_std": [1.5, 0.5, 2.0, 1.0],
    "scale_factor_temporal": 2,
    "scale_factor_spatial": 4,
}


def _save_wan(
    path: str | Path,
    seed: int,
    vae: dict,
    *,
    in_channels: int = 4,
    num_layers: int = 1,
    head_dim: int = 12,
    two_experts: bool = False,
    scheduler: object = None,
    **config: object,
) -> Path:
    """Build the Wan parts from one seeded stream (transformer, UMT5, VAE, then ``transformer_2`` when
    ``two_experts``, so it differs from the first), assemble ``WanPipeline`` with the pipeline ``config``
    (``boundary_ratio``, ``expand_timesteps``) and ``scheduler`` (default: flow-matching Euler, shift 3)
    and save it. ``in_channels``, ``num_layers`` and ``head_dim`` shape the transformer(s)."""
    with seeded_cpu_init(seed):
        transformer = _wan_transformer(in_channels, num_layers, head_dim)
        text_encoder = UMT5EncoderModel(_t5_config(UMT5Config, 32)).eval()
        parts = {"vae": AutoencoderKLWan(**vae).eval()}
        if two_experts:
            parts["transformer_2"] = _wan_transformer(in_channels, num_layers, head_dim)
    pipe = WanPipeline(
        tokenizer=t5_tokenizer(),
        text_encoder=text_encoder,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0) if scheduler is None else scheduler,
        transformer=transformer,
        **parts,
        **config,
    )
    pipe.save_pretrained(str(path))
    return Path(path)


def make_wan_pipeline(path: str | Path, seed: int = 0) -> Path:
    """Save a tiny Wan2.1-style ``WanPipeline`` (UMT5 width 32, a causal 3D VAE with 4x spatial and 2x
    temporal compression and 4 latent channels, a one-layer ``WanTransformer3DModel``) and return it."""
    return _save_wan(path, seed, _WAN21_VAE)


WAN22_BOUNDARY_RATIO = 0.875
"""Wan2.2-T2V-A14B's ``boundary_ratio``: the high-noise expert denoises timesteps >= 875 of 1000."""


def wan22_scheduler(flow_shift: float = 3.0) -> UniPCMultistepScheduler:
    """The scheduler the Wan2.2 Diffusers folders ship: UniPC on flow sigmas, flow prediction, ``flow_shift`` 3
    (T2V-A14B) or :data:`WAN22_TI2V_FLOW_SHIFT` (TI2V-5B)."""
    return UniPCMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction", flow_shift=flow_shift)


def make_wan22_pipeline(
    path: str | Path, seed: int = 0, boundary_ratio: float = WAN22_BOUNDARY_RATIO, *, unipc: bool = False
) -> Path:
    """Save a tiny Wan2.2-A14B-style two-expert ``WanPipeline`` and return it: the parts of
    ``make_wan_pipeline`` (same weights for the same seed) plus a differently initialised one-layer
    ``transformer_2`` (the low-noise expert) and ``boundary_ratio`` in ``model_index.json``, as diffusers
    saves Wan2.2-T2V-A14B. The real folder ships a ``UniPCMultistepScheduler`` with flow sigmas
    (:func:`wan22_scheduler`), which ``unipc`` gives (a ``rollout.shift`` then replaces its ``flow_shift``:
    shift 12 at 4 steps is 1, .973, .923, .8006, 0); by default the tiny one keeps the flow-matching Euler
    scheduler of the Wan2.1 builder, whose steps an Euler loop reproduces exactly."""
    scheduler = wan22_scheduler() if unipc else None
    return _save_wan(path, seed, _WAN21_VAE, two_experts=True, scheduler=scheduler, boundary_ratio=boundary_ratio)


# Wan2.2-TI2V-5B's VAE layout (Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json, as diffusers'
# scripts/convert_wan_to_diffusers.py writes it: residual blocks, a 2x2 pixel patchify to 12 channels, three
# downsamplings of which the last two are temporal, so 16x spatial and 4x temporal compression, 48 latent channels)
# at a tiny width (base 8 where the real one has 160 and 256); non-trivial per-channel statistics, so that decode's
# un-normalisation is exercised on all 48 channels.
WAN22_TI2V_VAE = {
    "base_dim": 8,
    "decoder_base_dim": 8,
    "z_dim": 48,
    "dim_mult": [1, 2, 2, 2],
    "num_res_blocks": 1,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
    "dropout": 0.0,
    "is_residual": True,
    "in_channels": 12,
    "out_channels": 12,
    "patch_size": 2,
    "scale_factor_temporal": 4,
    "scale_factor_spatial": 16,
    "latents_mean": [round(0.05 * (i % 9 - 4), 2) for i in range(48)],
    "latents_std": [round(0.4 + 0.1 * (i % 13), 2) for i in range(48)],
}
WAN22_TI2V_FLOW_SHIFT = 5.0
"""The ``flow_shift`` of Wan2.2-TI2V-5B-Diffusers' UniPC scheduler (diffusers' conversion script sets 5.0 for TI2V)."""


def make_wan22_ti2v_pipeline(path: str | Path, seed: int = 0) -> Path:
    """Save a tiny Wan2.2-TI2V-5B-style ``WanPipeline`` in the published layout and return it: one transformer
    (2 layers of width 32, 48 latent channels in and out), ``expand_timesteps: true`` in ``model_index.json`` (one
    timestep per latent token), the Wan2.2 VAE layout (:data:`WAN22_TI2V_VAE`: 48 channels, 16x spatial, 4x
    temporal), the UniPC scheduler the real folder ships (flow shift 5) and the UMT5 of the other Wan builders.
    Sizes: multiples of 32 pixels (16x VAE, 2x2 patches), ``num_frames`` 1 + 4k."""
    scheduler = wan22_scheduler(WAN22_TI2V_FLOW_SHIFT)
    shape = {"in_channels": 48, "num_layers": 2, "head_dim": 16}
    return _save_wan(path, seed, WAN22_TI2V_VAE, **shape, scheduler=scheduler, expand_timesteps=True)


# Z-Image's scheduler (Tongyi-MAI/Z-Image and Z-Image-Turbo scheduler/scheduler_config.json): a fixed shift, 6.0 for
# the base model and 3.0 for Turbo, no dynamic shifting.
ZIMAGE_SCHEDULER = {"num_train_timesteps": 1000, "use_dynamic_shifting": False, "shift": 6.0}
ZIMAGE_TURBO_SHIFT = 3.0
ZIMAGE_TEXT_WIDTH = 16


def make_zimage_pipeline(path: str | Path, turbo: bool = False, seed: int = 0) -> Path:
    """Save a tiny ``ZImagePipeline`` in the published layout and return it: a 2-layer ``Qwen3Model`` of width 16
    (``model_index.json`` names ``Qwen3Model``, as the published folders do) with the Qwen3 chat template, a 2x
    ``AutoencoderKL`` with 4 latent channels and a non-trivial scale and shift, a ``ZImageTransformer2DModel`` of
    width 32 (2 heads of 16, RoPE axes 4/6/6, two main layers and one layer in each refiner), and Z-Image's
    scheduler: shift 6.0, or with ``turbo`` Z-Image-Turbo's 3.0 (which is how the generator tells Turbo apart)."""
    with seeded_cpu_init(seed):
        transformer = ZImageTransformer2DModel(
            all_patch_size=(2,),
            all_f_patch_size=(1,),
            in_channels=4,
            dim=32,
            n_layers=2,
            n_refiner_layers=1,
            n_heads=2,
            n_kv_heads=2,
            cap_feat_dim=ZIMAGE_TEXT_WIDTH,
            axes_dims=[4, 6, 6],
            axes_lens=[1024, 64, 64],
        )
        vae = _image_vae(seed)
        tokenizer = qwen3_tokenizer()
        text_encoder = Qwen3Model(
            Qwen3Config(
                vocab_size=len(tokenizer),
                hidden_size=ZIMAGE_TEXT_WIDTH,
                intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=8,
                max_position_embeddings=1024,
                pad_token_id=tokenizer.pad_token_id,
            )
        ).eval()
    shift = ZIMAGE_TURBO_SHIFT if turbo else ZIMAGE_SCHEDULER["shift"]
    pipe = ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**{**ZIMAGE_SCHEDULER, "shift": shift}),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
    pipe.save_pretrained(str(path))
    return Path(path)


# Qwen-Image's scheduler (Qwen/Qwen-Image scheduler/scheduler_config.json): flow-matching Euler with dynamic
# shifting by the exponential time shift, mu from the image's token count (0.5 at 256 tokens to 0.9 at 8192),
# then stretched so the last sigma before 0 is shift_terminal.
QWENIMAGE_SCHEDULER = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
    "use_dynamic_shifting": True,
}
QWENIMAGE_TEXT_WIDTH = 64


def qwenimage_tokenizer() -> object:
    """The offline word tokenizer (right padding) over QwenImagePipeline's prompt template and a few words, with
    Qwen2.5-VL's ChatML and vision special tokens and the newline as a token of its own, so the template's
    system turn and user header are exactly the pipeline's ``prompt_template_encode_start_idx`` (34) tokens, as
    Qwen2.5-VL's BPE makes them."""
    from tests.chat_lm import _pieces
    from tests.vlm_lm import CHAT_TOKENS, VISION_TOKENS
    from unirl_pl.generators.qwenimage import PROMPT_TEMPLATE, TEMPLATE_TOKENS

    words = (*DEFAULT_WORDS, *_WORDS, *_pieces(PROMPT_TEMPLATE.replace("{}", " ")))
    tokenizer = build_word_tokenizer(words=tuple(dict.fromkeys(words)), padding_side="right")
    tokenizer.add_special_tokens({"additional_special_tokens": [*CHAT_TOKENS, *VISION_TOKENS]})
    tokenizer.add_tokens([AddedToken("\n", special=False, normalized=False)])
    tokenizer.pad_token = "<|endoftext|>"
    prefix = PROMPT_TEMPLATE.split("{}")[0]
    assert len(tokenizer(prefix).input_ids) == TEMPLATE_TOKENS, tokenizer.tokenize(prefix)
    return tokenizer


def qwenimage_components(
    tokenizer: PreTrainedTokenizerFast, seed: int, patch: int = 14, merge: int = 2, **transformer: object
) -> dict[str, object]:
    """The tiny Qwen-Image components the text-to-image and edit pipelines share, from ``seed`` on: a 2-layer
    Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``, text width 64, a 2-block vision tower of ``patch`` and
    ``merge``) over ``tokenizer``, a 4x ``AutoencoderKLQwenImage`` with 4 latent channels and non-trivial
    ``latents_mean``/``latents_std``, and a 2-layer ``QwenImageTransformer2DModel`` of width 32 (2 heads of 16,
    RoPE axes 4/6/6; ``transformer`` adds to its settings) reading the 64-wide text features."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from tests.vlm_lm import _ids, _text_config

    with seeded_cpu_init(seed):
        dit = QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=4 * 4,  # 2x2-packed 4-channel latents
            out_channels=4,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=QWENIMAGE_TEXT_WIDTH,
            axes_dims_rope=(4, 6, 6),
            **transformer,
        )
        vae = AutoencoderKLQwenImage(
            base_dim=8,
            z_dim=4,
            dim_mult=[1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False, True],
            # Not 0 and 1, so that decode's un-normalisation is exercised.
            latents_mean=[0.1, -0.2, 0.3, 0.0],
            latents_std=[1.5, 0.5, 2.0, 1.0],
        ).eval()
        vision = {
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": patch,
            "spatial_merge_size": merge,
            "temporal_patch_size": 2,
            "window_size": 56,
            "fullatt_block_indexes": [1],
            "out_hidden_size": QWENIMAGE_TEXT_WIDTH,
        }
        config = Qwen2_5_VLConfig(text_config=_text_config(tokenizer), vision_config=vision, **_ids(tokenizer))
        text_encoder = Qwen2_5_VLForConditionalGeneration(config).eval()
    return {"vae": vae, "text_encoder": text_encoder, "tokenizer": tokenizer, "transformer": dit}


def make_qwenimage_pipeline(path: str | Path, seed: int = 0) -> Path:
    """Save a tiny ``QwenImagePipeline`` in the published layout and return it: :func:`qwenimage_components` over
    :func:`qwenimage_tokenizer` and Qwen-Image's scheduler (:data:`QWENIMAGE_SCHEDULER`)."""
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWENIMAGE_SCHEDULER),
        **qwenimage_components(qwenimage_tokenizer(), seed),
    )
    pipe.save_pretrained(str(path))
    return Path(path)


def random_latents(shape: tuple[int, ...], batch: int, seed: int = 0) -> torch.Tensor:
    """Standard-normal float32 latents (batch, *shape) from a private generator."""
    return torch.randn((batch, *shape), generator=torch.Generator().manual_seed(seed))


if __name__ == "__main__":
    # python -m tests.pipelines {sd3,flux,wan,wan22,wan22_ti2v,flux2_klein,flux2_klein_distilled,zimage,zimage_turbo,
    # qwenimage,flux_kontext,qwenimage_edit_plus,qwenimage_edit_plus_2511}
    # FOLDER: a tiny random pipeline folder for CPU runs of the family recipes (the recipes' headers list the
    # overrides that fit these sizes).
    import sys

    from tests.pipelines_edit import make_flux_kontext_pipeline
    from tests.pipelines_qwen_edit import make_qwenimage_edit_plus_pipeline

    builders = {
        "sd3": make_sd3_pipeline,
        "flux": make_flux_pipeline,
        "wan": make_wan_pipeline,
        "wan22": lambda folder: make_wan22_pipeline(folder, unipc=True),  # the real folder's UniPC scheduler
        "wan22_ti2v": make_wan22_ti2v_pipeline,
        "flux2_klein": make_flux2_klein_pipeline,
        "flux2_klein_distilled": lambda folder: make_flux2_klein_pipeline(folder, distilled=True),
        "zimage": make_zimage_pipeline,
        "zimage_turbo": lambda folder: make_zimage_pipeline(folder, turbo=True),
        "qwenimage": make_qwenimage_pipeline,
        "flux_kontext": make_flux_kontext_pipeline,
        "qwenimage_edit_plus": make_qwenimage_edit_plus_pipeline,
        "qwenimage_edit_plus_2511": lambda folder: make_qwenimage_edit_plus_pipeline(folder, zero_cond_t=True),
    }
    if len(sys.argv) != 3 or sys.argv[1] not in builders:
        sys.exit(f"usage: python -m tests.pipelines {{{','.join(builders)}}} FOLDER")
    print(builders[sys.argv[1]](sys.argv[2]))


def with_scheduler(folder: Path, config: dict) -> Path:
    """Give a saved pipeline folder another scheduler: its config file and its class in model_index.json."""
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(config))
    index = json.loads((folder / "model_index.json").read_text())
    index["scheduler"] = ["diffusers", config["_class_name"]]
    (folder / "model_index.json").write_text(json.dumps(index))
    return folder


# FLUX.1-dev's shipped scheduler config (the keys that shape the schedule; the rest are class defaults).
FLUX_DEV_SCHEDULER = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
}
