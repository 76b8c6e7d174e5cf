"""``unirl_pl.plan.fake_views``: a view of a fake tensor made without the fake mode's bookkeeping is the mode's own.

- Each operator in ``VIEWS`` gives a fake tensor of the mode's shape, stride, offset, dtype and device over its
  input's storage (a view that allocated a storage of its own would count bytes no fit holds).
- Calls the fast path must leave to the mode return None: another operator, keyword arguments, a tensor argument
  beside the input, a constant input, a call inside the mode's kernels, a mode with symbolic shapes.
- In a plan, ``AllRowsReal`` makes views this way while it carries no values; a traced plan's bytes are unchanged
  (``tests/test_plan_blocks.py``'s tiny FSDP2 plan against one traced without it).
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, in_kernel_invocation_manager
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.multiprocessing.reductions import StorageWeakRef

from unirl_pl.plan.fake_views import VIEWS, fake_view
from unirl_pl.plan.tracker import AllRowsReal

aten = torch.ops.aten

CALLS = {
    aten.detach.default: (),
    aten.alias.default: (),
    aten.view.default: ([6, 4, 8],),
    aten.view.dtype: (torch.uint8,),
    aten.t.default: None,  # 2-D input
    aten.transpose.int: (0, 2),
    aten.permute.default: ([2, 0, 1],),
    aten.expand.default: ([5, 3, 8, 8],),
    aten.slice.Tensor: (1, 2, 7, 2),
    aten.select.int: (1, 3),
    aten.unsqueeze.default: (1,),
    aten.as_strided.default: ([4, 4], [16, 2], 8),
    aten.split.Tensor: (3, 1),  # a list of views, as torch.chunk makes (the last one shorter)
    aten.split_with_sizes.default: ([2, 5, 1], 1),
    aten.unbind.int: (0,),
}


def made(mode: FakeTensorMode) -> dict:
    with mode:
        base = torch.empty(3, 16, 8, dtype=torch.bfloat16)[:, 1:9]  # a view at an offset: strides and offset carry
        matrix = torch.empty(12, 32, dtype=torch.float16)
    return {"base": base, "matrix": matrix}


@pytest.mark.parametrize("func", sorted(VIEWS, key=str), ids=str)
def test_each_view_is_the_fake_modes_own_over_the_input_storage(func):
    mode = FakeTensorMode()
    tensors = made(mode)
    tensor, rest = (tensors["matrix"], ()) if CALLS[func] is None else (tensors["base"], CALLS[func])
    if func is aten.view.default:
        tensor = tensor.contiguous()
    with mode:
        expected = func(tensor, *rest)
    got = fake_view(func, (tensor, *rest), {})
    assert type(got) is type(expected)
    got, expected = (got, expected) if isinstance(got, list) else ([got], [expected])
    assert len(got) == len(expected) > 0
    for view, theirs in zip(got, expected, strict=True):
        assert type(view) is FakeTensor and view.fake_mode is mode and view is not tensor
        layout = [(t.shape, t.stride(), t.storage_offset(), t.dtype, t.device) for t in (view, theirs)]
        assert layout[0] == layout[1]
        assert StorageWeakRef(view.untyped_storage()) == StorageWeakRef(tensor.untyped_storage())


def test_calls_the_mode_must_answer_are_left_to_it():
    mode = FakeTensorMode()
    tensor = made(mode)["matrix"]
    assert fake_view(aten.add.Tensor, (tensor, tensor), {}) is None
    assert fake_view(aten.clone.default, (tensor,), {}) is None
    assert fake_view(aten.view.default, (tensor,), {"size": [-1]}) is None
    assert fake_view(aten.as_strided.default, (tensor, [2], [1], tensor), {}) is None
    with mode:
        constant = torch.tensor(2.0)  # a one-element literal: the mode keeps its value as a constant
    assert constant.constant is not None and fake_view(aten.detach.default, (constant,), {}) is None
    with in_kernel_invocation_manager(mode):
        assert fake_view(aten.detach.default, (tensor,), {}) is None
    symbolic = FakeTensorMode(shape_env=ShapeEnv())
    assert fake_view(aten.detach.default, (made(symbolic)["matrix"],), {}) is None
    assert fake_view(aten.detach.default, (torch.empty(2),), {}) is None  # a real tensor


def test_all_rows_real_makes_views_this_way_unless_it_carries_values(monkeypatch):
    from unirl_pl.plan import tracker

    made_here = []

    def counted(func, args, kwargs):
        view = fake_view(func, args, kwargs)
        if view is not None:
            made_here.append(func)
        return view

    monkeypatch.setattr(tracker, "fake_view", counted)
    mode = FakeTensorMode()
    with mode, AllRowsReal() as rows:
        x = torch.empty(4, 8)
        x.detach(), x.t()
        assert made_here == [aten.detach.default, aten.t.default]
        with rows.carrying_values():
            ids = torch.tensor([3, 1, 2])
            assert ids[:2].tolist() == [3, 1]  # a view of a literal keeps its values
        assert made_here == [aten.detach.default, aten.t.default]
