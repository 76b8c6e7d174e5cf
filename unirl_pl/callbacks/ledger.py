"""The weight-version ledger gate: versions equal on all ranks, frozen ones never moving (the module logs them)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from unirl_pl import timing
from unirl_pl.callbacks.protocol import VersionedModule, require


class VersionMismatchError(RuntimeError):
    """Ranks disagree on a component's version, or a frozen component's version moved."""


class WeightVersionLedger(pl.Callback):
    """Enforce the ledger's invariants after each step (the module logs ``version/<component>``).

    Every rank must hold the same version of every component (a rank that skipped or repeated an
    optimizer step would silently train a different model), and components the mode does not train
    stay at version 0. Versions themselves are saved in and restored from checkpoints by the module.
    """

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        require(self, pl_module, VersionedModule)

    @timing.timed("gate_ledger", opaque=True)
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        versions = pl_module.ledger.as_dict()
        for name, version in versions.items():
            if name not in pl_module.trained and version != 0:
                raise VersionMismatchError(f"frozen component {name!r} moved to version {version}")
        if trainer.world_size > 1:
            local = torch.tensor(list(versions.values()), dtype=torch.long, device=pl_module.device)
            gathered = trainer.strategy.all_gather(local)
            if not bool((gathered == gathered[0]).all()):
                raise VersionMismatchError(f"ranks disagree on versions {list(versions)}: {gathered.tolist()}")
