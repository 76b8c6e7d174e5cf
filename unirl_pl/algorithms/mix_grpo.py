"""MixGRPO (Li et al., 2025): Flow-GRPO on an SDE window that slides over training steps, ODE elsewhere.

MixGRPO's ``progressive`` schedule (its ``GRPOTrainingStates``): a window of ``window_size`` steps starts at
step 0 and moves right by ``stride`` denoising steps every ``steps_per_window`` training steps (its
``iters_per_group``; ``stride`` is its ``prog_overlap_step``, or ``window_size`` without overlap) until it
reaches ``max_start``; with ``roll_back`` it then starts over at 0, otherwise it stays there. Only the window
is stochastic, recorded and trained: the early, high-noise steps first, where Flow-GRPO's own analysis puts
most of the reward's sensitivity. The position is a pure function of the trainer's global step, so a
resumed run is at the same window without saved state.

MixGRPO-Flash (``post_solver: dpm2``): after the window the ODE runs DPM-Solver++(2M) (MixGRPO's
``dpm_apply_strategy: post``, order 2, midpoint) on the schedule's tail thinned to ``post_keep`` of its points
(its ``dpm_post_compress_ratio``: 0.4 in its Flash script), so a rollout costs fewer transformer calls. The
solver's history starts with the window's last prediction. Only the rollout changes: the recorded window steps
and their log-probs are Flow-GRPO's, and validation keeps the Euler ODE on the full schedule.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

from unirl_pl.algorithms.flow_grpo import FlowGRPO
from unirl_pl.loops.config import RolloutConfig, StepPlan


class MixGRPO(FlowGRPO):
    """Flow-GRPO with MixGRPO's sliding SDE window.

    Args:
        window_size: Stochastic (trained) steps per trajectory (MixGRPO: 4 of 25).
        steps_per_window: Training steps the window stays at one position (MixGRPO: 25).
        stride: Denoising steps the window moves each time (MixGRPO: 1, overlapping windows).
        max_start: The last start position (None: ``num_steps - 2 - window_size``, so the window never covers
            step ``num_steps - 2`` nor the last: MixGRPO trains ``range(cur, min(cur + group_size, max_timesteps))``
            with ``max_timesteps = sampling_steps - 2``, its ``grpo_states.py`` and ``train_grpo_flux.py``).
        roll_back: After the last position start over at 0 (MixGRPO's default); otherwise stay there.
        guard: GRPO-Guard's regulated clipping (see :class:`FlowGRPO`).
        post_solver: The ODE after the window: ``euler`` (MixGRPO) or ``dpm2`` (MixGRPO-Flash).
        post_keep: With ``dpm2``, the fraction of the schedule's points after the window that are kept (MixGRPO-Flash:
            0.4); 1 keeps every step.
        noise_level: The SDE's noise scale ``a`` on the window's steps.
    """

    def __init__(
        self,
        window_size: int = 2,
        steps_per_window: int = 10,
        stride: int = 1,
        max_start: int | None = None,
        roll_back: bool = True,
        guard: bool = False,
        post_solver: Literal["euler", "dpm2"] = "euler",
        post_keep: float = 1.0,
        noise_level: float = 0.7,
    ) -> None:
        super().__init__(noise_level=noise_level, guard=guard)
        # Checked here, at parse time, rather than at the first rollout.
        StepPlan((0,), 1, post_solver=post_solver, post_keep=post_keep)
        if post_solver == "euler" and post_keep != 1.0:
            raise ValueError(f"post_keep={post_keep} thins the schedule for post_solver 'dpm2' only")
        self.post_solver, self.post_keep = post_solver, post_keep
        if window_size < 1 or steps_per_window < 1 or stride < 1:
            got = f"{window_size}, {steps_per_window}, {stride}"
            raise ValueError(f"window_size, steps_per_window and stride must be >= 1, got {got}")
        if max_start is not None and max_start < 0:
            raise ValueError(f"max_start must be >= 0 or null, got {max_start}")
        self.window_size, self.steps_per_window, self.stride = window_size, steps_per_window, stride
        self.max_start, self.roll_back = max_start, roll_back
        self.step = 0

    def last_start(self, config: RolloutConfig) -> int:
        """The last window start, checked against ``config.num_steps``.

        The default keeps every window below step ``num_steps - 2``, as MixGRPO's (Tencent-Hunyuan/MixGRPO
        e5cdd6a, ``fastvideo/train_grpo_flux.py``: ``max_timesteps=args.sampling_steps-2``; its
        ``GRPOTrainingStates.get_current_timesteps`` cuts the window at ``max_timesteps``, exclusive). MixGRPO's
        last positions train a window cut short there; here every position keeps ``window_size`` steps (the
        record is rectangular), so the last position is the full window ending at step ``num_steps - 3``.
        """
        last = config.num_steps - 2 - self.window_size if self.max_start is None else self.max_start
        if last < 0 or last + self.window_size > config.num_steps:
            below = f" below step num_steps - 2 = {config.num_steps - 2}" if self.max_start is None else ""
            raise ValueError(
                f"MixGRPO: a window of {self.window_size} steps starting at up to {last} does not fit{below} "
                f"(num_steps={config.num_steps})"
            )
        return last

    def start_at(self, step: int, config: RolloutConfig) -> int:
        """The window's first denoising step at training step ``step``."""
        last = self.last_start(config)
        moves = step // self.steps_per_window
        positions = last // self.stride + 1  # starts 0, stride, ..., <= last
        if self.roll_back:
            return (moves % positions) * self.stride
        return min(moves, positions - 1) * self.stride

    def begin_step(self, step: int) -> None:
        self.step = int(step)

    def window(self, config: RolloutConfig) -> tuple[int, int]:
        start = self.start_at(self.step, config)
        return start, start + self.window_size

    def plan(self, config: RolloutConfig, seed: int, request_ids: list[int], sample_indices: list[int]) -> StepPlan:
        plan = super().plan(config, seed, request_ids, sample_indices)
        return replace(plan, post_solver=self.post_solver, post_keep=self.post_keep)

    def describe(self, config: RolloutConfig) -> dict[str, Any]:
        start, end = self.window(config)
        return {
            "sde_steps": list(range(start, end)) if self.noise_level(config) > 0 else [],
            "sde_window_schedule": {
                "window_size": self.window_size,
                "steps_per_window": self.steps_per_window,
                "stride": self.stride,
                "last_start": self.last_start(config),
                "roll_back": self.roll_back,
            },
            "post_window_ode": {"solver": self.post_solver, "keep": self.post_keep},
        }

    def least_steps(self, config: RolloutConfig) -> int:
        # Any position the schedule reaches must fit: a probe at fit start and the steps after it agree.
        return self.last_start(config) // self.stride * self.stride + self.window_size
