"""The lifecycle every expert shares: record and validate arguments, ``build()`` the model later, refuse
use before that, keep frozen models in eval mode, and attach, bypass and validate a LoRA adapter."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import torch
from peft import LoraConfig
from peft.tuners.tuners_utils import BaseTunerLayer

from unirl_pl.experts._common import check_positive, resolve_dtype
from unirl_pl.experts.finetune import adapt, check_finetune, keep_reference_eval, reference_swapped, require_lora
from unirl_pl.manifest import verify_assets

# Both keep LoRA ``B`` at zero, so the adapted model starts exactly equal to the reference policy;
# ``gaussian`` (A ~ N(0, 1/r)) is what Flow-GRPO uses.
LORA_INITS: dict[str, bool | str] = {"gaussian": "gaussian", "default": True}


def check_lora_args(lora_rank: int, lora_alpha: float, lora_target_modules: list[str] | None) -> None:
    """Raise ``ValueError`` unless ``lora_rank >= 1``, ``lora_alpha > 0`` and ``lora_target_modules`` is
    ``None`` (the default targets) or names at least one module."""
    if lora_rank < 1:
        raise ValueError(f"lora_rank must be >= 1, got {lora_rank}")
    check_positive(lora_alpha=lora_alpha)
    if lora_target_modules is not None and not lora_target_modules:
        raise ValueError("lora_target_modules must name at least one module (or be null for the default)")


def lora_layers(model: torch.nn.Module) -> list[BaseTunerLayer]:
    """The LoRA layers of ``model``, found once and cached on it (the adapter toggle runs every step)."""
    cached = model.__dict__.get("_unirl_lora_layers")
    if cached is None:
        cached = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
        model.__dict__["_unirl_lora_layers"] = cached
    return cached


@contextmanager
def adapter_bypassed(model: torch.nn.Module) -> Iterator[None]:
    """Context in which ``model`` runs without its LoRA adapter, i.e. is the frozen reference policy.

    Only the LoRA layers are switched (peft's model-level toggles walk every module and check versions on
    each call, milliseconds per SDE step). Every ``requires_grad`` flag of those layers is the same
    afterwards (peft's toggle sets them as a side effect); nested use is a no-op inside.
    """
    layers = lora_layers(model)
    if not layers or any(layer.disable_adapters for layer in layers):  # nested: the outer context re-enables
        yield
        return
    flags = [(param, param.requires_grad) for layer in layers for param in layer.parameters()]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        # Re-enable first (peft turns the active adapter's grads on), then restore the flags.
        for layer in layers:
            layer.enable_adapters(True)
        for param, flag in flags:
            param.requires_grad_(flag)


def attach_diffusers_lora(model: Any, config: LoraConfig) -> Any:
    """Freeze a diffusers ``model``, add the LoRA adapter of ``config`` in place and return the model.
    Call it inside ``seeded_cpu_init`` so the LoRA init is seeded."""
    model.requires_grad_(False)
    model.add_adapter(config)
    # Optimizer states and small LoRA updates need float32 even when the base runs in bf16; peft
    # casts activations to the LoRA weight dtype and the result back.
    for param in model.parameters():
        if param.requires_grad:
            param.data = param.data.float()
    return model


class Expert(torch.nn.Module):
    """An expert whose constructor only records (and validates) its arguments and whose ``build()``
    creates ``model`` later (from the LightningModule's ``configure_model``), so a recipe can be parsed
    and checked without allocating weights. ``pretrained_path``, ``dtype`` (a name, resolved here) and
    ``init_seed`` are common to every expert; ``model`` is ``None`` until ``build()``."""

    # What the model (tokenizer) is needed for, in the error raised when it is used before ``build()``.
    unbuilt_use: ClassVar[str] = "using the model"
    unbuilt_tokenizer_use: ClassVar[str] = "using the tokenizer"

    def __init__(self, pretrained_path: str | None = None, dtype: str = "float32", init_seed: int = 0) -> None:
        super().__init__()
        self.pretrained_path = pretrained_path
        self.dtype = resolve_dtype(dtype)
        self.init_seed = init_seed
        self.model: Any = None

    @property
    def is_built(self) -> bool:
        """Whether ``build()`` has created the model (and tokenizer, for the experts that have one)."""
        return self.model is not None

    def build(self) -> None:
        """Create the model; a second call is a no-op."""
        raise NotImplementedError

    def _diffusers_model(self, cls: Any) -> Any:
        """A diffusers model: ``cls.from_pretrained(pretrained_path, subfolder=self.subfolder)`` in ``dtype``,
        or without a path the tiny ``cls(**self.tiny_config())`` cast to ``dtype`` (seed it by calling
        this inside ``seeded_cpu_init``)."""
        if self.pretrained_path is not None:
            # ``torch_dtype`` (not ``.to``) keeps the modules diffusers pins to float32 in float32.
            verify_assets(Path(self.pretrained_path) / (self.subfolder or ""), component=type(self).__name__)
            return cls.from_pretrained(self.pretrained_path, subfolder=self.subfolder, torch_dtype=self.dtype)
        model = cls(**self.tiny_config())
        return model if self.dtype == torch.float32 else model.to(self.dtype)

    def _not_built(self, use: str | None = None) -> RuntimeError:
        return RuntimeError(f"{type(self).__name__}.build() must be called before {use or self.unbuilt_use}")

    def _require_built(self) -> Any:
        """The built model, or ``RuntimeError`` when ``build()`` has not run yet."""
        if self.model is None:
            raise self._not_built()
        return self.model

    def _require_tokenizer(self) -> Any:
        """The built tokenizer (experts that read text), or ``RuntimeError`` before ``build()``."""
        tokenizer = getattr(self, "tokenizer", None)
        if tokenizer is None:
            raise self._not_built(self.unbuilt_tokenizer_use)
        return tokenizer


class FrozenExpert(Expert):
    """An expert with no trainable weights: ``build()`` freezes the model, which stays in eval mode even
    when the parent module is put in train mode."""

    def train(self, mode: bool = True) -> FrozenExpert:
        """Keep the frozen model in eval mode whatever mode the parent module is switched to."""
        super().train(mode)
        if self.model is not None:
            self.model.eval()
        return self


class LoRAExpert(Expert):
    """An expert that trains a LoRA adapter on a frozen base model (``finetune: lora``, the reference policy
    is the same model with the adapter bypassed, so no second copy of the weights is kept) or every weight
    of the model (``finetune: full``, the reference is a frozen copy of the initial weights:
    :mod:`unirl_pl.experts.finetune`). ``adapter_disabled()`` is the reference in both.

    ``_init_lora`` validates and records the LoRA arguments and ``finetune``. ``_adapt`` (called inside
    ``seeded_cpu_init`` so the LoRA init is seeded) prepares a loaded base model for training:
    ``_attach_lora`` freezes it and adds the adapter the diffusers way, with the LoRA weights in float32 (a
    ``transformers`` expert overrides it); in full mode every weight but ``frozen_submodules`` trains.
    """

    # peft ``task_type`` of the adapter (``None``: a bare model, as diffusers' ``add_adapter`` wants).
    lora_task_type: ClassVar[str | None] = None

    def _init_lora(
        self,
        lora_rank: int,
        lora_alpha: float,
        lora_target_modules: list[str] | None,
        default_targets: tuple[str, ...],
        lora_init: str | None = None,
        finetune: str = "lora",
    ) -> None:
        self.finetune = check_finetune(finetune, type(self).__name__)
        check_lora_args(lora_rank, lora_alpha, lora_target_modules)
        if lora_init is not None and lora_init not in LORA_INITS:
            raise ValueError(f"lora_init must be one of {sorted(LORA_INITS)}, got {lora_init!r}")
        self.lora_rank = lora_rank
        self.lora_alpha = lora_alpha
        self.lora_target_modules = list(lora_target_modules or default_targets)
        self.lora_init = lora_init

    def lora_config(self) -> LoraConfig:
        """The peft ``LoraConfig`` of this expert's adapter (no dropout, no bias: deterministic)."""
        extra: dict[str, Any] = {}
        if self.lora_init is not None:
            extra["init_lora_weights"] = LORA_INITS[self.lora_init]
        if self.lora_task_type is not None:
            extra["task_type"] = self.lora_task_type
        return LoraConfig(
            r=self.lora_rank,
            lora_alpha=self.lora_alpha,
            target_modules=self.lora_target_modules,
            lora_dropout=0.0,
            bias="none",
            **extra,
        )

    def _attach_lora(self, model: Any) -> Any:
        """Freeze ``model``, add the adapter in place and return it (diffusers ``add_adapter``)."""
        return attach_diffusers_lora(model, self.lora_config())

    def _require_lora(self, use: str) -> None:
        """One-line ``ValueError`` for an adapter operation on a fully fine-tuned expert (it has no adapter)."""
        require_lora(self, use)

    def save_model(self, path: str) -> None:
        """Save the whole fine-tuned model in its library's format (``finetune: full``): a diffusers model
        folder here, loadable by the model class's ``from_pretrained``."""
        self._require_built().save_pretrained(path)

    def frozen_submodules(self, model: Any) -> list[torch.nn.Module]:
        """The parts of ``model`` that stay frozen under full fine-tuning (none here; a VLM's vision tower)."""
        return []

    def _adapt(self, model: Any) -> Any:
        """``model`` made trainable as ``finetune`` says: the LoRA attached, or (full) every weight but
        ``frozen_submodules`` trainable in float32 and a frozen copy registered as the reference."""
        return adapt(self, model, self._attach_lora, self.frozen_submodules(model))

    def train(self, mode: bool = True) -> LoRAExpert:
        """Switch the model to ``mode``; a full fine-tune's frozen reference copy stays in eval mode."""
        super().train(mode)
        keep_reference_eval(self)
        return self

    @contextmanager
    def adapter_disabled(self) -> Iterator[None]:
        """Context in which the model is the frozen reference policy: LoRA bypassed, or (full fine-tuning) the
        frozen copy of the initial weights in its place. Every parameter's ``requires_grad`` is the same
        afterwards; nested use is a no-op inside."""
        model = self._require_built()
        context = reference_swapped(self) if self.finetune == "full" else adapter_bypassed(model)
        with context:
            yield
