"""Stacks of repeated blocks in a model, for the plan's stand-ins (:mod:`unirl_pl.plan.blocks`): which blocks are
copies of each other, and the facts about a block and a call that decide whether a copy may stand in."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

MIN_STACK = 3
"""The fewest copies of a block in one ``ModuleList`` for its calls to be stood in."""


@dataclass(frozen=True)
class TensorLike:
    """A tensor's shape, dtype and device, to make one like it without holding it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorLike:
        """The description of ``tensor``."""
        return cls(tuple(tensor.shape), tensor.dtype, tensor.device)

    def make(self) -> torch.Tensor:
        """An uninitialised tensor of this description."""
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)


def cache_class() -> type | None:
    """transformers' KV-cache base class (its ``update`` is how a decoder layer adds its entries)."""
    try:
        from transformers.cache_utils import Cache
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
    return Cache


def checkpointing() -> bool:
    """Whether saved-tensor hooks are on (activation checkpointing packs what a block saves)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def layer_index(block: torch.nn.Module) -> int | None:
    """The KV-cache layer a block writes (a transformers decoder layer's attention holds ``layer_idx``)."""
    for module in block.modules():
        index = getattr(module, "layer_idx", None)
        if isinstance(index, int):
            return index
    return None


def block_fingerprint(block: torch.nn.Module) -> tuple:
    """A block's class and the names, shapes, dtypes and trainability of its parameters and buffers."""
    params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in block.named_parameters())
    buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in block.named_buffers())
    return type(block).__qualname__, params, buffers


def capture_key(hook: Any) -> str | None:
    """The output a transformers output-capturing hook records (``"hidden_states"``, ``"attentions"``), or None for
    any other hook. transformers 5 installs these forward hooks on the first forward asked for an output (a text
    encoder's ``output_hidden_states``), on the layers and on their attention modules; each records only while a
    forward's collector asks for its key, and does nothing otherwise."""
    code = getattr(hook, "__code__", None)
    if code is None or code.co_name != "output_capturing_hook" or not hook.__module__.startswith("transformers."):
        return None
    cells = dict(zip(code.co_freevars, hook.__closure__ or (), strict=False))
    try:
        key = cells["key"].cell_contents
    except (KeyError, ValueError):  # a transformers release that keeps the key elsewhere: an unknown hook
        return None
    return key if isinstance(key, str) else None


def inner_hooks(block: torch.nn.Module) -> tuple[bool, frozenset[str]]:
    """The hooks of the modules below ``block``: whether any is not an output-capturing hook (an FSDP unit inside
    it: skipping its call would skip them), and the keys of the capturing ones (a stand-in may skip those while no
    forward asks for their keys)."""
    other, keys = False, set()
    for module in block.modules():
        if module is block:
            continue
        other |= bool(module._forward_pre_hooks or getattr(module, "_forward_hooks_with_kwargs", None))
        for hook in module._forward_hooks.values():
            key = capture_key(hook)
            other |= key is None
            keys.add(key)
    keys.discard(None)
    return other, frozenset(keys)


def requested_outputs() -> frozenset[str] | None:
    """The outputs the running transformers forward asks its capturing hooks for (none outside such a forward), or
    None when this transformers keeps its collector elsewhere (then any capturing hook may be recording)."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # pragma: no cover - the collector of transformers 5's capturing hooks
        return None
    collected = _active_collector.get()
    return frozenset(collected or ())


def repeated_blocks(roots: Sequence[torch.nn.Module]) -> dict[torch.nn.Module, tuple[int, tuple, bool]]:
    """The blocks under ``roots`` that have at least :data:`MIN_STACK` copies in their ``ModuleList`` (a list of
    different layers, such as a feed-forward's activation, dropout and projection, is not a stack), each with its
    stack's id, its fingerprint (copies share both) and whether it is the stack's last copy."""
    found: dict[torch.nn.Module, tuple[int, tuple, bool]] = {}
    seen: set[int] = set()
    for root in roots:
        for module in root.modules():
            if id(module) in seen or not isinstance(module, torch.nn.ModuleList) or len(module) < MIN_STACK:
                continue
            seen.add(id(module))
            prints = {block: block_fingerprint(block) for block in module}
            counts = Counter(prints.values())
            last = {fingerprint: block for block, fingerprint in prints.items()}
            for block, fingerprint in prints.items():
                if counts[fingerprint] >= MIN_STACK and block not in found and not inner_hooks(block)[0]:
                    # With autograd the last copy is a kind of its own: the first to backpropagate, it takes the
                    # gradients of whatever follows the stack (a final norm's, in another dtype), not a copy's.
                    found[block] = (id(module), fingerprint, last[fingerprint] is block)
    return found
