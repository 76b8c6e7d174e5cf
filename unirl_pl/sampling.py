"""Flow-matching samplers: the ODE Euler step, the stochastic steps with their log-probs, schedules.

Everything here is a pure function of tensors so the same code serves the rollout (no grad), the
training recompute (grad) and the C2 gate; the formulas are those of docs/architecture.md (sampling
math) and docs/algorithms.md (CPS), checked against float64 to 1e-6. :data:`STOCHASTIC_STEPS` names
each stochastic step so a behavior record can say which one drew it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

_LOG_SQRT_2PI = math.log(math.sqrt(2 * math.pi))


def flow_sigmas(num_steps: int, shift: float = 1.0) -> Tensor:
    """Return the ``num_steps + 1`` float64 sigmas from 1 to 0 of a flow-matching schedule.

    ``shift`` is SD3's resolution shift ``s' = shift*s / (1 + (shift-1)*s)``; 1 gives a linear
    schedule. Float64 keeps the per-step ``dt`` identical however callers slice the schedule.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if shift <= 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    s = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    return shift * s / (1 + (shift - 1) * s)


def _as_batch(value: float | Tensor, like: Tensor) -> Tensor:
    """Broadcast a float or per-sample (B,) tensor to ``like``'s rank, float32, on its device."""
    t = torch.as_tensor(value, dtype=torch.float32, device=like.device)
    if t.ndim == 0:
        return t.reshape([1] * like.ndim)
    if t.ndim != 1 or t.shape[0] != like.shape[0]:
        raise ValueError(f"sigma must be a float or a (B,) tensor with B={like.shape[0]}, got {tuple(t.shape)}")
    return t.reshape(-1, *([1] * (like.ndim - 1)))


def ode_step(sample: Tensor, velocity: Tensor, sigma: float | Tensor, sigma_next: float | Tensor) -> Tensor:
    """Deterministic Euler step ``x + (s' - s) * v`` of the probability-flow ODE."""
    dt = _as_batch(sigma_next, sample) - _as_batch(sigma, sample)
    return (sample.float() + dt * velocity.float()).to(sample.dtype)


def _coefficient(value: Tensor, like: Tensor) -> Tensor:
    """A per-sample float64 coefficient shaped to broadcast over ``like`` (float32 for the mix)."""
    return value.to(torch.float32).reshape(-1, *([1] * (like.ndim - 1)))


def dpm_solver_2m_step(
    sample: Tensor,
    x0: Tensor,
    sigma: float | Tensor,
    sigma_next: float | Tensor,
    x0_prev: Tensor | None = None,
    sigma_prev: float | Tensor | None = None,
) -> Tensor:
    """One deterministic DPM-Solver++(2M) step (midpoint form) of the flow ODE, from x0 predictions.

    On the flow schedule ``alpha = 1 - sigma`` and ``lambda = log(alpha / sigma)``, with ``h = lambda' -
    lambda`` and ``D0 = x0``: ``x' = (sigma' / sigma) x - alpha' (exp(-h) - 1) (D0 + D1 / 2)``, where ``D1 =
    (x0 - x0_prev) h / (lambda - lambda_prev)`` uses the previous step's prediction. Without one, or into
    ``sigma' = 0`` (diffusers' ``lower_order_final``), ``D1 = 0``: the first-order step, which on this schedule
    is exactly the Euler step ``x + (sigma' - sigma) v``. ``x0 = x - sigma v`` (:func:`flow_x0`). MixGRPO-Flash
    runs it after the SDE window; checked against diffusers' ``DPMSolverMultistepScheduler``.
    """
    x, d0 = sample.float(), x0.float()
    s = torch.as_tensor(sigma, dtype=torch.float64).reshape(-1)
    s_next = torch.as_tensor(sigma_next, dtype=torch.float64).reshape(-1)
    a, a_next = 1 - s, 1 - s_next
    # alpha' (exp(-h) - 1) = alpha sigma' / sigma - alpha', written without logs (finite at sigma' = 0).
    mix = a * s_next / s - a_next
    out = _coefficient(s_next / s, x) * x - _coefficient(mix, x) * d0
    if x0_prev is None or sigma_prev is None:
        return out.to(sample.dtype)
    s_prev = torch.as_tensor(sigma_prev, dtype=torch.float64).reshape(-1)
    lam, lam_prev = torch.log(a / s), torch.log((1 - s_prev) / s_prev)
    lam_next = torch.log(a_next / s_next)  # +inf at sigma' = 0
    # D1's factor h / h0; 0 into sigma' = 0 (first order there) and after sigma_prev = 1 (lambda_prev = -inf).
    ratio = torch.where(s_next > 0, (lam_next - lam) / (lam - lam_prev), torch.zeros_like(s))
    ratio = torch.nan_to_num(ratio, nan=0.0, posinf=0.0, neginf=0.0)
    d1 = _coefficient(ratio, x) * (d0 - x0_prev.float())
    return (out - _coefficient(mix, x) * 0.5 * d1).to(sample.dtype)


def flow_x0(sample: Tensor, velocity: Tensor, sigma: float | Tensor) -> Tensor:
    """The flow model's clean-sample prediction ``x0 = x - sigma v`` (float32)."""
    return sample.float() - _as_batch(sigma, sample) * velocity.float()


def compress_tail(sigmas: Tensor, start: int, keep: float) -> Tensor:
    """The schedule ``sigmas`` (1-D, from 1 to 0) with its steps after index ``start`` thinned to a fraction.

    MixGRPO-Flash's post-window grid: ``max(int((N - start + 1) * keep), 2)`` points from ``sigmas[start]`` to
    0 at evenly spaced step positions, read off the schedule by linear interpolation between its neighbouring
    sigmas (exact where a position is a whole step; MixGRPO re-shifts an even time grid, the same there).
    ``keep = 1`` returns the schedule unchanged.
    """
    if not 0 < keep <= 1:
        raise ValueError(f"keep must be in (0, 1], got {keep}")
    n = sigmas.numel() - 1
    if not 0 <= start < n:
        raise ValueError(f"start must be in [0, {n}), got {start}")
    points = max(int((n - start + 1) * keep), 2)
    where = torch.linspace(start, n, points, dtype=torch.float64)
    low = where.floor().long().clamp(max=n - 1)
    frac = where - low
    tail = sigmas[low] * (1 - frac) + sigmas[low + 1] * frac
    return torch.cat([sigmas[:start], tail.to(sigmas.dtype)])


def flow_sde_step_with_logprob(
    sample: Tensor,
    velocity: Tensor,
    sigma: float | Tensor,
    sigma_next: float | Tensor,
    *,
    sigma_max: float | Tensor,
    noise_level: float = 0.7,
    prev_sample: Tensor | None = None,
    generator: torch.Generator | list[torch.Generator] | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One Flow-GRPO SDE step and the Gaussian log-density of its result.

    Returns ``(prev_sample, log_prob, prev_sample_mean, std_dev_t)``: the next latent (drawn unless
    ``prev_sample`` is given, which is how training re-scores a captured step), the per-sample
    log-prob averaged over non-batch dimensions (float32, next latent detached), the step's mean
    and the (B,1,...) noise scale ``std`` before the ``sqrt(-dt)`` factor. ``sigma_max`` may be a
    float or, like the sigmas, a per-sample (B,) tensor (samples on schedules of different lengths).
    ``generator`` may be one generator or one per sample, so a sample's noise does not depend on its
    batch position.
    ``noise_level = 0`` reduces exactly to :func:`ode_step` with a log-prob of zero.
    """
    x = sample.float()
    v = velocity.float()
    s = _as_batch(sigma, x)
    s_next = _as_batch(sigma_next, x)
    dt = s_next - s
    # At s == 1 the variance term divides by zero; Flow-GRPO substitutes sigma_max = sigmas[1].
    denom = 1 - torch.where(s == 1, _as_batch(sigma_max, x), s)
    std = torch.sqrt(s / denom) * noise_level
    mean = x * (1 + std**2 / (2 * s) * dt) + v * (1 + std**2 * (1 - s) / (2 * s)) * dt
    scale = std * torch.sqrt(-dt)

    if prev_sample is None:
        noise = randn_like_per_sample(x, generator)
        prev = mean + scale * noise
    else:
        prev = prev_sample.float()
    prev = prev.detach()
    if noise_level == 0:
        log_prob = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
    else:
        log_prob = -((prev - mean) ** 2) / (2 * scale**2) - torch.log(scale) - _LOG_SQRT_2PI
        log_prob = log_prob.mean(dim=tuple(range(1, x.ndim)))
    return prev.to(sample.dtype), log_prob, mean, std


def cps_step_with_logprob(
    sample: Tensor,
    velocity: Tensor,
    sigma: float | Tensor,
    sigma_next: float | Tensor,
    *,
    sigma_max: float | Tensor | None = None,
    noise_level: float = 0.7,
    prev_sample: Tensor | None = None,
    generator: torch.Generator | list[torch.Generator] | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One coefficients-preserving (Flow-CPS) step and its log-prob, as Flow-GRPO's ``sde_type="cps"``.

    With ``x0 = x - s v`` (predicted clean sample), ``x1 = x + (1 - s) v`` (predicted noise) and
    ``std = s' sin(noise_level pi / 2)``: ``mean = (1 - s') x0 + sqrt(s'^2 - std^2) x1`` and
    ``x' = mean + std eps``, so the coefficients of clean sample and noise keep summing in quadrature to
    ``s'`` (the noise level of step ``s'``), unlike the SDE step's. The log-prob is the reference's
    ``-mean((x' - mean)^2)`` over non-batch dims (constants and the ``1 / (2 std^2)`` scale dropped), float32
    with ``x'`` detached. Returns ``(prev_sample, log_prob, prev_sample_mean, std)``; ``std`` (B,1,...) is the
    full noise scale. ``sigma_max`` is accepted for a common signature and unused. ``noise_level = 0`` is the
    deterministic DDIM-style step. At ``s' = 0`` the step is deterministic (std 0): nothing to train there.
    """
    x = sample.float()
    v = velocity.float()
    s = _as_batch(sigma, x)
    s_next = _as_batch(sigma_next, x)
    std = s_next * math.sin(noise_level * math.pi / 2)
    x0 = x - s * v
    x1 = x + (1 - s) * v
    mean = x0 * (1 - s_next) + x1 * torch.sqrt(s_next**2 - std**2)
    if prev_sample is None:
        prev = mean + std * randn_like_per_sample(x, generator)
    else:
        prev = prev_sample.float()
    prev = prev.detach()
    log_prob = (-((prev - mean) ** 2)).mean(dim=tuple(range(1, x.ndim)))
    return prev.to(sample.dtype), log_prob, mean, std.expand(x.shape[0], *std.shape[1:])


StochasticStep = Callable[..., tuple[Tensor, Tensor, Tensor, Tensor]]
"""``(sample, velocity, sigma, sigma_next, *, sigma_max, noise_level, prev_sample, generator)`` ->
``(prev_sample, log_prob, mean, std)``."""

STOCHASTIC_STEPS: dict[str, StochasticStep] = {"sde": flow_sde_step_with_logprob, "cps": cps_step_with_logprob}
"""The stochastic steps a rollout may record, by the name its record carries."""


def randn_like_per_sample(like: Tensor, generator: torch.Generator | list[torch.Generator] | None) -> Tensor:
    """Standard normal noise shaped like ``like``; a list of generators draws row ``i`` from ``generator[i]``.

    Per-sample generators make each sample's noise a function of its own seed only, not of the
    batch it happens to be in; that is what keeps rollouts identical across batch sizes and ranks.
    """
    if isinstance(generator, (list, tuple)):
        if len(generator) != like.shape[0]:
            raise ValueError(f"got {len(generator)} generators for a batch of {like.shape[0]}")
        rows = [torch.randn(like.shape[1:], generator=g, dtype=torch.float32, device=g.device) for g in generator]
        return torch.stack(rows).to(like.device)
    return torch.randn(like.shape, generator=generator, dtype=torch.float32, device=like.device)


def flow_kl(mean: Tensor, ref_mean: Tensor, std: Tensor) -> Tensor:
    """Per-sample KL between the policy's and the reference's SDE step Gaussians (shared std).

    ``mean((mean - ref_mean)^2) / (2 std^2)`` over non-batch dims, as Flow-GRPO's KL term.
    """
    dims = tuple(range(1, mean.ndim))
    return ((mean - ref_mean) ** 2).mean(dim=dims) / (2 * std.reshape(std.shape[0], -1)[:, 0] ** 2)


def promptrl_kl(
    mean: Tensor, ref_mean: Tensor, std: Tensor, sigma: float | Tensor, sigma_next: float | Tensor
) -> Tensor:
    """Per-sample KL of one SDE step in PromptRL's form: the variance is the step's own, ``(std sqrt(-dt))^2``.

    ``mean((mean - ref_mean)^2) / (2 (std sqrt(-dt))^2)`` over non-batch dims, with ``std`` the
    :func:`flow_sde_step_with_logprob` noise scale (before its ``sqrt(-dt)``) and ``dt = sigma_next - sigma``
    (floats or (B,) tensors), formed in float32 as the step forms its scale, so the divisor is the variance the
    log-prob used. This is :func:`flow_kl` divided by ``-dt``: Flow-GRPO divides by ``2 std^2`` only, PromptRL
    (G-U-N/UniRL's trainer, whose SDE step returns ``std sqrt(-dt)``) by the full variance.
    """
    s = _as_batch(sigma, mean).reshape(-1)
    s_next = _as_batch(sigma_next, mean).reshape(-1)
    scale = std.reshape(std.shape[0], -1)[:, 0] * torch.sqrt(s - s_next)
    return ((mean - ref_mean) ** 2).mean(dim=tuple(range(1, mean.ndim))) / (2 * scale**2)
