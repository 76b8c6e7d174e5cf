"""A stood-in block call in the autograd graph (:mod:`unirl_pl.plan.blocks`): the node that holds what the traced
copy saved and kept until its backward, and the measure of the traced copy's backward that its backward waits for."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from unirl_pl.plan.snapshots import Snapshot, snapshot_add, snapshot_diff
from unirl_pl.plan.stacks import TensorLike
from unirl_pl.plan.tracker import PlanMemTracker


class BackwardWindow:
    """A traced call's backward, measured between gradient hooks: on its outputs (the first gradient made: the
    window opens) and on its inputs that need gradients (every one made: it closes). Its rise over its start is
    known only then, and the backward of a later call (a stand-in) runs before it; so a stand-in's backward leaves
    the bytes held at its start in ``pending``, and the peak is raised by the rise when the window closes (a peak
    is a maximum: the order does not matter within one trace)."""

    def __init__(self, tracker: PlanMemTracker) -> None:
        self.tracker = tracker
        self.rise: Snapshot | None = None
        self.incoming: list[tuple | None] | None = None
        self.gave: list[bool] | None = None
        self.pending: list[tuple[Snapshot, int, list[tuple | None], int]] = []
        self._window: int | None = None
        self._start: Snapshot = {}

    def open(self) -> None:
        """The traced call's backward begins: the first of its nodes is about to run (a hook on an output's
        gradient fires just before the node that made the output; waiting for every output's would start the
        window after some of the call's nodes have run)."""
        self._start = self.tracker.get_tracker_snapshot("current")
        self._window = self.tracker.open_window()

    def received(self, grads: Sequence[torch.Tensor | None]) -> None:
        """The traced call's outputs' gradients, all made: their shapes and dtypes, for the stand-ins to match."""
        self.incoming = grad_kinds(grads)

    def close(self, grads: Sequence[torch.Tensor | None]) -> None:
        """The traced call's backward ends with ``grads`` for its inputs: raise the peak for the stand-ins that
        waited, and check them against it."""
        if self._window is None:
            return
        peak = self.tracker.close_window(self._window)
        self._window = None
        self.rise = snapshot_diff(peak, self._start)
        self.gave = [g is not None for g in grads]
        for held, marks, incoming, inputs in self.pending:
            self._check(held, marks, incoming, inputs, waited=True)
        self.pending.clear()

    def stand_in(self, held: Snapshot, grads: Sequence[torch.Tensor | None], inputs: int) -> None:
        """A stand-in's backward starts with ``held`` and ``grads`` for its outputs, and gives ``inputs`` gradients."""
        if self.rise is None:
            self.pending.append((held, self.tracker.mark_count, grad_kinds(grads), inputs))
        else:
            self._check(held, self.tracker.mark_count, grad_kinds(grads), inputs, waited=False)

    def _check(self, held: Snapshot, marks: int, incoming: list, inputs: int, waited: bool) -> None:
        if marks != self.tracker.mark_count or incoming != self.incoming or [True] * inputs != self.gave:
            raise RuntimeError(
                "plan: a stood-in block's backward does not match its traced copy's (a phase mark between them, "
                f"gradients of other shapes or dtypes, {incoming} against {self.incoming}, or for other inputs, "
                f"{self.gave}); rerun with --trace-every-block"
            )
        assert self.rise is not None
        # A waiting stand-in's moment was before any window now open: it raises the tracker's peak only.
        self.tracker.raise_peak(snapshot_add(held, self.rise), windows=not waited)


def grad_kinds(grads: Sequence[torch.Tensor | None]) -> list[tuple | None]:
    """Each gradient's shape and dtype (None where there is none)."""
    return [None if g is None else (tuple(g.shape), g.dtype) for g in grads]


class StandInCall:
    """One stood-in call with autograd on: makes its outputs and saved bytes in forward, and in backward frees the
    saved bytes and makes its inputs' and parameters' gradients (shapes only: holding tensors would keep them)."""

    def __init__(
        self, make: Any, saved: int, device: Any, window: BackwardWindow, inputs: list, params: list, kept: list
    ) -> None:
        self.make, self.window = make, window
        self.saved_bytes, self.device = saved, device
        self.inputs = [TensorLike.of(t) for t in inputs]
        self.params = [TensorLike.of(p) for p in params]
        self.saved: torch.Tensor | None = None
        # The inputs its traced copy kept alive until its backward (saved, or held by checkpointing).
        self.kept: list[torch.Tensor] | None = kept

    def forward(self) -> tuple[torch.Tensor, ...]:
        if self.saved_bytes:
            self.saved = torch.empty(self.saved_bytes, dtype=torch.uint8, device=self.device)
        make, self.make = self.make, None  # it holds the call's inputs, which the backward node must not keep
        return make()

    def backward(self, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        """Raise the peak by the traced copy's backward rise, free the saved bytes and inputs, and give the inputs and
        parameters their gradients."""
        self.window.stand_in(self.window.tracker.get_tracker_snapshot("current"), grads, len(self.inputs))
        self.saved = self.kept = None  # the block's saved activations and inputs, all freed by its backward's end
        return [like.make() for like in self.inputs] + [like.make() for like in self.params]


class StandInFunction(torch.autograd.Function):
    """A stood-in call in the autograd graph: its inputs that need gradients and the block's trainable parameters
    in, its tensor outputs out."""

    @staticmethod
    def forward(ctx: Any, call: StandInCall, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        ctx.call = call
        outs = call.forward()
        ctx.mark_non_differentiable(*(o for o in outs if not (o.is_floating_point() or o.is_complex())))
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        return (None, *ctx.call.backward(grads))
