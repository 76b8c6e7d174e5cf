"""Full fine-tuning of an expert beside LoRA: which weights train, and the frozen copy that is the KL reference.

With ``finetune: lora`` (every expert's default) the base weights are frozen, a LoRA adapter trains and the
reference policy is the same model with the adapter bypassed. With ``finetune: full`` (PromptRL's setting for
both experts) every weight of the model trains except the parts an expert names as frozen (a VLM's vision
tower), and the reference is a frozen copy of the initial weights: nothing else can be, because no weights are
left unchanged. The trained weights are float32 (the master weights DeepSpeed's and FSDP's mixed precision keep
too: at bf16, an update of lr 2e-7 on a weight of 1e-2 rounds to nothing); the copy is taken before that cast,
in the checkpoint's own dtypes (a bf16 reference costs half a float32 one, and PromptRL loads its reference in
bf16 too). A float32 expert's KL starts at exactly 0; a bf16 one's is exactly 0 where FSDP2 computes the policy
in bf16 from its master weights (their bf16 values are the checkpoint's) and at kernel-noise level elsewhere.

The copy is a registered child of the expert (Lightning moves it with the module, FSDP2 shards it like the
policy), frozen and in eval mode. Checkpoints drop it with every other frozen weight (``trim_frozen``):
``configure_model`` rebuilds it from the pretrained weights, which is what it is.
"""

from __future__ import annotations

import copy
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import torch

Finetune = Literal["lora", "full"]
FINETUNE_MODES: tuple[str, ...] = ("lora", "full")

REFERENCE_ATTR = "reference_model"
"""Attribute (and child module name) of the frozen copy on the module that owns the trained model."""


def check_finetune(finetune: str, owner: str) -> str:
    """``finetune`` itself when it is ``lora`` or ``full``; otherwise a one-line ``ValueError`` naming the setting."""
    if finetune not in FINETUNE_MODES:
        raise ValueError(f"{owner}.finetune must be 'lora' or 'full', got {finetune!r}")
    return finetune


def require_lora(owner: Any, use: str) -> None:
    """One-line ``ValueError`` for an adapter operation (``use``) on an expert ``owner`` that is fully fine-tuned:
    it has no adapter; ``export`` writes its whole model instead."""
    if owner.finetune != "lora":
        raise ValueError(
            f"{type(owner).__name__}.{use} needs a LoRA adapter, but finetune is {owner.finetune!r}: "
            "a full fine-tune is exported whole (save_model)"
        )


def adapt(
    owner: torch.nn.Module,
    model: Any,
    attach_lora: Callable[[Any], Any],
    frozen: Iterable[torch.nn.Module] = (),
) -> Any:
    """``model`` made trainable as ``owner.finetune`` says: ``attach_lora(model)`` (LoRA on the frozen base), or
    (full) every weight but the ``frozen`` parts trainable in float32 and a frozen copy registered on ``owner``
    as the reference. Call it inside ``seeded_cpu_init`` so a LoRA init is seeded."""
    if owner.finetune == "lora":
        return attach_lora(model)
    attach_reference(owner, model)  # as loaded: the reference keeps the checkpoint's own dtypes
    make_fully_trainable(model, frozen)
    return model


def make_fully_trainable(model: torch.nn.Module, frozen: Iterable[torch.nn.Module] = ()) -> torch.nn.Module:
    """Make every parameter of ``model`` a float32 trainable weight, except those of the ``frozen`` submodules
    (which stay frozen in their dtype); returns ``model``. A parameter shared with a frozen part stays frozen."""
    frozen_ids = {id(p) for part in frozen for p in part.parameters()}
    for param in model.parameters():
        if id(param) in frozen_ids:
            param.requires_grad_(False)
            continue
        if param.is_floating_point() and param.dtype != torch.float32:
            param.data = param.data.float()
        param.requires_grad_(True)
    return model


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model`` with no parameter requiring grad, in eval mode: the KL reference."""
    reference = copy.deepcopy(model)
    reference.requires_grad_(False)
    return reference.eval()


def attach_reference(owner: torch.nn.Module, model: torch.nn.Module) -> None:
    """Register the frozen copy of ``model`` on ``owner`` as ``owner.reference_model``."""
    owner.add_module(REFERENCE_ATTR, frozen_copy(model))


def reference_of(owner: torch.nn.Module) -> torch.nn.Module | None:
    """The frozen copy registered on ``owner`` (None without one)."""
    return owner._modules.get(REFERENCE_ATTR)


@contextmanager
def reference_swapped(owner: Any, attr: str = "model") -> Iterator[None]:
    """Context in which ``owner.<attr>`` is the frozen copy, so every call that runs the policy runs the
    reference; the policy is put back afterwards, also on error. Nested use is a no-op inside."""
    reference = reference_of(owner)
    if reference is None:
        raise RuntimeError(f"{type(owner).__name__} has no frozen reference copy (finetune: full builds one)")
    policy = owner._modules[attr]
    if policy is reference:  # nested: the outer context restores
        yield
        return
    owner._modules[attr] = reference
    try:
        yield
    finally:
        owner._modules[attr] = policy


def keep_reference_eval(owner: torch.nn.Module) -> None:
    """Put ``owner``'s frozen copy back in eval mode (call it from ``train``: the copy never trains)."""
    reference = reference_of(owner)
    if reference is not None:
        reference.eval()


def copy_pipeline_folder(source: str | Path, target: str | Path, skip: Iterable[str] = ()) -> None:
    """Copy a diffusers pipeline folder to ``target`` without the component folders in ``skip`` (the ones the
    caller writes itself). Files are hard-linked where source and target share a file system (a real
    pipeline's text encoders are gigabytes that do not change) and copied otherwise."""
    source, target = Path(source), Path(target)
    skipped = {source / name for name in skip}

    def link_or_copy(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    target.mkdir(parents=True, exist_ok=True)
    for entry in source.iterdir():
        if entry in skipped:
            continue
        if entry.is_dir():
            shutil.copytree(entry, target / entry.name, copy_function=link_or_copy, dirs_exist_ok=True)
        else:
            link_or_copy(str(entry), str(target / entry.name))
