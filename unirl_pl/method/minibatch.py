"""Several optimizer steps per rollout: which mini-batch each record row trains in.

A rollout's records split into ``mini_batches`` parts, one optimizer step each (PPO's mini-batches; Flow-GRPO
updates twice per sampled batch, verl's DAPO/GSPO examples split a rollout into 2-4). A prompt's group stays
whole, and the split depends only on the group's request id (its position in the run's prompt stream), the
step's seed and the PPO epoch: never on the rank. Request ids are dealt in blocks of ``mini_batches``
consecutive ids and each block gives one group to every mini-batch, in an order drawn per block and epoch.
A rank's share of a step is a contiguous run of request ids, so when ``mini_batches`` divides the prompts per
rank every rank holds the same number of groups in each mini-batch, and the union over ranks of mini-batch
``j`` is the one process's mini-batch ``j``: 2 ranks update exactly as 1 process does.
"""

from __future__ import annotations

import torch
from torch import Tensor


def minibatch_of(requests: Tensor, mini_batches: int, seed: int, epoch: int) -> Tensor:
    """(R,) long: the mini-batch ``0..mini_batches-1`` of each row, given each row's request (group) id.

    Rows of one request always share a mini-batch. Block ``b = id // mini_batches`` holds the ids
    ``b*m .. b*m+m-1``; a permutation drawn from ``(seed, b, epoch)`` sends slot ``id % m`` of the block to its
    mini-batch, so across epochs a group meets other groups.
    """
    if mini_batches < 1:
        raise ValueError(f"mini_batches must be >= 1, got {mini_batches}")
    ids = requests.detach().cpu().long()
    if mini_batches == 1:
        return torch.zeros_like(ids)
    blocks, slots = torch.div(ids, mini_batches, rounding_mode="floor"), ids % mini_batches
    out = torch.empty_like(ids)
    for block in blocks.unique().tolist():
        gen = torch.Generator().manual_seed((seed * 1_000_003 + block * 7919 + epoch * 104_729) % (2**63))
        order = torch.randperm(mini_batches, generator=gen)
        where = blocks == block
        out[where] = order[slots[where]]
    return out


def minibatch_rows(requests: Tensor, mini_batches: int, seed: int, epoch: int) -> list[Tensor]:
    """The row indices (1-D long, ascending) of each of the ``mini_batches`` mini-batches; some may be empty
    when a record holds fewer groups than mini-batches (a refiner that dropped groups)."""
    assigned = minibatch_of(requests, mini_batches, seed, epoch)
    return [(assigned == j).nonzero().flatten() for j in range(mini_batches)]
