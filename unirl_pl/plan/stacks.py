"""Stacks of repeated blocks in a model, for the plan's stand-ins (:mod:`unirl_pl.plan.blocks`): which blocks are
copies of each other, and the facts about a block and a call that decide whether a copy may stand in."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

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


def has_inner_hooks(block: torch.nn.Module) -> bool:
    """Whether a module below ``block`` has hooks of its own (an FSDP unit inside it): skipping its call would
    skip them."""
    return any(
        m._forward_hooks or m._forward_pre_hooks or getattr(m, "_forward_hooks_with_kwargs", None)
        for m in block.modules()
        if m is not block
    )


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
                if counts[fingerprint] >= MIN_STACK and block not in found and not has_inner_hooks(block):
                    # With autograd the last copy is a kind of its own: the first to backpropagate, it takes the
                    # gradients of whatever follows the stack (a final norm's, in another dtype), not a copy's.
                    found[block] = (id(module), fingerprint, last[fingerprint] is block)
    return found
