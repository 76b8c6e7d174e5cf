"""Where a run's checkpoints are, and putting a checkpoint's trainable weights and optimizer states back
in place in the middle of a fit (the ``rollback`` action of :class:`~unirl_pl.callbacks.RewardHackingMonitor`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint


def checkpoint_folder(trainer: pl.Trainer) -> Path:
    """The run's checkpoint folder: the first ``ModelCheckpoint``'s, else ``<log_dir>/checkpoints``."""
    for callback in trainer.callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath:
            return Path(callback.dirpath)
    return Path(trainer.log_dir or trainer.default_root_dir) / "checkpoints"


def checkpoints_before(trainer: pl.Trainer, step: int) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint (by file time) in the run's checkpoint folders whose ``global_step`` is below
    ``step``, with its loaded contents; None when there is none."""
    folders = {checkpoint_folder(trainer)} | {
        Path(cb.dirpath) for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath
    }
    files = [f for folder in folders if folder.is_dir() for f in folder.glob("*.ckpt")]
    for path in sorted(files, key=lambda f: f.stat().st_mtime, reverse=True):
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
        if int(checkpoint.get("global_step", step)) < step:
            return path, checkpoint
    return None


@torch.no_grad()
def restore_trainable(trainer: pl.Trainer, pl_module: pl.LightningModule, before_step: int) -> Path | None:
    """Copy the trainable weights and the optimizer states of the newest checkpoint saved before global step
    ``before_step`` into the running fit; the path restored from, or None when there is no such checkpoint.

    The frozen weights never moved, so only the trainable ones are copied. The trained experts' weight versions
    are bumped (their weights changed: records of the old weights are stale), as an optimizer step would.
    """
    found = checkpoints_before(trainer, before_step)
    if found is None:
        return None
    path, checkpoint = found
    state = checkpoint["state_dict"]
    missing = [n for n, p in pl_module.named_parameters() if p.requires_grad and n not in state]
    if missing:
        raise RuntimeError(f"cannot roll back to {path}: it lacks trainable weights {missing[:3]}")
    for name, param in pl_module.named_parameters():
        if param.requires_grad:
            param.copy_(state[name].to(device=param.device, dtype=param.dtype))
    for optimizer, saved in zip(trainer.optimizers, checkpoint.get("optimizer_states", []), strict=False):
        optimizer.load_state_dict(saved)
    ledger = getattr(pl_module, "ledger", None)
    for name in getattr(pl_module, "trained", []) if ledger is not None else []:
        ledger.bump(name)
    return path
