"""The trained experts' optimizers as a fit on GPUs steps them.

A fit builds the recipe's optimizer over CUDA parameters (FSDP2's sharded ``DTensor``\\ s under FSDP2), and
torch then takes the optimizer's ``foreach`` path unless the recipe sets ``foreach`` or ``fused``
(``torch.optim.optimizer._default_to_fused_or_foreach``); Lightning's gradient clipping
(``torch.nn.utils.clip_grad_norm_``) takes it too. A plan's parameters are fake CPU tensors, for which torch
takes the per-parameter loop instead, and the two peak differently: AdamW's ``foreach`` step holds a copy of
every second moment of a dtype at once (``_foreach_sqrt``), the loop one parameter's. So the plan sets
``foreach`` as CUDA does.

Under FSDP2 the plan steps each rank's local shards: the tensors a ``DTensor`` step allocates (a ``DTensor``
owns no storage beyond its local tensor; byte-equal on a tiny FSDP2 model, ``tests/test_plan_optimizers.py``),
without DTensor's sharding propagation, which a fake trace pays for every operator on a list of shards (Qwen-Image's
plan: 93 s before, 84 s after). Each rank's gradient norm is then its own; a fit all-reduces it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.distributed.tensor import DTensor


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """What one rank holds of ``tensor``: its local shard when it is a ``DTensor`` (a view of the same
    storage, made without autograd so an optimizer takes it as a leaf), else ``tensor`` itself."""
    if not isinstance(tensor, DTensor):
        return tensor
    with torch.no_grad():
        return tensor.to_local()


def cuda_foreach(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``optimizer`` with ``foreach`` on in every group that leaves it to torch (``None``, not fused or
    differentiable): what torch picks for CUDA parameters."""
    for group in optimizer.param_groups:
        left_to_torch = group.get("foreach", False) is None and not group.get("fused")
        if left_to_torch and not group.get("differentiable"):
            group["foreach"] = True
    return optimizer


class StepOptimizer:
    """One trained expert's optimizer, clipped and stepped as a fit on GPUs does (see the module's docstring).

    Args:
        factory: The recipe's optimizer with its settings (``transformer_optimizer`` or ``llm_optimizer``).
        params: The expert's trainable parameters (``DTensor``\\ s under FSDP2).
        grad_clip: The largest gradient norm (the expert loss's ``grad_clip``); ``None`` clips nothing.
    """

    def __init__(
        self,
        factory: Callable[[Sequence[torch.Tensor]], torch.optim.Optimizer],
        params: Sequence[torch.Tensor],
        grad_clip: float | None,
    ) -> None:
        self.params = list(params)
        self.shards = [local_shard(p) for p in self.params]
        self.optimizer = cuda_foreach(factory(self.shards))
        self.grad_clip = grad_clip

    def zero_grad(self) -> None:
        """Drop every gradient (``set_to_none``, as the training step clears them)."""
        for param, shard in zip(self.params, self.shards, strict=True):
            param.grad = shard.grad = None

    def step(self) -> None:
        """Clip the gradients to ``grad_clip`` and step, on the local shards."""
        for param, shard in zip(self.params, self.shards, strict=True):
            if shard is not param:
                shard.grad = None if param.grad is None else local_shard(param.grad)
        if self.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.shards, self.grad_clip, foreach=True)
        self.optimizer.step()
