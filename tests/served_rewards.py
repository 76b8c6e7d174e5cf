"""Rewards the server tests serve by dotted path. The reference server builds them in LitServe's worker process,
so what a test reads of their calls they write to a file (one JSON line a call, written before scoring, so it
is on disk by the time the reply is); this module imports little, so that the worker starts quickly."""

from __future__ import annotations

import json
import math
import time
from typing import Any

from torch import Tensor

from unirl_pl.rewards.builtin import resolve_reward


def _append(log: str, call: dict[str, Any]) -> None:
    with open(log, "a") as f:
        f.write(json.dumps(call) + "\n")


def read_calls(log: Any) -> list[dict[str, Any]]:
    """The calls a reward below wrote to ``log`` (a path), in order."""
    with open(log) as f:
        return [json.loads(line) for line in f.read().splitlines()]


def mean_brightness(prompts: list[str], refined: list[str], images: Tensor) -> list[float]:
    """Brightness as a plain function, served by dotted path."""
    return images.mean(dim=(1, 2, 3)).tolist()


class _Logged:
    """A served reward that appends what each call got to the JSON-lines file ``log``."""

    def __init__(self, log: str) -> None:
        self.log = log


class Recorded(_Logged):
    """Brightness that logs each call's prompts and image size; the prompt "raise" makes the call raise and
    "nan" scores NaN."""

    def __call__(self, prompts: list[str], refined: list[str], images: Tensor) -> list[float]:
        _append(self.log, {"prompts": list(prompts), "size": images.shape[-1]})
        if "raise" in prompts:
            raise RuntimeError("poisoned prompt")
        scores = mean_brightness(prompts, refined, images)
        return [math.nan if p == "nan" else s for p, s in zip(prompts, scores, strict=True)]


class SeenMetadata(_Logged):
    """Brightness that declares ``metadata`` and logs what each call got; a row ``{"fail": true}`` raises."""

    def __call__(
        self,
        prompts: list[str],
        refined_prompts: list[str],
        images: Tensor,
        metadata: list[dict[str, Any] | None] | None = None,
    ) -> list[float]:
        _append(self.log, {"n": len(prompts), "metadata": metadata})
        if metadata is not None and any(m is not None and m.get("fail") for m in metadata):
            raise RuntimeError("poisoned metadata")
        return mean_brightness(prompts, refined_prompts, images)


class Counted:
    """Any reward (registry name or dotted path, built with ``reward_args``) that logs each call's sample count."""

    def __init__(self, log: str, reward: str, reward_args: dict[str, Any] | None = None) -> None:
        self.log, self.reward = log, resolve_reward(reward, reward_args)

    def __call__(self, prompts: list[str], refined_prompts: list[str], images: Tensor) -> list[float]:
        _append(self.log, {"n": len(prompts)})
        return self.reward(prompts, refined_prompts, images)


class SlowToBuild:
    """Brightness that takes ``seconds`` to build: a server that cannot answer ``GET /health`` for that long."""

    def __init__(self, seconds: float) -> None:
        time.sleep(seconds)

    def __call__(self, prompts: list[str], refined_prompts: list[str], images: Tensor) -> list[float]:
        return mean_brightness(prompts, refined_prompts, images)


class SeenSources(_Logged):
    """Declares ``sources`` and logs each call's source sizes; scores each image's mean brightness minus its
    source's (the image's own where it has none), so a source that went astray changes the score."""

    def __call__(
        self,
        prompts: list[str],
        refined_prompts: list[str],
        images: Tensor,
        sources: list[Tensor | None] | None = None,
    ) -> list[float]:
        shapes = None if sources is None else [None if s is None else list(s.shape) for s in sources]
        _append(self.log, {"n": len(prompts), "sources": shapes})
        scores = mean_brightness(prompts, refined_prompts, images)
        if sources is None:
            return scores
        return [s - (0.0 if src is None else float(src.mean())) for s, src in zip(scores, sources, strict=True)]
