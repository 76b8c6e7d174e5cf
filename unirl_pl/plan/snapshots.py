"""Tracker snapshots (device -> reference type -> bytes) and their arithmetic, as the block stand-ins use them."""

from __future__ import annotations

from typing import Any

Snapshot = dict[Any, dict[Any, int]]
"""A tracker snapshot: device -> reference type (and ``_TOTAL_KEY``) -> bytes."""


def snapshot_diff(after: Snapshot, before: Snapshot) -> Snapshot:
    """``after - before`` per device and key, keeping the non-zero entries only (so equal changes compare equal)."""
    out: Snapshot = {}
    for device in after.keys() | before.keys():
        a, b = after.get(device, {}), before.get(device, {})
        changed = {key: a.get(key, 0) - b.get(key, 0) for key in a.keys() | b.keys()}
        changed = {key: value for key, value in changed.items() if value}
        if changed:
            out[device] = changed
    return out


def snapshot_add(base: Snapshot, change: Snapshot) -> Snapshot:
    """``base + change`` per device and key."""
    out = {device: dict(keys) for device, keys in base.items()}
    for device, keys in change.items():
        target = out.setdefault(device, {})
        for key, value in keys.items():
            target[key] = target.get(key, 0) + value
    return out
