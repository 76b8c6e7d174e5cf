"""Atomic checkpoint files, RNG capture, and trimming frozen base weights out of checkpoints.

A checkpoint must survive a crash in the middle of being written: :class:`AtomicCheckpointIO`
writes to a temporary file next to the target, fsyncs it and ``os.replace`` s it over the target,
so the target path either holds the previous complete checkpoint or the new complete one. The
frozen base weights of every expert are rebuilt deterministically by ``configure_model`` (seeded
init or ``pretrained_path``), so checkpoints keep only trainable and LoRA tensors; on load the
trimmed keys are refilled from the freshly built model so strict loading still catches real
mismatches; under FSDP2 the frozen weights are not even gathered (:func:`gather_trainable_on_save`).
Rollout randomness is a pure function of (seed, request id, sample), but the global RNGs are saved
and restored too so user code that draws from them resumes exactly.
"""

from __future__ import annotations

import os
import random
import re
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO

from unirl_pl.errors import InputError
from unirl_pl.identity import check_identity, run_identity, saved_ema_identity

TRIMMED_KEY = "unirl_trimmed_keys"
IDENTITY_KEY = "unirl_run_identity"

# A temp file older than this is stale whoever wrote it (a live writer keeps touching its file).
STALE_TMP_AGE_S = 900.0
_HOST = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host"
# ``.<target name>.<host>.<pid>.<mkstemp random>.tmp``; older writers used ``.<target name>.<random>.tmp``.
_TMP_NAME = re.compile(r"^\.(?P<target>.+)\.(?P<host>[A-Za-z0-9-]+)\.(?P<pid>\d+)\.[A-Za-z0-9_]+\.tmp$")


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose writes are atomic on local filesystems (temp file + ``os.replace``).

    Remote (fsspec) paths fall back to Lightning's own writer, which has no rename-based atomicity.
    The first save into a folder removes the temp files that dead writers left there
    (:func:`remove_stale_tmp`).
    """

    def __init__(self) -> None:
        super().__init__()
        self._swept: set[Path] = set()

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None or get_filesystem(path).protocol not in ("file", ("file", "local")):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        folder = target.parent.resolve()
        if folder not in self._swept:
            self._swept.add(folder)
            remove_stale_tmp(folder)
        # Same directory as the target so os.replace is a rename within one filesystem; host and pid in
        # the name let a later run tell a dead writer's leftover from a live writer's file.
        prefix = f".{target.name}.{_HOST}.{os.getpid()}."
        fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        _fsync_dir(target.parent)

    def load_checkpoint(
        self, path: Any, map_location: Any = lambda storage, loc: storage, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Lightning's loader, with ``weights_only=True`` unless the caller asks otherwise.

        Lightning passes ``None`` (``--weights_only`` unset), which is ``torch.load``'s own default
        locally (``True`` only since torch 2.6) and ``False`` for http(s) URLs; a checkpoint from
        elsewhere must not be able to run code, so ``None`` means ``True`` here.
        """
        weights_only = True if weights_only is None else weights_only
        return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)


def remove_stale_tmp(dirpath: str | os.PathLike, min_age_s: float = STALE_TMP_AGE_S) -> list[Path]:
    """Delete the temp files (``.*.tmp``) that interrupted :class:`AtomicCheckpointIO` writes left in ``dirpath``.

    A temp file is stale when its writer is a process of this host that no longer runs, or when it
    has not been modified for ``min_age_s`` seconds (a writer on another host, or an older name
    without host and pid). Files of live writers, including this process's, are kept, so two runs
    sharing a folder do not break each other's writes. Returns the removed paths; a missing folder
    removes nothing.
    """
    folder = Path(dirpath)
    if not folder.is_dir():
        return []
    removed, now = [], time.time()
    for path in folder.glob(".*.tmp"):
        try:
            if not path.is_file() or path.is_symlink():
                continue
            age = now - path.stat().st_mtime
        except OSError:  # removed meanwhile
            continue
        match = _TMP_NAME.match(path.name)
        dead_writer = (
            match is not None
            and match["host"] == _HOST
            and int(match["pid"]) != os.getpid()
            and not _pid_alive(int(match["pid"]))
        )
        if dead_writer or age >= min_age_s:
            try:
                path.unlink()
            except FileNotFoundError:
                continue
            removed.append(path)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists but belongs to someone else, or cannot be probed: assume alive
        return True
    return True


def _fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable; not every platform can open a directory.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_states() -> dict[str, Any]:
    """The global torch, numpy and Python RNG states, in types ``torch.load(weights_only=True)`` accepts."""
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": _to_lists(random.getstate())}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        states["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(gauss)]
    except ImportError:  # numpy is optional
        pass
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore what :func:`rng_states` captured."""
    torch.set_rng_state(states["torch"])
    random.setstate(_to_tuples(states["python"]))
    if "numpy" in states:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = states["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def _to_lists(value: Any) -> Any:
    return [_to_lists(v) for v in value] if isinstance(value, tuple) else value


def _to_tuples(value: Any) -> Any:
    return tuple(_to_tuples(v) for v in value) if isinstance(value, list) else value


def trim_frozen(state_dict: dict[str, Any], module: torch.nn.Module) -> tuple[dict[str, Any], list[str]]:
    """Drop frozen non-LoRA parameters and buffers from ``state_dict``; return it and the dropped keys.

    Kept: every parameter that requires grad and every LoRA tensor (a frozen expert's adapter may
    have been loaded from elsewhere, so it is not assumed to be at its init).
    """
    trainable = {name for name, p in module.named_parameters() if p.requires_grad}
    kept, dropped = {}, []
    for key, value in state_dict.items():
        if key in trainable or "lora_" in key:
            kept[key] = value
        else:
            dropped.append(key)
    return kept, dropped


def trainable_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """The full (unsharded) CPU copies of what a checkpoint keeps of ``model`` (:func:`trim_frozen`'s keys:
    every trainable parameter and every LoRA tensor, plus the buffers), gathered without the frozen base
    weights: on rank 0 the tensors, on the other ranks ``{}``. Every rank must call it (the gathers are
    collectives, run in the same order everywhere).

    ``get_model_state_dict`` with ``ignore_frozen_params`` drops the frozen parameters before it gathers
    anything; a frozen expert's adapter (frozen LoRA, which :func:`trim_frozen` keeps) is gathered after it.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    state = get_model_state_dict(model, options=options)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    for name, param in model.named_parameters():
        if param.requires_grad or "lora_" not in name:
            continue
        value = param.detach()
        if hasattr(value, "full_tensor"):  # a DTensor shard: every rank joins the gather
            value = value.full_tensor()
        if rank0:
            state[name] = value.to("cpu", copy=True)
    return state


def gather_trainable_on_save(strategy: Any) -> bool:
    """Make an FSDP2 strategy's full-checkpoint save gather only what :func:`save_run_state` keeps.

    Lightning's ``ModelParallelStrategy`` (with ``save_distributed_checkpoint=False``) collects the model with
    ``get_model_state_dict(full_state_dict=True)``: every frozen base weight is all-gathered and copied to rank
    0's host (Wan2.2 A14B: both 14B experts, about 57 GB) before ``on_save_checkpoint`` trims them away. This
    replaces the strategy's collection with :func:`trainable_state_dict`, so the file is the same and only the
    trained tensors travel. Other strategies (and distributed checkpoints, whose loader reads every key back
    from the shards) are left alone. Returns whether the strategy now gathers trainable tensors only.
    """
    from types import MethodType

    from lightning.pytorch.strategies import ModelParallelStrategy

    if not isinstance(strategy, ModelParallelStrategy) or strategy._save_distributed_checkpoint:
        return False

    def lightning_module_state_dict(self: ModelParallelStrategy) -> dict[str, Any]:
        assert self.model is not None
        return trainable_state_dict(self.model)

    strategy.lightning_module_state_dict = MethodType(lightning_module_state_dict, strategy)
    return True


def refill_trimmed(checkpoint: dict[str, Any], module: torch.nn.Module) -> None:
    """Put the freshly built values of the keys :func:`trim_frozen` dropped back into ``checkpoint``.

    Only the recorded keys are refilled, so a checkpoint missing a trainable tensor still fails
    strict loading.
    """
    dropped = checkpoint.get(TRIMMED_KEY)
    if not dropped or "state_dict" not in checkpoint:
        return
    current = module.state_dict()
    missing = [k for k in dropped if k not in current]
    if missing:
        raise KeyError(f"checkpoint was trimmed of base weights this model does not have: {missing[:3]}")
    checkpoint["state_dict"] = {**{k: current[k] for k in dropped}, **checkpoint["state_dict"]}


def save_run_state(module: Any, checkpoint: dict[str, Any]) -> None:
    """What a resume needs beyond Lightning's state: weight versions, skipped steps, the run identity, RNG
    states and each algorithm's state; the frozen base weights are trimmed (``configure_model`` rebuilds
    them, and keeping them would bloat every checkpoint)."""
    if not all(bool(torch.isfinite(p).all()) for p in module.parameters() if p.requires_grad):
        raise RuntimeError("refusing to write a checkpoint: a trainable weight is not finite")
    checkpoint["unirl_versions"] = module.ledger.as_dict()
    checkpoint["unirl_skipped_steps"] = module.skipped_steps
    checkpoint[IDENTITY_KEY] = run_identity(module)
    checkpoint["unirl_rng"] = rng_states()
    checkpoint["unirl_algorithms"] = {
        role: {"class": _qualname(alg), "state": alg.state_dict()} for role, alg in module.algorithms().items()
    }
    state = checkpoint["state_dict"]
    # An FSDP2 save (gather_trainable_on_save) never gathered the frozen base weights: they are trimmed too.
    left_out = [
        name
        for name, p in module.named_parameters()
        if state and not p.requires_grad and "lora_" not in name and name not in state
    ]
    checkpoint["state_dict"], dropped = trim_frozen(state, module)
    checkpoint[TRIMMED_KEY] = left_out + dropped


def load_run_state(module: Any, checkpoint: dict[str, Any]) -> None:
    """Restore :func:`save_run_state`; a resume that changes what is trained, how (LoRA, optimizers, lr), the
    seed, the EMA or an algorithm is refused (:class:`~unirl_pl.errors.InputError`: one line on the command line)."""
    if IDENTITY_KEY in checkpoint:
        saved = checkpoint[IDENTITY_KEY]
        if "ema" not in saved:  # written before the identity held the EMA: what the checkpoint holds says
            saved = {**saved, **saved_ema_identity(checkpoint)}
        path = getattr(getattr(module, "_trainer", None), "ckpt_path", None)
        check_identity(saved, run_identity(module), path)
    if "unirl_versions" in checkpoint:
        module.ledger.load(checkpoint["unirl_versions"])
    module.skipped_steps = int(checkpoint.get("unirl_skipped_steps", 0))
    if "unirl_rng" in checkpoint:
        set_rng_states(checkpoint["unirl_rng"])
    for role, saved in checkpoint.get("unirl_algorithms", {}).items():
        algorithm = module.algorithms().get(role)
        if algorithm is None:
            continue
        if saved["class"] != _qualname(algorithm):
            raise InputError(
                f"the checkpoint was trained with model.{role}={saved['class']}, this run configures "
                f"{_qualname(algorithm)}: resume with the same algorithm"
            )
        algorithm.load_state_dict(saved["state"])
    refill_trimmed(checkpoint, module)


def _qualname(obj: object) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"
