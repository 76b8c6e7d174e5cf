"""What the gates need from the LightningModule, stated as protocols and checked in ``setup()``.

A gate reads the module only through these names, so any module that offers them (the RL trainer or
a user's own) can be gated, and one that does not is refused at setup with the missing names listed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import lightning.pytorch as pl
from torch import Tensor, nn

# The hook the module calls lives below both packages (the method must not import the callbacks);
# re-exported here, where gates and users have imported it from.
from unirl_pl.method.hooks import POLICY_LOGPROBS_HOOK, notify_policy_logprobs

if TYPE_CHECKING:  # names for the type checker only: a gate reads the module through these attributes
    from unirl_pl.loops import ARDecode, DiffusionDenoise
    from unirl_pl.method.loss_settings import ExpertLoss
    from unirl_pl.records import Experience
    from unirl_pl.versioning import VersionLedger

LogProbs = dict[str, tuple[Tensor, Tensor, Tensor]]  # by expert: (recomputed, behavior, mask)

__all__ = [
    "POLICY_LOGPROBS_HOOK",
    "LogProbs",
    "RecomputingModule",
    "SamplingModule",
    "VersionedModule",
    "notify_policy_logprobs",
    "require",
]


class RecomputingModule(Protocol):
    """A module that can re-score its behavior records (what the C2 gate checks)."""

    trained: list[str]

    def recompute_logprobs(self, exp: Experience) -> LogProbs: ...

    def loss_settings(self, name: str) -> ExpertLoss: ...

    def experts(self) -> dict[str, nn.Module]: ...


class SamplingModule(Protocol):
    """A module whose loops can be probed batched vs serially (what the interleave-parity gate runs)."""

    ar_decode: ARDecode | None
    diffusion_denoise: DiffusionDenoise | None
    generator: nn.Module


class VersionedModule(Protocol):
    """A module with per-component weight versions (what the ledger gate checks)."""

    trained: list[str]
    ledger: VersionLedger


def require(gate: pl.Callback, pl_module: pl.LightningModule, protocol: type) -> None:
    """Raise ``TypeError`` naming the gate and every attribute of ``protocol`` that ``pl_module`` lacks."""
    names = [n for n in (*getattr(protocol, "__annotations__", {}), *vars(protocol)) if not n.startswith("_")]
    missing = sorted({n for n in names if not hasattr(pl_module, n)})
    if missing:
        raise TypeError(
            f"{type(gate).__name__} needs a module that offers {', '.join(missing)} ({protocol.__name__}); "
            f"{type(pl_module).__name__} does not"
        )
