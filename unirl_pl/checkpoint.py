"""Atomic checkpoint files, RNG capture, and trimming frozen base weights out of checkpoints.

A checkpoint must survive a crash in the middle of being written: :class:`AtomicCheckpointIO`
writes to a temporary file next to the target, fsyncs it and ``os.replace`` s it over the target,
so the target path either holds the previous complete checkpoint or the new complete one. The
frozen base weights of every expert are rebuilt deterministically by ``configure_model`` (seeded
init or ``pretrained_path``), so checkpoints keep only trainable and LoRA tensors; on load the
trimmed keys are refilled from the freshly built model so strict loading still catches real
mismatches. Rollout randomness is a pure function of (seed, request id, sample), but the global
RNGs are saved and restored too so user code that draws from them resumes exactly.
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO

TRIMMED_KEY = "unirl_trimmed_keys"


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose writes are atomic on local filesystems (temp file + ``os.replace``).

    Remote (fsspec) paths fall back to Lightning's own writer, which has no rename-based atomicity.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None or get_filesystem(path).protocol not in ("file", ("file", "local")):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        # Same directory as the target so os.replace is a rename within one filesystem.
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
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
