"""Stand-ins for the repeated blocks of a model in a plan's trace.

A real-size trace spends most of its time dispatching one block's operators again and again: a 60-block DiT
runs the same block 60 times a forward, a refiner its 28 decoder layers at every decode step. A block that is a
copy of an earlier one (same class, same parameter shapes and trainability) called with inputs of the same kind
(same shapes, strides, dtypes, devices and gradient flags, other arguments, KV-cache length, autograd and
checkpointing on or off) leaves the same bytes held and rises the same bytes above what was held when it
started. So the first such call is traced (the template: its rise and what it leaves held are read off the
tracker) and every later one stands in:

- the tracker's peak is raised to what the block would have reached: the bytes held when it is called plus
  the template's rise, per category (:meth:`PlanMemTracker.raise_peak`), so no argument about where the peak
  falls is needed;
- its KV-cache entries go through the cache's own ``update`` at this block's layer, at the template's shapes;
- its outputs are allocated at the template's shapes, strides and storages (an output that views an input
  views this call's input), and its parameters are filed as the tracker files a module it enters first;
- with autograd on, it is one node of the graph (``StandInFunction``) that holds what the template left held
  beyond its outputs (the activations it saved, as one buffer) and the inputs the template kept alive (saved,
  or held by checkpointing) until its backward, which raises the peak by the template's backward rise, frees
  them, and gives the inputs and the trainable parameters their gradients (FSDP2 then reduces those as a
  block's). The template's backward is measured between gradient hooks on its outputs and inputs; it runs after
  the stand-ins' (the template is the second block: the first backpropagates last and alone frees what every
  copy saved), so their raises wait until it is known.

What each stand-in leaves held is checked against its template's: a difference stops the plan with an error
naming the block (``--trace-every-block`` traces without stand-ins) rather than giving a wrong figure; so does a
stand-in whose backward ran without its template's.

The stand-in replaces the block's ``forward``, not its call: FSDP2's hooks on the block (the all-gather before it,
the reshard after) and checkpointing around it run as in the trace. Never stood in: an FSDP2 unit's calls with
autograd (its backward all-gathers, prefetches and reduce-scatters in an order a stand-in does not reproduce),
blocks with hooks of their own below them (an FSDP unit inside a block; transformers' output-capturing
hooks only while the running forward asks for their outputs), a checkpointed block's recomputation (part
of its template's backward), and kinds of call whose template leaves held anything but its outputs, cache entries
and saved activations, or (with autograd) returns an input, or has no input or output with a gradient.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.distributed._tools.mem_tracker import _TOTAL_KEY
from torch.distributed.fsdp import FSDPModule
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map_only, tree_unflatten

from unirl_pl.plan.snapshots import Snapshot, snapshot_add, snapshot_diff
from unirl_pl.plan.stacks import (
    TensorLike,
    cache_class,
    checkpointing,
    inner_hooks,
    layer_index,
    repeated_blocks,
    requested_outputs,
)
from unirl_pl.plan.standin_autograd import BackwardWindow, StandInCall, StandInFunction
from unirl_pl.plan.templates import Out, Template, stand_in_outputs
from unirl_pl.plan.tracker import PlanMemTracker, carried_bytes


class BlockStandIns:
    """Stands in for the repeated calls of the blocks under ``roots`` while entered (see the module docstring).

    Args:
        roots: The models whose ``ModuleList`` stacks are stood in.
        tracker: The entered tracker whose peak and current bytes the stand-ins read and raise.
        check: Trace every call instead, and list in ``mismatches`` each one that would have stood in but rose or
            left held other bytes than its template (the test of the stand-ins' premise).
    """

    def __init__(self, roots: Sequence[torch.nn.Module], tracker: PlanMemTracker, check: bool = False) -> None:
        self.tracker, self.check = tracker, check
        self.mismatches: list[tuple[str, Snapshot, Snapshot, Snapshot, Snapshot]] = []
        self.blocks = repeated_blocks(roots)
        self.templates: dict[tuple, Template | None] = {}
        self.stood_in = 0
        self._saved: dict[torch.nn.Module, Any] = {}
        self._cache = cache_class()
        self._inside = 0
        self._first: dict[tuple, torch.nn.Module] = {}  # the first block of each stack called with autograd
        self._passes: dict[tuple, int] = {}  # the passes with autograd through each stack so far

    def __enter__(self) -> BlockStandIns:
        for block in self.blocks:
            self._saved[block] = block.__dict__.get("forward")
            block.forward = functools.partial(self._call, block, block.forward)
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        for block, forward in self._saved.items():
            if forward is None:
                del block.forward
            else:
                block.forward = forward
        self._saved.clear()
        waiting = [t for t in self.templates.values() if t is not None and t.backward and t.backward.pending]
        if kind is None and waiting:
            raise RuntimeError(
                "plan: a stood-in block's backward ran but its traced copy's never did (a backward that stops inside a "
                "stack of blocks), so its peak is unknown; rerun with --trace-every-block"
            )

    # ------------------------------------------------------------------ the call

    def _key(self, block: torch.nn.Module, leaves: list[Any], spec: Any) -> tuple:
        """The kind of a call: the block's stack and fingerprint, the inputs' structure, each tensor's shape,
        stride, dtype, device and gradient flag, each KV cache's length at this block's layer, the other arguments'
        values (or types), autograd and checkpointing on or off, the tracker's recomputation flag, whether the
        tracker has seen the block's modules (the first call files FSDP2's all-gathered parameters as parameters),
        and with autograd the pass through the stack and whether the block is its first or last copy."""
        layer = layer_index(block)
        seen = all(m in self.tracker.memory_tracking for m in block.modules() if m is not block)
        stack, fingerprint, last = self.blocks[block]
        grad = torch.is_grad_enabled()
        first = grad and self._first.setdefault((stack, fingerprint), block) is block
        if first:
            self._passes[stack, fingerprint] = self._passes.get((stack, fingerprint), 0) + 1
        parts: list[Any] = [
            stack,
            fingerprint,
            last and grad,
            # The first copy backpropagates last, alone freeing what every copy saved: no template for the others.
            first,
            # With autograd, each pass through the stack (a guided step's conditional and unconditional forwards)
            # has its own traced copy: a stand-in's backward rise is its own pass's.
            self._passes.get((stack, fingerprint)) if grad else None,
            str(spec),
            torch.is_grad_enabled(),
            checkpointing(),
            self.tracker._in_ac,
            seen,
        ]
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                # With the values of index arithmetic carried, a block's sizes may follow them (Qwen2.5-VL's
                # vision attention splits its patches at ``cu_seqlens``): they are part of the kind.
                values = carried_bytes(leaf)
                parts.append((tuple(leaf.shape), leaf.stride(), leaf.dtype, leaf.device, leaf.requires_grad, values))
            elif self._cache is not None and isinstance(leaf, self._cache):
                parts.append(("cache", id(leaf), None if layer is None else leaf.get_seq_length(layer)))
            elif leaf is None or isinstance(leaf, (bool, int, float, str)):
                parts.append(leaf)
            else:
                parts.append(type(leaf).__qualname__)
        return tuple(parts)

    @contextmanager
    def _real(self) -> Iterator[None]:
        """A block's own forward runs: blocks called inside it are its parts, traced with it."""
        self._inside += 1
        try:
            yield
        finally:
            self._inside -= 1

    def _call(self, block: torch.nn.Module, forward: Any, *args: Any, **kwargs: Any) -> Any:
        if self._inside or (torch.is_grad_enabled() and self.tracker._mod_tracker.is_bw):
            # Inside another block's traced call, or a checkpointed block's recomputation (part of its traced backward).
            return forward(*args, **kwargs)
        if torch.is_grad_enabled() and isinstance(block, FSDPModule):
            # An FSDP2 unit's backward all-gathers, prefetches and reduce-scatters around its recomputation; a
            # stand-in's backward does not reproduce that order, so an FSDP unit trains traced (its forwards without
            # autograd stand in).
            with self._real():
                return forward(*args, **kwargs)
        captured, asked = inner_hooks(block)[1], requested_outputs()
        if captured and (asked is None or captured & asked):
            # A transformers forward asks the hooks inside the block for their outputs (its attentions): it runs.
            with self._real():
                return forward(*args, **kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        key = self._key(block, leaves, spec)
        template = self.templates.get(key)
        if key not in self.templates or template is None or self.check:
            # A traced call: no reference to its inputs here (one it drops, such as a cache entry it replaces, is
            # freed in the trace as in a fit).
            del leaves
            if key not in self.templates:
                return self._trace(block, forward, key, spec, args, kwargs)
            if template is None or template.backward is not None:
                with self._real():
                    return forward(*args, **kwargs)
            rise, held, out = self._measure(block, forward, args, kwargs)[:3]
            if (rise, held) != (template.rise, template.held):
                self.mismatches.append((type(block).__qualname__, rise, template.rise, held, template.held))
            return out
        return self._stand_in(block, template, leaves)

    @contextmanager
    def _cache_updates(self, layer: int | None) -> Iterator[list]:
        """Record the KV-cache updates made while entered (``None`` in the list: one at another layer)."""
        recorded: list = []
        if self._cache is None:
            yield recorded
            return
        cache_class, real = self._cache, self._cache.update

        def update(cache: Any, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kw: Any) -> Any:
            if layer_idx != layer or args:
                recorded.append(None)
            else:
                # Tensors among the cache's keyword arguments (position ids, rotary cos/sin) are kept as their
                # shapes: holding the template's own would keep them alive.
                kept = tree_map_only(torch.Tensor, TensorLike.of, dict(kw))
                recorded.append((key.shape, key.dtype, value.shape, value.dtype, key.device, kept))
            return real(cache, key, value, layer_idx, *args, **kw)

        cache_class.update = update  # type: ignore[method-assign]
        try:
            yield recorded
        finally:
            cache_class.update = real  # type: ignore[method-assign]

    def _measure(
        self, block: torch.nn.Module, forward: Any, args: Any, kwargs: Any
    ) -> tuple[Snapshot, Snapshot, Any, list]:
        """Trace one call: its rise over its start, what it left held, its output and its cache updates."""
        tracker = self.tracker
        before = tracker.get_tracker_snapshot("current")
        window = tracker.open_window()
        try:
            with self._cache_updates(layer_index(block)) as updates, self._real():
                out = forward(*args, **kwargs)
        finally:
            peak = tracker.close_window(window)
        held = snapshot_diff(tracker.get_tracker_snapshot("current"), before)
        return snapshot_diff(peak, before), held, out, updates

    def _trace(self, block: torch.nn.Module, forward: Any, key: tuple, spec: Any, args: Any, kwargs: Any) -> Any:
        # The call runs on its own arguments (a list it writes into is the caller's), its inputs only weakly referenced
        # here. Each input's references from outside Python (a tensor saved for backward holds one) before the call:
        before, _ = tree_flatten((args, kwargs))
        uses = [leaf._use_count() if isinstance(leaf, torch.Tensor) else 0 for leaf in before]
        refs = [weakref.ref(leaf) if isinstance(leaf, torch.Tensor) else leaf for leaf in before]
        del before
        rise, held, out, updates = self._measure(block, forward, args, kwargs)
        leaves, after_spec = tree_flatten((args, kwargs))
        same = [ref() if isinstance(ref, weakref.ref) else ref for ref in refs]
        if str(after_spec) != str(spec) or any(a is not b for a, b in zip(leaves, same, strict=True)):
            # The call wrote into a container it was given (the Wan VAE's causal-convolution cache, its index):
            # a stand-in would not, so this kind is traced every time.
            self.templates[key] = None
            return out
        if not torch.is_grad_enabled():
            self.templates[key] = self._template(rise, held, out, leaves, updates, None)
            return out
        # With autograd: gradient hooks on the outputs (the first made: the backward begins) and on the inputs that
        # need gradients (all made: it ends) bound the call's backward (see ``BackwardWindow``); without both, it is
        # traced only.
        needs = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
        graded = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        template = None
        if needs and graded:
            window = BackwardWindow(self.tracker)
            template = self._template(rise, held, out, leaves, updates, window)
            if template is not None:
                # The inputs the call keeps for its backward: those it saved, or under checkpointing (which keeps a
                # block's arguments to recompute it) every one.
                saving = checkpointing()
                template.kept = [
                    i
                    for i, (leaf, before) in enumerate(zip(leaves, uses, strict=True))
                    if isinstance(leaf, torch.Tensor) and (saving or leaf._use_count() > before)
                ]
                register_multi_grad_hook(graded, lambda grad: window.open(), mode="any")
                register_multi_grad_hook(graded, window.received, mode="all")
                register_multi_grad_hook(needs, window.close, mode="all")
        self.templates[key] = template
        return out

    def _template(
        self, rise: Snapshot, held: Snapshot, out: Any, leaves: list[Any], updates: list, window: BackwardWindow | None
    ) -> Template | None:
        """The template of a traced call, or None when its kind cannot stand in: what it left held is not its
        outputs and cache entries (and, with autograd, the tensors saved for its backward), an output storage holds
        two dtypes, an update went to another layer, a new output carries values (:meth:`AllRowsReal.carrying_values`);
        with autograd also an output that is or views an input, or a floating output without a gradient."""
        if any(u is None for u in updates):
            return None
        inputs = {
            StorageWeakRef(leaf.untyped_storage()): i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)
        }
        out_leaves, spec = tree_flatten(out)
        storages: dict[StorageWeakRef, int] = {}
        layout: list[tuple[int, torch.dtype, torch.device]] = []
        outputs: list[Any] = []
        for leaf in out_leaves:
            if not isinstance(leaf, torch.Tensor):
                outputs.append(leaf)
                continue
            ref = StorageWeakRef(leaf.untyped_storage())
            view = dict(shape=tuple(leaf.shape), stride=leaf.stride(), offset=leaf.storage_offset(), dtype=leaf.dtype)
            same = next((i for i, t in enumerate(leaves) if t is leaf), None)
            if same is None and carried_bytes(leaf) is not None:
                return None  # an output with carried values: a stand-in's would have none
            if window is not None and (same is not None or ref in inputs):
                return None
            if window is not None and (leaf.is_floating_point() or leaf.is_complex()) and not leaf.requires_grad:
                return None
            if same is not None:
                outputs.append(Out(**view, source=same, same=True))
                continue
            if ref in inputs:
                if leaves[inputs[ref]].dtype != leaf.dtype:
                    return None
                outputs.append(Out(**view, source=inputs[ref]))
                continue
            if ref not in storages:
                storages[ref] = len(layout)
                layout.append((leaf.untyped_storage().nbytes(), leaf.dtype, leaf.device))
            elif layout[storages[ref]][1] != leaf.dtype:
                return None
            outputs.append(Out(**view, new=storages[ref]))
        made = sum(nbytes for nbytes, _, _ in layout)
        made += sum(k.numel() * kd.itemsize + v.numel() * vd.itemsize for k, kd, v, vd, _, _ in updates)
        saved = sum(device[_TOTAL_KEY] for device in held.values()) - made
        if saved < 0 or (saved and window is None) or (saved and len(held) != 1):
            return None
        return Template(rise, held, spec, outputs, layout, updates, saved, window)

    def _stand_in(self, block: torch.nn.Module, template: Template, leaves: list[Any]) -> Any:
        tracker = self.tracker
        before = tracker.get_tracker_snapshot("current")
        tracker.raise_peak(snapshot_add(before, template.rise))
        tracker.enter_modules(m for m in block.modules() if m is not block)
        if template.updates:
            cache = next(leaf for leaf in leaves if isinstance(leaf, self._cache))  # type: ignore[arg-type]
            layer = layer_index(block)
            for k_shape, k_dtype, v_shape, v_dtype, device, kw in template.updates:
                key = torch.empty(k_shape, dtype=k_dtype, device=device)
                value = torch.empty(v_shape, dtype=v_dtype, device=device)
                cache.update(key, value, layer, **tree_map_only(TensorLike, TensorLike.make, kw))
                del key, value
        if template.backward is None:
            result = tree_unflatten(stand_in_outputs(template, leaves), template.spec)
        else:
            needs = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
            params = [p for p in block.parameters() if p.requires_grad]

            def make() -> tuple[torch.Tensor, ...]:
                return tuple(t for t in stand_in_outputs(template, leaves) if isinstance(t, torch.Tensor))

            device = next(iter(template.held))
            kept = [leaves[i] for i in template.kept]
            call = StandInCall(make, template.saved, device, template.backward, needs, params, kept)
            made = iter(StandInFunction.apply(call, *needs, *params))
            outs = [next(made) if isinstance(out, Out) else out for out in template.outputs]
            result = tree_unflatten(outs, template.spec)
        held = snapshot_diff(tracker.get_tracker_snapshot("current"), before)
        if held != template.held:
            raise RuntimeError(
                f"plan: the stand-in for a call of {type(block).__qualname__} left {held} held where its traced "
                f"copy left {template.held}; rerun with --trace-every-block"
            )
        self.stood_in += 1
        return result
