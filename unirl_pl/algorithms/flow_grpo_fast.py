"""Flow-GRPO-Fast: the SDE on a few randomly placed consecutive steps per trajectory, ODE elsewhere.

As Flow-GRPO's ``train_sd3_fast.py`` (``sde_window_size``, ``sde_window_range``): a window of ``window_size``
steps starts uniformly at random in ``window_range`` and only its steps are stochastic, recorded and trained,
so training costs ``window_size`` forwards per sample instead of the whole window's. The reference draws one
start per batch; here each sample draws its own from a generator keyed by its seed (run seed, request id,
sample index), so a sample's window does not depend on its batch, its rank or the run's history, and a
resumed run draws the same windows. The reference's ``sde_window_range = (0, num_steps // 2)`` is
``window_fraction: 0.5``; its ``sde_type="cps"`` (every published Fast config) is ``sde_type: cps``.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from unirl_pl.algorithms.cps import check_cps
from unirl_pl.algorithms.flow_grpo import FlowGRPO, check_fraction
from unirl_pl.loops.config import RolloutConfig, StepPlan
from unirl_pl.seeding import sample_generators

STREAM_WINDOW = 2
"""The seeding stream of a sample's window position (0 and 1 are its tokens and its noise)."""


class FlowGRPOFast(FlowGRPO):
    """Flow-GRPO on ``window_size`` consecutive SDE steps placed at random per sample within ``window_range``.

    Args:
        window_size: Stochastic (trained) steps per trajectory (Flow-GRPO's SD3 and FLUX Fast configs: 3;
            its Qwen-Image Fast config: 2).
        window_range: ``[lo, hi)`` denoising steps the window lies in (None: ``[0, num_steps - 1)``, every step
            but the last, whose SDE variance Flow-GRPO's step degenerates at; or ``window_fraction``'s).
        noise_level: The SDE's noise scale ``a`` on the window's steps (CPS: in [0, 1]).
        guard: GRPO-Guard's regulated clipping (see :class:`FlowGRPO`; refused with ``sde_type: cps``).
        window_fraction: The range relative to the schedule: ``[0, int(window_fraction * num_steps))``, read
            from ``model.rollout.num_steps`` (0.5 is the reference's ``(0, num_steps // 2)``). Exclusive with
            ``window_range``.
        sde_type: The stochastic step: ``sde`` (Flow-GRPO's) or ``cps`` (:class:`FlowCPS`'s; the range must then
            end before the last step, where CPS is deterministic), as the reference's ``sample.sde_type``.
    """

    def __init__(
        self,
        window_size: int = 2,
        window_range: tuple[int, int] | None = None,
        noise_level: float = 0.7,
        guard: bool = False,
        window_fraction: float | None = None,
        sde_type: Literal["sde", "cps"] = "sde",
    ) -> None:
        if sde_type not in ("sde", "cps"):
            raise ValueError(f"sde_type must be 'sde' or 'cps', got {sde_type!r}")
        if sde_type == "cps":
            check_cps(f"{type(self).__name__}(sde_type: cps)", noise_level, guard)
        super().__init__(noise_level=noise_level, guard=guard)
        self.kind = sde_type
        if window_size < 1:
            raise ValueError(f"window_size must be >= 1, got {window_size}")
        if window_range is not None and not 0 <= window_range[0] < window_range[0] + window_size <= window_range[1]:
            raise ValueError(f"window_range {window_range} must hold window_size={window_size} steps from >= 0")
        check_fraction("window_fraction", window_fraction, "window_range", window_range)
        self.window_size = window_size
        self.window_range = None if window_range is None else (int(window_range[0]), int(window_range[1]))
        self.window_fraction = None if window_fraction is None else float(window_fraction)

    def check_rollout(self, config: RolloutConfig, trained: bool) -> None:
        self.span(config)

    def span(self, config: RolloutConfig) -> tuple[int, int]:
        """The ``[lo, hi)`` steps the windows lie in, checked against ``config.num_steps``."""
        if self.window_fraction is not None:
            lo, hi = 0, int(self.window_fraction * config.num_steps)
            which = f"window_fraction {self.window_fraction}'s range"
        else:
            lo, hi = self.window_range or (0, config.num_steps - 1)
            which = "window_range"
        if not 0 <= lo < lo + self.window_size <= hi <= config.num_steps:
            raise ValueError(
                f"FlowGRPOFast: {which} [{lo}, {hi}) must hold window_size={self.window_size} steps within "
                f"model.rollout.num_steps={config.num_steps}"
            )
        if self.kind == "cps" and hi >= config.num_steps:
            raise ValueError(
                f"FlowGRPOFast(sde_type: cps): {which} [{lo}, {hi}) includes the last step (num_steps="
                f"{config.num_steps}), where CPS is deterministic; end the range before it"
            )
        return lo, hi

    def starts(self, config: RolloutConfig, seed: int, request_ids: list[int], sample_indices: list[int]) -> list[int]:
        """Each sample's first stochastic step: uniform over the span's positions, from its own generator."""
        lo, hi = self.span(config)
        positions = hi - self.window_size - lo + 1
        gens = sample_generators(seed, request_ids, sample_indices, STREAM_WINDOW)
        return [lo + int(torch.randint(positions, (1,), generator=g)) for g in gens]

    def plan(self, config: RolloutConfig, seed: int, request_ids: list[int], sample_indices: list[int]) -> StepPlan:
        starts = self.starts(config, seed, request_ids, sample_indices)
        return StepPlan(tuple(starts), self.window_size, self.kind, self.noise_level(config))

    def describe(self, config: RolloutConfig) -> dict[str, Any]:
        lo, hi = self.span(config)
        return {
            "sde_steps": list(range(lo, hi)) if self.noise_level(config) > 0 else [],
            "sde_steps_per_sample": self.window_size,
        }

    def least_steps(self, config: RolloutConfig) -> int:
        return self.span(config)[1]
