"""Several optimizer steps per rollout: which mini-batch each record row trains in.

A rollout's records split into ``mini_batches`` parts, one optimizer step each (PPO's mini-batches). The
references split two ways, and both are here (``<expert>_loss.mini_batch_split``):

- ``group``: a prompt's group stays whole in one mini-batch, as verl's actor splits a batch (DAPO, GSPO,
  verl-omni's GRPO-Guard: ``ppo_mini_batch_size`` counts prompts, each with its ``n`` responses);
- ``sample``: the samples are shuffled and dealt, so a group's samples spread over the updates, as Flow-GRPO's
  SD3 trainer permutes the batch (``torch.randperm(total_batch_size)``) before rebatching and MixGRPO steps
  every ``gradient_accumulation_steps`` samples of a rank's group.

Either split depends only on the rows' request ids (their group's position in the run's prompt stream), the
step's seed and the PPO epoch: never on the rank. Request ids are dealt in blocks of ``mini_batches``
consecutive ids. ``group``: each block gives one group to every mini-batch, in an order drawn per block and
epoch. ``sample``: each block's rows are permuted (drawn per block and epoch) and dealt round-robin, the count
running on over the blocks, so the parts differ by at most one row. A rank's share of a step is a contiguous
run of request ids, so when ``mini_batches`` divides the prompts per rank the union over ranks of mini-batch
``j`` is the one process's mini-batch ``j``: 2 ranks update exactly as 1 process does.

Flow-GRPO's zero-advantage drop (``keep``) takes rows out before the split, and re-admits dropped rows at
random until the count is a multiple of ``mini_batches`` (at least ``mini_batches``), as its trainer does so
every rank takes the same number of steps (``scripts/train_sd3.py``: ``mask = advantages.abs().sum(dim=1) != 0``
and the lines after it).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

Split = Literal["group", "sample"]


def _draw(seed: int, block: int, epoch: int, stream: int) -> torch.Generator:
    """The generator of one block's draw in one PPO epoch (``stream`` keeps the two splits' draws apart)."""
    key = seed * 1_000_003 + block * 7919 + epoch * 104_729 + stream * 15_485_863
    return torch.Generator().manual_seed(key % (2**63))


def _occurrence(ids: Tensor) -> Tensor:
    """(R,) each row's index among the rows of its request, in row order (the sample within its group)."""
    out = torch.empty_like(ids)
    for rid in ids.unique().tolist():
        where = (ids == rid).nonzero().flatten()
        out[where] = torch.arange(len(where))
    return out


def minibatch_of(requests: Tensor, mini_batches: int, seed: int, epoch: int, split: Split = "group") -> Tensor:
    """(R,) long: the mini-batch ``0..mini_batches-1`` of each row, given each row's request (group) id.

    ``group``: rows of one request always share a mini-batch. Block ``b = id // mini_batches`` holds the ids
    ``b*m .. b*m+m-1``; a permutation drawn from ``(seed, b, epoch)`` sends slot ``id % m`` of the block to
    its mini-batch, so across epochs a group meets other groups. ``sample``: the rows of block ``b``, ordered
    by (request, sample), are permuted by a draw from ``(seed, b, epoch)`` and dealt round-robin, continuing
    the previous block's count.
    """
    if mini_batches < 1:
        raise ValueError(f"mini_batches must be >= 1, got {mini_batches}")
    if split not in ("group", "sample"):
        raise ValueError(f"mini_batch_split must be 'group' or 'sample', got {split!r}")
    ids = requests.detach().cpu().long()
    if mini_batches == 1:
        return torch.zeros_like(ids)
    blocks = torch.div(ids, mini_batches, rounding_mode="floor")
    out = torch.empty_like(ids)
    if split == "group":
        slots = ids % mini_batches
        for block in blocks.unique().tolist():
            order = torch.randperm(mini_batches, generator=_draw(seed, block, epoch, 0))
            where = blocks == block
            out[where] = order[slots[where]]
        return out
    key = ids * (len(ids) + 1) + _occurrence(ids)  # (request, sample): the same rows order alike on any rank
    dealt = 0
    for block in blocks.unique().tolist():  # ascending
        where = (blocks == block).nonzero().flatten()
        where = where[key[where].argsort()]
        shuffled = where[torch.randperm(len(where), generator=_draw(seed, block, epoch, 1))]
        out[shuffled] = (torch.arange(len(where)) + dealt) % mini_batches
        dealt += len(where)
    return out


def keep_for_steps(keep: Tensor, mini_batches: int, seed: int) -> Tensor:
    """``keep`` (R,) bool with dropped rows re-admitted at random (drawn from ``seed``) until the kept count is
    a multiple of ``mini_batches`` and at least ``mini_batches``, or every row is kept: Flow-GRPO's rule after
    its zero-advantage mask, which keeps every rank's number of optimizer steps equal."""
    keep = keep.detach().cpu().bool().clone()
    count = int(keep.sum())
    need = mini_batches - count % mini_batches if count % mini_batches or count == 0 else 0
    dropped = (~keep).nonzero().flatten()
    if need and len(dropped):
        pick = torch.randperm(len(dropped), generator=_draw(seed, 0, 0, 2))[:need]
        keep[dropped[pick]] = True
    return keep


def minibatch_rows(
    requests: Tensor,
    mini_batches: int,
    seed: int,
    epoch: int,
    split: Split = "group",
    keep: Tensor | None = None,
) -> list[Tensor]:
    """The row indices (1-D long, ascending) of each of the ``mini_batches`` mini-batches; some may be empty
    when a record holds fewer groups than mini-batches (a refiner that dropped groups). ``keep`` (R,) bool:
    only these rows train (after :func:`keep_for_steps`); the rest are in no mini-batch."""
    rows = torch.arange(len(requests))
    if keep is not None:
        rows = rows[keep_for_steps(keep, mini_batches, seed)]
    assigned = minibatch_of(requests.detach().cpu()[rows], mini_batches, seed, epoch, split)
    return [rows[assigned == j] for j in range(mini_batches)]
