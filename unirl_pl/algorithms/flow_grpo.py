"""Flow-GRPO (Liu et al., 2025): PPO on the Gaussian log-prob of SDE steps in a fixed window.

The rollout runs Flow-GRPO's SDE at the steps of its ``sde_window`` with its ``noise_level`` (the ODE
elsewhere) and records them; the loss is the clipped ratio per
recorded step plus the KL of the step means to the adapter-disabled reference (:func:`drivers.dit_loss`). With
``guard`` the ratio is GRPO-Guard's (Wang et al., 2025): normalized by the step's noise scale with the
mean-drift bias removed, and each step's surrogate reweighted by ``1 / -dt``.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor

from unirl_pl.algorithms.base import Backward, GeneratorAlgorithm, LossInputs
from unirl_pl.algorithms.drivers import dit_loss, per_step_loss
from unirl_pl.loops.config import RolloutConfig, StepPlan
from unirl_pl.losses import LossOutput, grpo_guard_loss

DEFAULT_WINDOW = (0, 3)
"""The SDE window of a Flow-GRPO algorithm given neither ``sde_window`` nor ``timestep_fraction``."""


def check_fraction(name: str, fraction: float | None, absolute: str, value: Any) -> None:
    """A window given as a fraction of the schedule: in (0, 1], and not together with its absolute form."""
    if fraction is None:
        return
    if value is not None:
        raise ValueError(
            f"{absolute} {tuple(value)} and {name} {fraction} both set the window; set one and the other to null"
        )
    if not 0 < fraction <= 1:
        raise ValueError(f"{name} must be in (0, 1], got {fraction}")


class FlowGRPO(GeneratorAlgorithm):
    """Flow-GRPO on an SDE window: the default generator algorithm.

    The algorithm owns its sampler settings (the window and the noise level); ``model.rollout`` keeps the
    sampler's own (steps, shift, guidance, micro-batches).

    Args:
        sde_window: ``[start, end)`` denoising steps run as the SDE, recorded and trained; the ODE elsewhere.
            Must lie within ``model.rollout.num_steps``. None: ``[0, 3)``, or ``timestep_fraction``'s window.
        noise_level: The SDE's noise scale ``a`` (0 is the ODE, with nothing recorded).
        guard: GRPO-Guard's regulated clipping: the ratio ``exp((logp - old + b) * scale)`` with ``scale =
            std * sqrt(-dt)`` and ``b`` the mean-drift term (so it is centred at 1 at every step), and each
            step's surrogate divided by ``-dt``. The old step mean is the first PPO epoch's recompute (the C2
            gate proves it equals rollout's). Off: Flow-GRPO's ratio, numbers as before algorithms existed.
        timestep_fraction: The window relative to the schedule, as Flow-GRPO's ``train.timestep_fraction``
            (0.99 in its SD3 configs): the first ``int(timestep_fraction * num_steps)`` steps, read from
            ``model.rollout.num_steps`` (10 steps: ``[0, 9)``). The reference samples every step with the SDE
            and trains those; here the steps after them run the ODE (a stochastic step is a recorded one), so
            with 0.99 the last step is deterministic where the reference adds its SDE noise. Exclusive with
            ``sde_window``.
    """

    kind = "sde"

    def __init__(
        self,
        sde_window: tuple[int, int] | None = None,
        noise_level: float = 0.7,
        guard: bool = False,
        timestep_fraction: float | None = None,
    ) -> None:
        check_fraction("timestep_fraction", timestep_fraction, "sde_window", sde_window)
        start, end = (int(sde_window[0]), int(sde_window[1])) if sde_window is not None else DEFAULT_WINDOW
        if not 0 <= start < end:
            raise ValueError(f"sde_window {tuple(sde_window or ())} must satisfy 0 <= start < end")
        if noise_level < 0:
            raise ValueError(f"noise_level must be >= 0, got {noise_level}")
        self.sde_window = (start, end) if timestep_fraction is None else None
        self.timestep_fraction = None if timestep_fraction is None else float(timestep_fraction)
        self.level, self.guard = float(noise_level), guard
        self._old_means: tuple[weakref.ref, Tensor] | None = None

    def check_rollout(self, config: RolloutConfig, trained: bool) -> None:
        self.window(config)  # a window past the schedule fails when the recipe is read, not at the first rollout

    def check_settings(self, settings: Any) -> None:
        """PromptRL's KL form divides Flow-GRPO's by the SDE step's ``-dt`` (its std before ``sqrt(-dt)``); the CPS
        step's std is already its full noise scale, so there the two forms are the same number and the option
        would do nothing."""
        if getattr(settings, "kl_form", "flow_grpo") == "promptrl" and self.kind != "sde":
            raise ValueError(
                f"{type(self).__name__}: model.transformer_loss.kl_form='promptrl' rescales the Gaussian SDE step's KL "
                f"by 1 / -dt; the {self.kind!r} step's std is already its full noise scale (its KL is that form "
                "already): set kl_form: flow_grpo, or use unirl_pl.algorithms.FlowGRPO"
            )

    # ------------------------------------------------------------------ what the rollout records
    def window(self, config: RolloutConfig) -> tuple[int, int]:
        """The ``[start, end)`` stochastic steps of every sample, checked against ``config.num_steps``."""
        if self.sde_window is None:  # timestep_fraction: the first int(f * N) steps
            assert self.timestep_fraction is not None
            end = int(self.timestep_fraction * config.num_steps)
            if end < 1:
                raise ValueError(
                    f"{type(self).__name__}: timestep_fraction {self.timestep_fraction} trains int("
                    f"{self.timestep_fraction} * num_steps={config.num_steps}) = 0 steps; raise it"
                )
            return 0, end
        start, end = self.sde_window
        if end > config.num_steps:
            raise ValueError(
                f"{type(self).__name__}: sde_window {self.sde_window} must end by num_steps={config.num_steps}"
            )
        return start, end

    def noise_level(self, config: RolloutConfig) -> float:
        """The noise level of the stochastic steps."""
        return self.level

    def plan(self, config: RolloutConfig, seed: int, request_ids: list[int], sample_indices: list[int]) -> StepPlan:
        start, end = self.window(config)
        return StepPlan((start,) * len(request_ids), end - start, self.kind, self.noise_level(config))

    def describe(self, config: RolloutConfig) -> dict[str, Any]:
        start, end = self.window(config)
        return {"sde_steps": list(range(start, end)) if self.noise_level(config) > 0 else []}

    def least_steps(self, config: RolloutConfig) -> int:
        end = self.window(config)[1]
        # A window given as a fraction of the schedule trains all but its last steps; a request with fewer
        # steps (the parity probe's) keeps a step after the window, as the rollout's own requests do: an SDE
        # step into sigma 0 amplifies batch variance (measured 5.6e-4 on the main recipe's DiT, 1e-6 before it).
        return end + 1 if self.timestep_fraction is not None and end < config.num_steps else end

    # ------------------------------------------------------------------ the loss
    def loss(self, inputs: LossInputs, backward: Backward | None = None) -> LossOutput:
        if not self.guard:
            i = inputs
            return dit_loss(i.loop, i.record, i.advantages, i.settings, i.reference, backward, i.anchor)
        return self._guard_loss(inputs, backward)

    @torch.no_grad()
    def before_updates(self, loop: Any, record: Any) -> None:
        """GRPO-Guard's old step means of every recorded step, before the step's first mini-batch update."""
        if not self.guard:
            return
        means = torch.empty_like(record.sample, dtype=torch.float32)
        for step, (a, b) in record.steps():
            _, mean, _ = loop.step_logprob(record, step, (a, b))
            means[a:b, step] = mean
        self._old_means = (weakref.ref(record), means)

    def _guard_loss(self, inputs: LossInputs, backward: Backward | None = None) -> LossOutput:
        """:func:`drivers.dit_loss` with GRPO-Guard's term per (step, micro-batch)."""
        record, advantages, settings = inputs.record, inputs.advantages, inputs.settings
        whole = record if inputs.whole is None else inputs.whole
        kept = self._old_means
        old_means = kept[1] if kept is not None and kept[0]() is whole else None
        if old_means is not None and inputs.index is not None:
            old_means = old_means[inputs.index.to(old_means.device)]
        first = old_means is None
        if first and inputs.index is not None:
            raise RuntimeError("GRPO-Guard on a mini-batch needs the old step means of before_updates()")
        if first:
            old_means = torch.empty_like(record.sample, dtype=torch.float32)

        def term(
            step: int,
            rows: slice,
            logp: Tensor,
            mean: Tensor,
            std: Tensor,
            kl: Tensor | None,
            old: Tensor,
            weights: Any,
        ) -> LossOutput:
            if first:
                old_means[rows, step] = mean.detach()
            s, s_next, _ = record.step_sigmas(step, (rows.start, rows.stop))
            n = rows.stop - rows.start
            dt = torch.as_tensor(s_next, dtype=torch.float32) - torch.as_tensor(s, dtype=torch.float32)
            dt = dt.expand(n).to(logp.device)
            scale = std.reshape(std.shape[0], -1)[:, 0].expand(n) * torch.sqrt(-dt)
            return grpo_guard_loss(
                logp,
                old,
                advantages[rows],
                mean,
                old_means[rows, step],
                scale,
                dt,
                kl=kl,
                clip_eps=settings.clip_eps,
                beta=settings.beta,
                is_weights=weights,
            )

        out = per_step_loss(inputs, term, backward)
        if first:
            self._old_means = (weakref.ref(record), old_means)
        return out
