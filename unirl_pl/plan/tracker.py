"""Peak memory of one phase of an RL step, by category, as torch's memory tracker records it.

:class:`PlanMemTracker` is ``torch.distributed._tools.mem_tracker.MemTracker`` (a ``TorchDispatchMode`` that sees
every tensor an operator creates and files its storage as parameter, buffer, gradient, activation, temporary or
optimizer state) with the changes a LoRA RL step needs:

- gradient hooks go on trainable parameters only: ``MemTracker`` hooks every parameter of a module it enters, and
  ``register_hook`` refuses a frozen (LoRA base) parameter;
- only the global peak is kept: updating every tracked module's own peak after each operator costs O(modules) per
  operator, which made a real-size DiT trace take minutes instead of seconds;
- a top-level module may run more than once (guidance rows, the reference forward of the KL, one forward per
  denoising step): ``MemTracker`` takes a second root call for a second training iteration and raises, so the
  root's per-module record restarts instead (the global peak keeps counting);
- no per-module statistics: ``MemTracker``'s module hooks deep-copy a snapshot and sum the input and output bytes of
  every module call for its per-module report, which the plan never reads; its operator hook maps every result
  through a pytree. The hooks here keep only what the global peak depends on (the parameters and gradient hooks of
  a module seen first, the recomputation flag of checkpointing), which took a third of a real-size trace's CPU off
  (the same bytes: see each override).

:class:`Usage` splits a peak snapshot into what the plan reports: frozen weights, the trainable state (LoRA
parameters, their gradients and optimizer state), activations, temporaries, and the experience the step keeps
resident (the tensors handed to :meth:`PlanMemTracker.track_external` that are not module state).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from copy import deepcopy
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch._guards import active_fake_mode
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    unset_fake_temporarily,
)
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType, _ModMemStats
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_leaves, tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

from unirl_pl.plan.fake_views import fake_view
from unirl_pl.plan.snapshots import Snapshot

GiB = float(2**30)
PRIM_DEVICE = torch.ops.prim.device.default
LIFTS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)
CARRIED_NUMEL = 1 << 16
"""The most elements a tensor made by a factory (``arange``, ``zeros``) may have for its values to be carried."""
UNDEFINED = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
"""Operators whose results have no defined values to carry."""
_UNKNOWN = object()


@dataclass(frozen=True)
class Usage:
    """Bytes by category at one peak (or one moment) of a traced phase.

    Args:
        weights: Frozen parameters and buffers (the base models).
        trainable: LoRA parameters, their gradients and the optimizer's state.
        activations: Tensors made in forward passes (and by recomputation under checkpointing).
        temporaries: Tensors made during backward passes (gradients of activations).
        experience: Resident tensors tracked from outside (records, text features, pixels).
    """

    weights: int = 0
    trainable: int = 0
    activations: int = 0
    temporaries: int = 0
    experience: int = 0

    @property
    def total(self) -> int:
        """Sum of every category."""
        return self.weights + self.trainable + self.activations + self.temporaries + self.experience

    def as_dict(self) -> dict[str, int]:
        """The categories and the total, in bytes."""
        return {**asdict(self), "total": self.total}


def usage_from_snapshot(snapshot: dict[Any, dict[Any, int]], trainable_param_bytes: int) -> Usage:
    """Fold a ``MemTracker`` snapshot (device -> reference type -> bytes, summed over devices) into a
    :class:`Usage`. ``MemTracker`` files LoRA weights as parameters like the frozen ones; their bytes
    (``trainable_param_bytes``, fixed during a phase) move from ``weights`` to ``trainable``."""
    total: dict[Any, int] = {}
    for per_device in snapshot.values():
        for key, value in per_device.items():
            total[key] = total.get(key, 0) + value
    ref = _MemRefType
    params = total.get(ref.PARAM, 0) + total.get(ref.BUFFER, 0)
    lora = min(trainable_param_bytes, params)
    return Usage(
        weights=params - lora,
        trainable=lora + total.get(ref.GRAD, 0) + total.get(ref.OPT, 0),
        activations=total.get(ref.ACT, 0),
        temporaries=total.get(ref.TEMP, 0),
        experience=total.get(ref.OTH, 0),
    )


class PlanMemTracker(MemTracker):
    """``MemTracker`` for a LoRA RL step: see the module docstring for what differs and why.

    Args:
        trainable_param_bytes: Bytes of the trainable (LoRA) parameters, reported as ``trainable``.
    """

    def __init__(self, trainable_param_bytes: int = 0) -> None:
        super().__init__()
        self.trainable_param_bytes = trainable_param_bytes
        self.marks: dict[str, Usage] = {}
        self.mark_count = 0
        self._windows: dict[int, Snapshot] = {}
        self._window_count = 0

    # ------------------------------------------------------------------ MemTracker overrides

    def _track_module_params_and_buffers(
        self, module: torch.nn.Module, install_grad_hooks: bool = True
    ) -> tuple[int, int]:
        memory = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
        if install_grad_hooks:
            for param in module.parameters():
                if param.requires_grad and self._param_to_grad_hook_handles.get(param, None) is None:
                    self._param_to_grad_hook_handles[param] = (
                        param.register_hook(self._file_gradient),
                        param.register_post_accumulate_grad_hook(lambda p: self._file_gradient(p.grad)),
                    )
        return memory

    def _file_gradient(self, grad: torch.Tensor | None) -> None:
        # A hook must return None: a returned value would replace the gradient.
        if grad is not None:
            self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

    def _update_peak_stats(self, peak_state: Any) -> None:
        for device, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snapshot[_TOTAL_KEY]:
                self._peak_mem[device] = snapshot[_TOTAL_KEY]
                self._peak_mem_snap[device] = deepcopy(snapshot)
            for window in self._windows.values():
                if window.get(device, {}).get(_TOTAL_KEY, 0) < snapshot[_TOTAL_KEY]:
                    window[device] = dict(snapshot)

    def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
        # ``MemTracker._pre_fw_hook`` less its per-module snapshots and input bytes: a module seen first has its
        # parameters (and gradients) filed and gradient hooks installed; one seen again in backward is the
        # recomputation of a checkpointed block, whose outermost module marks the AC region (its tensors are
        # activations, not temporaries).
        name = self._mod_tracker.get_known_fqn(module)
        is_bw = self._mod_tracker.is_bw
        outer = set(self._mod_tracker.parents) - {name}
        if module in self.memory_tracking and not is_bw and outer == {"Global"}:
            del self.memory_tracking[module]
        if module not in self.memory_tracking:
            self._track_module_params_and_buffers(module, install_grad_hooks=True)
            self.memory_tracking[module] = _ModMemStats(name)
        elif is_bw and self._ac_mod is None:
            self._ac_mod = weakref.ref(module)
            self._in_ac = True

    def _post_fw_hook(self, module: torch.nn.Module, inputs: Any, outputs: Any) -> None:
        # ``MemTracker._post_fw_hook`` less its snapshot and output bytes: the AC region ends with its module.
        if self._ac_mod is not None and self._ac_mod() is module and self._mod_tracker.is_bw:
            self._ac_mod = None
            self._in_ac = False

    def _pre_bw_hook(self, module: torch.nn.Module, args: Any) -> None:
        # ``MemTracker``'s backward hooks only take per-module snapshots.
        pass

    def _post_bw_hook(self, module: torch.nn.Module, args: Any) -> None:
        pass

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # ``MemTracker.__torch_dispatch__`` with the result's tensors walked instead of mapped (most operators
        # return one tensor; ``tree_map_only`` rebuilt every result) and the peak kept as ``_update_peak_stats``
        # keeps it. A ``DTensor`` operator runs as its local operators, which are tracked; a fake mode entered
        # after the tracker is DTensor's sharding propagation, whose tensors no rank holds.
        if func is PRIM_DEVICE:
            # A tensor's device, asked by the dispatcher on most operators (over half the calls of a trace): it
            # allocates nothing, so it skips the bookkeeping below, and a fake tensor's is answered here as
            # ``FakeTensorMode`` answers it (its ``fake_device`` outside a kernel) without the modes below.
            tensor = args[0]
            if isinstance(tensor, FakeTensor) and not tensor.fake_mode.in_kernel_invocation:
                return tensor.fake_device
            return func(*args, **(kwargs or {}))
        if any(t == DTensor for t in types):
            return NotImplemented
        if func is torch.ops._c10d_functional.wait_tensor.default and active_fake_mode():
            res = args[0]  # the wait returns its input in a running fit; the fake kernel would copy it
        else:
            res = func(*args, **(kwargs or {}))
        if active_fake_mode() is self._fake_mode_on_entry:
            if self._in_opt:
                reftype = _MemRefType.OPT
            elif not self._in_ac and self._mod_tracker.is_bw:
                reftype = _MemRefType.TEMP
            else:
                reftype = _MemRefType.ACT
            if isinstance(res, torch.Tensor):
                self._track(reftype, res)
            else:
                for leaf in tree_leaves(res):
                    if isinstance(leaf, torch.Tensor):
                        self._track(reftype, leaf)
            self._update_peak_stats(None)
        return res

    # ------------------------------------------------------------------ windows (the block stand-ins)

    def open_window(self) -> int:
        """Keep the peak of an interval from now (one call's own rise), apart from the tracker's peak and other
        windows (two overlap where a block's backward ends as the next begins); returns the token to close it."""
        self._window_count += 1
        self._windows[self._window_count] = self.get_tracker_snapshot("current")
        return self._window_count

    def close_window(self, token: int) -> Snapshot:
        """End a window: its peak snapshot per device."""
        return self._windows.pop(token)

    def raise_peak(self, snapshot: Snapshot, windows: bool = True) -> None:
        """Take ``snapshot`` as the peak of each device where its total is higher (a stood-in call's peak), and as the
        peak of each open window unless ``windows`` is off (a moment from before they opened)."""
        for device, keys in snapshot.items():
            total = keys.get(_TOTAL_KEY, 0)
            if self._peak_mem.get(device, 0) < total:
                self._peak_mem[device] = total
                self._peak_mem_snap[device] = dict(keys)
            for window in self._windows.values() if windows else ():
                if window.get(device, {}).get(_TOTAL_KEY, 0) < total:
                    window[device] = dict(keys)

    def enter_modules(self, modules: Iterator[torch.nn.Module] | list[torch.nn.Module]) -> None:
        """File the parameters of ``modules`` as :meth:`_pre_fw_hook` does for a module seen first (a stood-in block's
        submodules, which never run): FSDP2's all-gathered parameters, made as activations, become parameters."""
        for module in modules:
            if module not in self.memory_tracking:
                self._track_module_params_and_buffers(module, install_grad_hooks=True)
                self.memory_tracking[module] = _ModMemStats(self._mod_tracker.get_known_fqn(module) or "")

    # ------------------------------------------------------------------ what the plan reads

    def current(self) -> Usage:
        """The memory tracked right now."""
        return usage_from_snapshot(self.get_tracker_snapshot("current"), self.trainable_param_bytes)

    def peak(self) -> Usage:
        """The peak since the tracker was entered or since the last :meth:`mark`."""
        return usage_from_snapshot(self.get_tracker_snapshot("peak"), self.trainable_param_bytes)

    def mark(self, name: str) -> Usage:
        """Record the peak since the last mark under ``name`` and start a new peak from now."""
        self.marks[name] = self.peak()
        self.mark_count += 1
        current = self.get_tracker_snapshot("current")
        self._peak_mem = {device: snapshot[_TOTAL_KEY] for device, snapshot in current.items()}
        self._peak_mem_snap = current
        return self.marks[name]


class AllRowsReal(TorchDispatchMode):
    """Answers the questions about a fake tensor's values that shapes cannot: a fake tensor has none.

    The losses compute their ratio statistics over the real (masked-in) tokens, ``ratio[mask]`` after ``mask.any()``;
    on fake tensors both need values. Under this mode every such question gets the answer of a batch whose rows are
    all real, the largest case: a boolean is true, a number is 1, ``nonzero`` finds every element and a boolean index
    selects every row. Views are made by :func:`~unirl_pl.plan.fake_views.fake_view` while no values are carried;
    other operators pass through. Enter it inside ``FakeTensorMode`` (and below any memory tracker), so the tensors
    it makes are fake and tracked.

    Some inputs have values that set shapes: Qwen2.5-VL's image grid decides how many patches its vision tower runs,
    how they split into attention windows and how many image tokens the prompt must hold (transformers checks that
    count, and splits the features per image, from the values). While :meth:`carrying_values` is on, the values of
    the fake tensors a trace makes from Python data (``torch.tensor`` literals; factories with defined values, such
    as ``arange``, of at most :data:`CARRIED_NUMEL` elements) are kept beside them on real CPU tensors, and every
    operator whose tensor inputs all have values computes its result's values too (a data-dependent shape, a
    ``nonzero`` or a boolean index of such a tensor, gets its true size): such questions get the true answer. A tensor
    derived from weights or activations has no values and gets the all-rows answer as before; one written in place
    from such a tensor loses its values. Off by default: the other traces never read a literal's values (a padding
    mask made from literals would materialise an attention mask the all-rows answer skips).
    """

    def __init__(self) -> None:
        super().__init__()
        self.values: WeakIdKeyDictionary | None = None

    @contextmanager
    def carrying_values(self) -> Iterator[None]:
        """Carry the values of the fake tensors made from Python data (see the class docstring) until exit."""
        previous = self.values
        self.values = WeakIdKeyDictionary() if previous is None else previous
        try:
            yield
        finally:
            self.values = previous

    def _carry(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """The result of ``func`` with its values carried, or ``_UNKNOWN`` when its inputs have none."""
        values = self.values
        assert values is not None
        if func in LIFTS:  # torch.tensor(data): the literal's values are the real tensor being lifted
            out = func(*args, **kwargs)
            if isinstance(out, FakeTensor):
                with unset_fake_temporarily():
                    values[out] = args[0].detach().clone()
            return out
        if getattr(func, "_opname", None) in UNDEFINED:
            return _UNKNOWN
        tensors = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        fakes = [t for t in tensors if isinstance(t, FakeTensor)]
        if not tensors:  # a factory: carried when its result is small
            out = func(*args, **kwargs)
            if isinstance(out, FakeTensor) and out.numel() <= CARRIED_NUMEL:
                with unset_fake_temporarily():
                    values[out] = func(*args, **kwargs)
            return out
        if not fakes or not all(t in values for t in fakes):
            if fakes and getattr(getattr(func, "_schema", None), "is_mutable", False):
                for tensor in fakes:  # written from a tensor without values: its own are gone
                    values.pop(tensor, None)
            return _UNKNOWN
        real_args, real_kwargs = tree_map_only(FakeTensor, values.__getitem__, (args, kwargs))
        with unset_fake_temporarily():
            real = func(*real_args, **real_kwargs)
        if not any(isinstance(leaf, torch.Tensor) for leaf in tree_leaves(real)):
            return real  # a Python value (``item()``, ``tolist()``): the true answer
        try:
            out = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            # Its shape depends on the values (``nonzero``, a boolean index): a fake tensor of the true shape.
            mode = fakes[0].fake_mode
            out = tree_map_only(torch.Tensor, mode.from_tensor, real)
        for fake, value in zip(tree_leaves(out), tree_leaves(real), strict=False):
            if isinstance(fake, FakeTensor) and isinstance(value, torch.Tensor):
                values[fake] = value
        return out

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.values is None and (view := fake_view(func, args, kwargs)) is not None:
            return view  # a view allocates nothing: made without the fake mode's checks
        if self.values is not None:
            carried = self._carry(func, args, kwargs)
            if carried is not _UNKNOWN:
                return carried
        aten = torch.ops.aten
        if func is aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
            tensor = args[0]
            return True if tensor.dtype == torch.bool else 1.0 if tensor.is_floating_point() else 1
        if func is aten.nonzero.default and isinstance(args[0], FakeTensor):
            tensor = args[0]
            return torch.empty((tensor.numel(), tensor.dim()), dtype=torch.long, device=tensor.device)
        if func is aten.index.Tensor and isinstance(args[0], FakeTensor):
            source, indices = args[0], args[1]
            if len(indices) == 1 and indices[0] is not None and indices[0].dtype == torch.bool:
                kept = indices[0].dim()
                return source.reshape(-1, *source.shape[kept:]).clone()
        return func(*args, **kwargs)


@contextmanager
def carrying_values() -> Iterator[None]:
    """:meth:`AllRowsReal.carrying_values` of the innermost active ``AllRowsReal`` (nothing to do without one, or on
    real tensors, which have their values)."""
    modes = [mode for mode in _get_current_dispatch_mode_stack() if isinstance(mode, AllRowsReal)]
    if not modes:
        yield
        return
    with modes[-1].carrying_values():
        yield


def carried_bytes(tensor: torch.Tensor) -> bytes | None:
    """The bytes of the values the innermost active ``AllRowsReal`` carries beside ``tensor``, or None (none carried,
    or no such mode)."""
    modes = [mode for mode in _get_current_dispatch_mode_stack() if isinstance(mode, AllRowsReal)]
    values = modes[-1].values if modes else None
    value = None if values is None else values.get(tensor)
    if value is None:
        return None
    with _disable_current_modes():  # a real tensor: read without the tracker and the fake mode
        return value.detach().contiguous().flatten().view(torch.uint8).numpy().tobytes()
