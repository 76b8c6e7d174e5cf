"""Views of fake tensors made without ``FakeTensorMode``'s per-operator bookkeeping.

A view allocates nothing: its result is a new tensor over its input's storage. On fake tensors ``FakeTensorMode``
still hashes the call's arguments for its cache, or runs its checks for constants, symbolic shapes and real-tensor
propagation, at about 250 us a view on this machine. FSDP2 makes several views of every parameter each time it
all-gathers a unit (the all-gather input's ``detach`` and ``view(dtype)``, then the copy-out's), so on an 8-rank
real-size plan these views were a fifth of the trace's time.

:func:`fake_view` makes the same result the fake mode's own general path makes (the meta kernel inside the mode's
kernel invocation, wrapped as a fake tensor on its input's device) in a sixth of the time, for the view operators in
:data:`VIEWS` called on one fake tensor with no constant and no symbolic shape; other calls return None and go
through the mode. ``tests/test_plan_fake_views.py`` checks each against the mode's result.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager

aten = torch.ops.aten

VIEWS = frozenset(
    {
        aten.detach.default,
        aten.alias.default,
        aten.view.default,
        aten.view.dtype,
        aten.t.default,
        aten.transpose.int,
        aten.permute.default,
        aten.expand.default,
        aten.slice.Tensor,
        aten.select.int,
        aten.unsqueeze.default,
        aten.as_strided.default,
        aten.split.Tensor,
        aten.split_with_sizes.default,
        aten.unbind.int,
    }
)
"""View operators (``OpOverload.is_view``) with a meta kernel, the ones a real-size trace makes most; the last three
give a list of views (``torch.chunk`` is ``split``: FSDP2 chunks every parameter into its shards)."""


def fake_view(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> Any:
    """``func(*args)`` for a view in :data:`VIEWS` of a plain fake tensor outside its mode's kernels (a fake tensor,
    or a list of them), else None."""
    if func not in VIEWS or kwargs:
        return None
    tensor = args[0]
    if type(tensor) is not FakeTensor or tensor.constant is not None:
        return None
    mode = tensor.fake_mode
    if mode.in_kernel_invocation or mode.shape_env is not None or mode.propagate_real_tensors:
        return None
    if any(isinstance(arg, torch.Tensor) for arg in args[1:]):
        return None
    with in_kernel_invocation_manager(mode):
        out = func(*args)
    if isinstance(out, torch.Tensor):
        return FakeTensor(mode, out, tensor.fake_device)
    return [FakeTensor(mode, view, tensor.fake_device) for view in out]
