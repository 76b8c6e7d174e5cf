"""The plan steps the trained experts' optimizers as a fit on GPUs does (``unirl_pl.plan.optimizers``).

- torch's own rule (``_default_to_fused_or_foreach``) gives ``foreach`` for parameters of a device with foreach
  kernels (CUDA) when the recipe sets neither ``foreach`` nor ``fused``; a plan's fake CPU parameters would get the
  per-parameter loop, so the plan sets ``foreach`` as CUDA gets it, and keeps a recipe's own setting.
- The two paths peak differently, which is why it matters: AdamW's ``foreach`` step holds a copy of every second
  moment at once, the loop one parameter's.
- Under FSDP2 the plan steps each rank's local shards: the bytes of the same step on the ``DTensor`` parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pytest
import torch
import torch.optim.optimizer as torch_optimizer
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from unirl_pl.plan.optimizers import StepOptimizer, cuda_foreach, local_shard
from unirl_pl.plan.planner import fake_ranks
from unirl_pl.plan.tracker import AllRowsReal, PlanMemTracker

ADAMW = partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.01)


def test_foreach_is_set_where_torch_sets_it_for_cuda_parameters(monkeypatch):
    params = [nn.Parameter(torch.zeros(8, 8)) for _ in range(3)]
    # torch's rule on CPU parameters: no foreach kernels for the device, the per-parameter loop.
    assert torch_optimizer._default_to_fused_or_foreach(params, False) == (False, False)
    # The same rule where the device has foreach kernels, as CUDA does: foreach.
    monkeypatch.setattr(torch_optimizer, "_get_foreach_kernels_supported_devices", lambda: ["cpu"])
    assert torch_optimizer._default_to_fused_or_foreach(params, False) == (False, True)
    monkeypatch.undo()
    assert cuda_foreach(ADAMW(params)).param_groups[0]["foreach"] is True
    # A recipe's own choice is kept.
    assert cuda_foreach(ADAMW(params, foreach=False)).param_groups[0]["foreach"] is False
    assert cuda_foreach(ADAMW(params, fused=True)).param_groups[0]["foreach"] is None
    assert cuda_foreach(ADAMW(params, differentiable=True)).param_groups[0]["foreach"] is None
    assert cuda_foreach(torch.optim.SGD(params, lr=0.1)).param_groups[0]["foreach"] is True


def _step_rise(step: Callable[[], None], optimizer: torch.optim.Optimizer, params: list, *tracked: object) -> int:
    """Bytes ``step`` rises above what is held before it (gradients set, ``optimizer``'s state built by a first
    step)."""
    for param in params:
        param.grad = torch.ones_like(param)
    step()
    tracker = PlanMemTracker()
    tracker.track_external(*tracked, optimizer)
    with tracker:
        before = tracker.current().total
        step()
        return tracker.peak().total - before


@pytest.mark.parametrize("recipe_foreach", [None, False])
def test_the_foreach_step_holds_a_copy_of_every_second_moment(recipe_foreach):
    params = [nn.Parameter(torch.randn(64, 64)) for _ in range(16)]
    optimizer = StepOptimizer(partial(ADAMW, foreach=recipe_foreach), params, grad_clip=1.0)
    rise = _step_rise(optimizer.step, optimizer.optimizer, params, *params)
    moments = sum(s["exp_avg_sq"].nbytes for s in optimizer.optimizer.state.values())
    if recipe_foreach is None:  # as on CUDA: torch's foreach step
        assert rise >= moments, (rise, moments)
    else:  # the recipe asked for the loop: a few copies of one parameter at a time, whatever their count
        assert rise <= 4 * params[0].nbytes and rise < moments / 4, (rise, moments)


def test_stepping_local_shards_allocates_what_the_dtensor_step_does():
    from torch.distributed.fsdp import fully_shard

    def rise(local: bool) -> tuple[int, int]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 40))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        params = list(model.parameters())
        if local:
            planned = StepOptimizer(ADAMW, params, grad_clip=1.0)
            step, optimizer = planned.step, planned.optimizer
        else:  # the fit's step: torch's foreach path on the DTensor parameters themselves
            optimizer = ADAMW(params, foreach=True)

            def step() -> None:
                torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
                optimizer.step()

        got = _step_rise(step, optimizer, params, model)
        held = sum(local_shard(t).nbytes for s in optimizer.state.values() for t in s.values() if t.dim())
        return got, held

    with fake_ranks(4) as mesh, FakeTensorMode(), AllRowsReal():
        local, dtensor = rise(True), rise(False)
    assert local[1] == dtensor[1] > 0, "the same optimizer state per rank"
    assert local[0] == dtensor[0], (local, dtensor)
    assert local[0] >= local[1] / 2, "the step's copy of the second moments is there"
