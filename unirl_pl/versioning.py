"""Per-component weight versions and the caches scoped to them.

A version is an integer per component, 0 at start, bumped on each optimizer step of that expert.
Cached features are keyed by (component, version, input), so an update to one expert can only
invalidate what was computed by that expert: the frozen text encoder's cache stays warm while the
LM and the DiT train.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor


class VersionLedger:
    """Integer weight version per component; ``bump`` on an optimizer step, never for a frozen one."""

    def __init__(self, components: Sequence[str]) -> None:
        self._versions = {name: 0 for name in components}

    def __getitem__(self, name: str) -> int:
        return self._versions[name]

    def bump(self, name: str) -> int:
        """Advance ``name``'s version after its weights changed; return the new version."""
        self._versions[name] += 1
        return self._versions[name]

    def as_dict(self) -> dict[str, int]:
        """A copy of all versions, for logging and checkpoints."""
        return dict(self._versions)

    def load(self, versions: dict[str, int]) -> None:
        """Restore versions saved by :meth:`as_dict` (unknown components are an error)."""
        unknown = set(versions) - set(self._versions)
        if unknown:
            raise KeyError(f"checkpoint has versions for unknown components {sorted(unknown)}")
        self._versions.update({k: int(v) for k, v in versions.items()})


def check_staleness(
    records: dict[str, Any], owners: dict[str, str], ledger: VersionLedger, on_stale: str
) -> dict[str, float]:
    """Versions each record lags behind its owner's current weights, by owner.

    On-policy training (``on_stale="error"``) refuses a record produced by an older version than the one
    about to be updated; ``"log"`` only reports the lag.
    """
    staleness = {}
    for loop, record in records.items():
        name = owners[loop]
        lag = ledger[name] - record.version
        staleness[name] = float(lag)
        if lag and on_stale == "error":
            raise RuntimeError(
                f"off-policy batch: the {name} record was produced by version {record.version} but the "
                f"weights are at version {ledger[name]} (set model.on_stale=log to allow stale data)"
            )
    return staleness


class FeatureCache:
    """An LRU cache of per-text features keyed by (component, version, text), with hit statistics.

    ``get_or_compute`` looks every text up, computes each distinct miss once and returns the features
    stacked in input order, so a group of K samples sharing a prompt encodes it once. Misses are encoded
    in calls of exactly ``encode_batch`` texts (the last call padded by repeating a miss): batch-variant
    kernels give a row the same result at the same shape whatever the other rows hold, so a text's
    features do not depend on which texts missed with it, and a resumed run (cold cache) conditions the
    generator exactly as the uninterrupted one did.
    """

    def __init__(
        self, ledger: VersionLedger, max_entries: int = 4096, encode_batch: int = 8, offload: bool = False
    ) -> None:
        self.ledger = ledger
        self.max_entries = max_entries
        self.encode_batch = encode_batch
        self.offload = offload
        self.device: torch.device | None = None  # where the encoder's features live (offloaded rows go back)
        self._store: OrderedDict[tuple[str, int, str], dict[str, Tensor]] = OrderedDict()
        self.hits = 0
        self.lookups = 0

    def get_or_compute(
        self, component: str, texts: Sequence[str], compute: Callable[[list[str]], dict[str, Tensor]]
    ) -> dict[str, Tensor]:
        """Features for ``texts`` from ``component`` at its current version; each distinct miss computed once.

        ``compute`` maps a list of texts to named batch-first tensors; the result has the same names.
        """
        version = self.ledger[component]
        keys = [(component, version, t) for t in texts]
        missing = list(dict.fromkeys(t for k, t in zip(keys, texts, strict=True) if k not in self._store))
        self.lookups += len(texts)
        self.hits += len(texts) - len(missing)
        size = self.encode_batch
        for start in range(0, len(missing), size):
            chunk = missing[start : start + size]
            feats = compute(chunk + [chunk[-1]] * (size - len(chunk)))
            self.device = next(iter(feats.values())).device
            if self.offload:  # one copy of the encode batch to host memory, not one per row
                feats = {name: f.detach().cpu() for name, f in feats.items()}
            for i, text in enumerate(chunk):
                # clone(): a kept row must not hold its whole encode batch alive through a view.
                self._store[(component, version, text)] = {name: f[i].detach().clone() for name, f in feats.items()}
        for k in keys:
            self._store.move_to_end(k)
        out = [self._store[k] for k in keys]
        while len(self._store) > self.max_entries:
            self._store.popitem(last=False)
        stacked = {name: torch.stack([row[name] for row in out]) for name in out[0]}
        return {name: t.to(self.device) for name, t in stacked.items()} if self.offload else stacked

    def hit_rate(self, reset: bool = True) -> float:
        """Hits / lookups since the last reset (0 when nothing was looked up)."""
        rate = self.hits / self.lookups if self.lookups else 0.0
        if reset:
            self.hits = self.lookups = 0
        return rate

    def __len__(self) -> int:
        return len(self._store)
