"""What a traced call of a repeated block left (:class:`Template`) and the outputs its stand-ins make from it
(:func:`stand_in_outputs`), for :mod:`unirl_pl.plan.blocks`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from unirl_pl.plan.snapshots import Snapshot
from unirl_pl.plan.standin_autograd import BackwardWindow


@dataclass(frozen=True)
class Out:
    """One output tensor of a template: a view (``shape``, ``stride``, ``offset``) of a new storage (``new``: its
    index in the template's storages) or of an input's storage (``source``: the input tensor's leaf index), or
    that input itself (``same``)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    new: int | None = None
    source: int | None = None
    same: bool = False


@dataclass
class Template:
    """What the traced call of one kind left: its rise over its start, its held bytes, its outputs' layout and the
    KV-cache entries it added (key and value shapes, dtypes and the ``update`` keyword arguments)."""

    rise: Snapshot
    held: Snapshot
    spec: Any
    outputs: list[Any]
    storages: list[tuple[int, torch.dtype, torch.device]]
    updates: list[tuple[torch.Size, torch.dtype, torch.Size, torch.dtype, torch.device, dict]] = field(
        default_factory=list
    )
    saved: int = 0
    backward: BackwardWindow | None = None
    kept: list[int] = field(default_factory=list)


def stand_in_outputs(template: Template, leaves: list[Any]) -> list[Any]:
    """The output leaves of a stand-in: new storages of the template's sizes viewed as its outputs were, views of
    this call's inputs where its outputs viewed its inputs, and its other leaves as they were."""
    storages = [
        torch.empty(nbytes // dtype.itemsize, dtype=dtype, device=device) for nbytes, dtype, device in template.storages
    ]
    outputs = []
    for out in template.outputs:
        if not isinstance(out, Out):
            outputs.append(out)
        elif out.same:
            outputs.append(leaves[out.source])
        else:
            base = storages[out.new] if out.new is not None else leaves[out.source]
            outputs.append(base.as_strided(out.shape, out.stride, out.offset))
    return outputs
