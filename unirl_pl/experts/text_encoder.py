"""The frozen text encoder: a ``transformers`` CLIP text model with projection."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    CLIPTextConfig,
    CLIPTextModelWithProjection,
    PreTrainedTokenizerBase,
)

from unirl_pl.experts._common import check_divisible, check_positive, freeze, seeded_cpu_init
from unirl_pl.experts.base import FrozenExpert
from unirl_pl.experts.tokenizer import build_word_tokenizer, load_tokenizer, special_token_ids
from unirl_pl.manifest import verify_assets


class TextEncoderExpert(FrozenExpert):
    """Frozen text encoder giving the generator its per-token and pooled prompt features.

    The constructor only records and validates its arguments; ``build()`` creates the tokenizer and a
    ``CLIPTextModelWithProjection``: a tiny one over the offline word tokenizer, initialized from
    ``init_seed`` without touching the global RNG, or one loaded from ``pretrained_path`` (e.g. a
    diffusers pipeline folder with ``subfolder="text_encoder"`` and ``tokenizer_subfolder="tokenizer"``).
    Every text is encoded to exactly ``max_length`` tokens (truncated, end-of-text appended, right
    padded) so features from different calls and batches concatenate. The model has no trainable
    weights and stays in eval mode even when its parent is put in train mode.

    Args:
        pretrained_path: Local folder or hub id holding the CLIP text model and tokenizer; ``None``
            builds the tiny model.
        subfolder: Subfolder of ``pretrained_path`` with the text model (``"text_encoder"`` in a
            pipeline folder); ``None`` means the path itself.
        tokenizer_subfolder: Subfolder with the tokenizer (``"tokenizer"`` in a pipeline folder);
            ``None`` means the same folder as the model.
        hidden_size: Tiny model only: width of the per-token features (the DiT's ``joint_attention_dim``).
        num_layers: Tiny model only: number of encoder layers.
        num_attention_heads: Tiny model only: heads; must divide ``hidden_size``.
        intermediate_size: Tiny model only: width of the MLP.
        projection_dim: Tiny model only: width of the pooled feature (the DiT's ``pooled_projection_dim``).
        max_length: Tokens per text, end-of-text included; at most the model's position limit.
        init_seed: Seed of the tiny model's weights.
        dtype: Dtype of the weights: ``float32``, ``bfloat16`` or ``float16``.
    """

    unbuilt_use = unbuilt_tokenizer_use = "encoding"

    def __init__(
        self,
        pretrained_path: str | None = None,
        subfolder: str | None = None,
        tokenizer_subfolder: str | None = None,
        hidden_size: int = 32,
        num_layers: int = 2,
        num_attention_heads: int = 2,
        intermediate_size: int = 64,
        projection_dim: int = 32,
        max_length: int = 24,
        init_seed: int = 1,
        dtype: str = "float32",
    ) -> None:
        super().__init__(pretrained_path, dtype, init_seed)
        check_positive(
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_attention_heads=num_attention_heads,
            intermediate_size=intermediate_size,
            projection_dim=projection_dim,
        )
        if max_length < 2:
            raise ValueError(f"max_length must be >= 2 (a token and end-of-text), got {max_length}")
        check_divisible(hidden_size=hidden_size, num_attention_heads=num_attention_heads)
        self.subfolder, self.tokenizer_subfolder = subfolder, tokenizer_subfolder
        self._hidden_size, self.num_layers, self.num_attention_heads = hidden_size, num_layers, num_attention_heads
        self.intermediate_size, self.projection_dim = intermediate_size, projection_dim
        self.max_length = max_length
        self.tokenizer: PreTrainedTokenizerBase | None = None
        self.model: CLIPTextModelWithProjection | None = None

    def tiny_config(self, tokenizer: PreTrainedTokenizerBase) -> CLIPTextConfig:
        """The ``CLIPTextConfig`` of the tiny model built over ``tokenizer`` when there is no path."""
        return CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=self._hidden_size,
            intermediate_size=self.intermediate_size,
            projection_dim=self.projection_dim,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads,
            max_position_embeddings=self.max_length,
            # CLIP pools at the first ``eos_token_id``; the legacy value 2 would switch it to argmax.
            **special_token_ids(tokenizer),
        )

    def build(self) -> None:
        """Create the tokenizer and the frozen model; a second call is a no-op."""
        if self.is_built:
            return
        if self.pretrained_path is None:
            tokenizer = build_word_tokenizer(padding_side="right")
            with seeded_cpu_init(self.init_seed):
                model = CLIPTextModelWithProjection(self.tiny_config(tokenizer)).to(self.dtype)
        else:
            # Before the tokenizer loads: a deleted shipped file is then named by the manifest, not a loader error.
            folders = {self.subfolder or "", self.tokenizer_subfolder or self.subfolder or ""}
            verify_assets([Path(self.pretrained_path) / sub for sub in sorted(folders)], component=type(self).__name__)
            tokenizer = load_tokenizer(self.pretrained_path, self.tokenizer_subfolder or self.subfolder)
            kwargs = {"subfolder": self.subfolder} if self.subfolder else {}
            model = CLIPTextModelWithProjection.from_pretrained(self.pretrained_path, dtype=self.dtype, **kwargs)
        limit = model.config.max_position_embeddings
        if self.max_length > limit:
            raise ValueError(f"max_length ({self.max_length}) exceeds the text model's {limit} positions")
        if tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
            raise ValueError("the text tokenizer needs both an eos and a pad token")
        self.tokenizer = tokenizer
        self.model = freeze(model)

    def tokenize(self, texts: list[str]) -> torch.Tensor:
        """Token ids (B, max_length): each text truncated, ending in end-of-text, then right-padded.

        The end-of-text token is appended here when the tokenizer does not add it itself (the word
        tokenizer adds no specials; CLIP's adds ``<|startoftext|>`` and ``<|endoftext|>``), because CLIP
        pools the features at the first end-of-text position.
        """
        tokenizer = self._require_tokenizer()
        eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
        rows = []
        for ids in tokenizer(list(texts), truncation=True, max_length=self.max_length)["input_ids"]:
            if eos not in ids:
                ids = [*ids[: self.max_length - 1], eos]
            rows.append(ids + [pad] * (self.max_length - len(ids)))
        return torch.tensor(rows, dtype=torch.long)

    @torch.no_grad()
    def encode(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode ``texts`` to ``(hidden, pooled)``: per-token features (B, max_length, hidden_size) from
        the last layer and pooled projected features (B, pooled_size), without gradients."""
        model = self._require_built()
        input_ids = self.tokenize(texts).to(model.device)
        # No attention mask, as in the diffusers SD3 pipeline: causal attention already keeps the
        # padding out of every position up to end-of-text, and the features then match that pipeline.
        output = model(input_ids=input_ids)
        return output.last_hidden_state, output.text_embeds

    def _config(self) -> CLIPTextConfig:
        if self.model is not None:
            return self.model.config
        if self.pretrained_path is None:
            return CLIPTextConfig(hidden_size=self._hidden_size, projection_dim=self.projection_dim)
        kwargs = {"subfolder": self.subfolder} if self.subfolder else {}
        return CLIPTextConfig.from_pretrained(self.pretrained_path, **kwargs)

    def _config_value(self, name: str) -> int:
        return int(getattr(self._config(), name))

    @property
    def hidden_size(self) -> int:
        """Width of the per-token features (read from the checkpoint's config when loading one)."""
        return self._config_value("hidden_size")

    @property
    def pooled_size(self) -> int:
        """Width of the pooled features (read from the checkpoint's config when loading one)."""
        return self._config_value("projection_dim")
