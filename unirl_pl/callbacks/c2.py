"""C2 log-prob identity: the probability in the PPO ratio must be the one each sample was drawn from.

Before any optimizer step on an experience, the gate compares the log-probs the first training forward
computed for every captured LM token and SDE step (under the unchanged weights; the module hands them
over, so the check costs no forward of its own) with the behavior log-probs. A padding
mask that differs between decode and recompute, a temperature or top-k the recompute ignores, a
sigma off by one step, or weights that changed between rollout and training all show up here.

Two tiers of equality: an expert in ``exact`` (the DiT: its recompute runs the same function on the
same shapes, dtype and device as rollout) must match bit for bit, so its ratio is exactly 1 and its
clip fraction 0; the others (the LM: KV-cache decode vs a teacher-forced forward) get a tolerance
chosen by precision (:data:`PRECISION_TOLERANCES`).

What is compared is the expert's algorithm's to say (:meth:`unirl_pl.algorithms.Algorithm.gate_values`): the
token or SDE-step log-probs of the likelihood methods, or, for a likelihood-free one (DiffusionNFT), the
identity it has instead, such as the old policy's velocity recomputed at the recorded training points; the
tiers, limits and messages are the same.

An expert whose loss corrects the rollout/train mismatch (``rollout_correction: tis``) is expected to
differ by its numerics: for it the gate logs the correction's statistics (``rollout_corr/*``) and stops
only when the mismatch KL exceeds ``corrected_kl_tolerance``, far above any kernel noise.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Literal

import lightning.pytorch as pl
import torch

from unirl_pl import timing
from unirl_pl.callbacks.protocol import RecomputingModule, require
from unirl_pl.callbacks.summary import log_gate_metrics
from unirl_pl.card import Role
from unirl_pl.losses import k3_kl
from unirl_pl.metrics import rollout_correction_metrics
from unirl_pl.records import Experience
from unirl_pl.rollout_correction import rollout_correction_stats

Action = Literal["raise", "warn"]
Precision = Literal["auto", "float32", "bfloat16", "float16"]


class LogProbIdentityError(RuntimeError):
    """The recomputed log-probs of a captured behavior differ from the behavior log-probs."""


@dataclass(frozen=True)
class Tolerances:
    """Limits of one precision tier; None leaves that statistic logged but unchecked.

    Args:
        max_abs: Largest allowed ``|logp_recompute - logp_behavior| / max(1, |logp_behavior|)`` over all
            tokens / steps.
        mean_abs: Largest allowed mean of that difference.
        k3: Largest allowed mean k3 KL between behavior and recompute (the mismatch KL).
        action: ``raise`` stops the run; ``warn`` only warns.
    """

    max_abs: float | None
    mean_abs: float | None
    k3: float | None
    action: Action


# Float32 on CPU: KV-cache decode vs teacher-forced recompute differ by ~1e-6, so 1e-5 has headroom and
# still catches every fault we inject (>= 1e-3). Half precision: per-token differences of 1e-2 are
# normal kernel noise, so only the mean and the mismatch KL are limited. Beyond them an uncorrected PPO
# ratio is off before any update; the run stops and names the remedy (``rollout_correction: tis``).
PRECISION_TOLERANCES: dict[str, Tolerances] = {
    "float32": Tolerances(max_abs=1e-5, mean_abs=None, k3=None, action="raise"),
    "bfloat16": Tolerances(max_abs=None, mean_abs=1e-2, k3=1e-3, action="raise"),
    "float16": Tolerances(max_abs=None, mean_abs=1e-2, k3=1e-3, action="raise"),
}

# With the correction on, the gate stops only beyond this mismatch KL (``rollout_corr/<expert>_kl``): 150x
# the largest bf16 value measured on the tiny models (6e-5) and 10x the half-precision preset, below every
# recompute fault injected into the LM and DiT except a +1e-2 LoRA change (pad mask 0.037, ignored
# temperature 0.17, ignored top-k 0.36, sigma off by one step 0.015; docs/gates.md).
CORRECTED_KL_TOLERANCE = 1e-2


class LogProbIdentityCheck(pl.Callback):
    """Check that recomputed log-probs equal the behavior log-probs for both experts, every ``every_n_steps``.

    Logs ``c2/<expert>_max_abs_diff``, ``_mean_abs_diff``, ``_frac_bitwise_equal``, ``_ratio_min``,
    ``_ratio_mean``, ``_ratio_max``, ``_k3_mismatch`` (mean k3 KL between behavior and recompute) and
    ``_clip_frac_high`` / ``_clip_frac_low`` (the fraction of ratios outside the expert's PPO clip
    range before any update: one-sided clipping here is the signature of a biased recompute). Limits
    left as None come from :data:`PRECISION_TOLERANCES` for each expert's precision.

    Args:
        tolerance: Largest allowed log-prob difference, ``|recompute - behavior| / max(1, |behavior|)``
            (None: the precision preset, 1e-5 in float32, unchecked in half precision).
        mean_tolerance: Largest allowed mean absolute difference (None: the preset, 1e-2 in half precision).
        k3_tolerance: Largest allowed mean k3 mismatch KL (None: the preset, 1e-3 in half precision).
        action: ``raise`` stops the run with an error naming the expert, step and worst sample; ``warn``
            only warns (None: the preset, ``raise`` at every precision; a half-precision failure names the
            remedy, ``rollout_correction: tis``).
        exact: Experts whose recompute must be bitwise identical to rollout (same function, shapes,
            dtype and device); ``[]`` if nondeterministic kernels make that impossible.
        precision: Tier of the presets; ``auto`` picks half precision when the trainer runs 16-bit, the
            expert's weights are 16-bit, or CUDA float32 matmuls may use TF32.
        every_n_steps: Check every n-th training step (1: every step).
        corrected_kl_tolerance: For an expert whose loss corrects the mismatch (``rollout_correction:
            tis``), the only limit: its mismatch KL ``mean(r - 1 - log r)``, ``r = exp(recompute -
            behavior)``, above which the run stops (None: never; the other limits and the exact tier do
            not apply to it). It also logs ``rollout_corr/<expert>_ratio_mean``, ``_ratio_max``,
            ``_clipped_frac`` (weights the cap truncates) and ``_kl``.
    """

    def __init__(
        self,
        tolerance: float | None = None,
        mean_tolerance: float | None = None,
        k3_tolerance: float | None = None,
        action: Action | None = None,
        exact: tuple[str, ...] = (Role.GENERATOR,),
        precision: Precision = "auto",
        every_n_steps: int = 1,
        corrected_kl_tolerance: float | None = CORRECTED_KL_TOLERANCE,
    ) -> None:
        limits = {
            "tolerance": tolerance,
            "mean_tolerance": mean_tolerance,
            "k3_tolerance": k3_tolerance,
            "corrected_kl_tolerance": corrected_kl_tolerance,
        }
        for name, value in limits.items():
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if action not in (None, "raise", "warn"):
            raise ValueError(f"action must be 'raise' or 'warn', got {action!r}")
        if precision not in ("auto", *PRECISION_TOLERANCES):
            raise ValueError(f"precision must be 'auto' or one of {sorted(PRECISION_TOLERANCES)}, got {precision!r}")
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.tolerance, self.mean_tolerance, self.k3_tolerance = tolerance, mean_tolerance, k3_tolerance
        self.action, self.exact, self.precision = action, tuple(exact), precision
        self.every_n_steps = every_n_steps
        self.corrected_kl_tolerance = corrected_kl_tolerance
        self.last: dict[str, dict[str, float]] = {}
        self.corrections: dict[str, dict[str, float]] = {}

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        require(self, pl_module, RecomputingModule)

    @timing.timed("gate_c2", opaque=True)
    def on_policy_logprobs(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Experience,
        logprobs: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    ) -> None:
        """Called by the module with its first training forward's log-probs, before any optimizer step."""
        if trainer.global_step % self.every_n_steps:
            return
        measured = self.measure(pl_module, batch, logprobs)
        metrics = {f"c2/{name}_{k}": v for name, (stats, _) in measured.items() for k, v in stats.items()}
        for name, stats in self.corrections.items():
            metrics |= rollout_correction_metrics(name, stats)
        # Straight to the loggers (and the RunSummary): within an epoch Lightning re-emits a self.log step
        # metric on every later step, which with every_n_steps > 1 would show checks that never ran.
        log_gate_metrics(trainer, metrics, trainer.global_step)
        self.enforce(pl_module, batch, measured, trainer.global_step)

    def check(self, pl_module: pl.LightningModule, batch: Experience, step: int = 0) -> dict[str, dict[str, float]]:
        """Measure and enforce the identity on one experience without a trainer; return the stats by expert."""
        measured = self.measure(pl_module, batch)
        self.enforce(pl_module, batch, measured, step)
        return self.last

    def measure(
        self,
        pl_module: pl.LightningModule,
        batch: Experience,
        logprobs: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
    ) -> dict[str, tuple[dict[str, float], tuple[int, int]]]:
        """Stats and worst (row, position) by expert of ``(recomputed, behavior, mask)`` log-probs; without
        ``logprobs`` the module recomputes every captured log-prob under its current weights."""
        measured, self.corrections = {}, {}
        logprobs = pl_module.recompute_logprobs(batch) if logprobs is None else logprobs
        for name, (new, old, mask) in logprobs.items():
            settings = pl_module.loss_settings(name)
            measured[name] = _compare(new, old, mask, settings.clip_eps)
            if _corrected(settings):
                stats = rollout_correction_stats(new, old, mask, settings.tis_cap)
                self.corrections[name] = {k: float(v) for k, v in stats.items()}
        self.last = {name: stats for name, (stats, _) in measured.items()}
        return measured

    def tier(self, pl_module: pl.LightningModule, name: str) -> str:
        """The precision tier of expert ``name``: the ``precision`` argument, or with ``auto`` its numerics."""
        return self.precision if self.precision != "auto" else _precision_of(pl_module, name)

    def tolerances(self, pl_module: pl.LightningModule, name: str) -> Tolerances:
        """The limits that apply to expert ``name``: its precision's preset with the explicit arguments on top."""
        preset = PRECISION_TOLERANCES[self.tier(pl_module, name)]
        return replace(
            preset,
            max_abs=preset.max_abs if self.tolerance is None else self.tolerance,
            mean_abs=preset.mean_abs if self.mean_tolerance is None else self.mean_tolerance,
            k3=preset.k3 if self.k3_tolerance is None else self.k3_tolerance,
            action=self.action or preset.action,
        )

    def enforce(
        self,
        pl_module: pl.LightningModule,
        batch: Experience,
        measured: dict[str, tuple[dict[str, float], tuple[int, int]]],
        step: int,
    ) -> None:
        """Raise or warn for every expert whose stats break its limits.

        A half-precision expert whose loss corrects the mismatch is held only to ``corrected_kl_tolerance``
        (on the stats ``measure`` kept in ``corrections``); the others, float32 ones included, to their
        precision tier and the exact tier.
        """
        for name, (stats, worst) in measured.items():
            row, pos = worst
            where = (
                f"worst at sample {row} ({_describe(pl_module, batch, name, row)}), {_position(pl_module, name)} {pos}"
            )
            # A float32 expert keeps the hard gate even with the correction on: its recompute is exact by
            # construction, so any mismatch there is a fault, not numerics to reweight.
            if name in self.corrections and self.tier(pl_module, name) != "float32":
                kl, limit = self.corrections[name]["kl"], self.corrected_kl_tolerance
                if limit is not None and kl > limit:
                    raise LogProbIdentityError(
                        f"C2 log-prob identity failed for expert {name!r} at step {step}: the rollout/recompute "
                        f"mismatch KL {kl:.3e} exceeds corrected_kl_tolerance {limit:.1e} (max |diff| = "
                        f"{stats['max_abs_diff']:.3e}); {where}. Truncated importance weights correct kernel "
                        "noise, not a recompute that scores another distribution."
                    )
                continue
            limits = self.tolerances(pl_module, name)
            broken = _violations(stats, limits, exact=name in self.exact)
            if not broken:
                continue
            msg = (
                f"C2 log-prob identity failed for expert {name!r} at step {step}: {'; '.join(broken)}; "
                f"{where}. The training recompute does not score the distribution the sample was drawn from."
            )
            if self.tier(pl_module, name) != "float32":
                msg += (
                    f" If this is the numerics of a half-precision or TF32 run rather than a fault, set "
                    f"model.{name}_loss.rollout_correction=tis to correct it with truncated importance weights."
                )
            if limits.action == "raise":
                raise LogProbIdentityError(msg)
            warnings.warn(msg, stacklevel=1)


def _corrected(settings: object) -> bool:
    """Whether an expert's loss settings correct the rollout/train mismatch (a user's module may not say)."""
    return getattr(settings, "rollout_correction", "off") != "off"


def _violations(stats: dict[str, float], limits: Tolerances, exact: bool) -> list[str]:
    broken = []
    if exact and stats["frac_bitwise_equal"] < 1.0:
        broken.append(
            f"expected bitwise equality (same function, shapes, dtype and device as rollout) but only "
            f"{stats['frac_bitwise_equal']:.1%} are equal, max |diff| = {stats['max_abs_diff']:.3e}"
        )
    checks = (
        ("max_scaled_diff", limits.max_abs, "max |logp_recompute - logp_behavior| / max(1, |logp_behavior|)"),
        ("mean_abs_diff", limits.mean_abs, "mean |logp_recompute - logp_behavior|"),
        ("k3_mismatch", limits.k3, "mean k3 mismatch KL"),
    )
    for key, limit, label in checks:
        if limit is not None and stats[key] > limit:
            broken.append(f"{label} = {stats[key]:.3e} > tolerance {limit:.1e}")
    return broken


def _precision_of(pl_module: pl.LightningModule, name: str) -> str:
    trainer = getattr(pl_module, "_trainer", None)
    trainer_precision = str(getattr(trainer, "precision", "32")) if trainer is not None else "32"
    if "bf16" in trainer_precision:
        return "bfloat16"
    if "16" in trainer_precision:
        return "float16"
    expert = pl_module.experts().get(name)
    dtype = getattr(expert, "dtype", torch.float32)
    if dtype in (torch.bfloat16, torch.float16):
        return str(dtype).removeprefix("torch.")
    # TF32 matmuls carry ~1e-3 relative error: float32 weights, half-precision-like differences.
    if pl_module.device.type == "cuda" and torch.get_float32_matmul_precision() != "highest":
        return "bfloat16"
    return "float32"


def _compare(
    new: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, clip_eps: float
) -> tuple[dict[str, float], tuple[int, int]]:
    mask = mask.bool()
    diff = torch.where(mask, (new - old).abs(), torch.zeros_like(new))
    worst = divmod(int(diff.argmax()), diff.shape[1])
    real = diff[mask]
    if not real.numel():
        empty = {
            "max_abs_diff": 0.0,
            "max_scaled_diff": 0.0,
            "mean_abs_diff": 0.0,
            "frac_bitwise_equal": 1.0,
            "ratio_min": 1.0,
            "ratio_mean": 1.0,
            "ratio_max": 1.0,
            "k3_mismatch": 0.0,
            "clip_frac_high": 0.0,
            "clip_frac_low": 0.0,
        }
        return empty, worst
    ratio = torch.exp(new - old)[mask]
    stats = {
        "max_abs_diff": float(real.max()),
        # Float32 rounding of a log-softmax grows with its magnitude (an ulp of -20 is 2e-6), so the
        # tolerance applies to the difference relative to max(1, |logp|).
        "max_scaled_diff": float((real / old[mask].abs().clamp_min(1.0)).max()),
        "mean_abs_diff": float(real.mean()),
        "frac_bitwise_equal": float((new[mask] == old[mask]).float().mean()),
        "ratio_min": float(ratio.min()),
        "ratio_mean": float(ratio.mean()),
        "ratio_max": float(ratio.max()),
        "k3_mismatch": float(k3_kl(new[mask], old[mask]).mean()),
        "clip_frac_high": float((ratio > 1 + clip_eps).float().mean()),
        "clip_frac_low": float((ratio < 1 - clip_eps).float().mean()),
    }
    return stats, worst


def _position(pl_module: pl.LightningModule, name: str) -> str:
    """What a column of expert ``name``'s values is, as the module's algorithms say (a user's module may not)."""
    label = getattr(pl_module, "position_label", None)
    return label(name) if label is not None else "position"


def _describe(pl_module: pl.LightningModule, batch: Experience, name: str, row: int) -> str:
    """Which sample row ``row`` of expert ``name``'s values is, as the module's algorithms say."""
    describe = getattr(pl_module, "describe_sample", None)
    return describe(name, batch, row) if describe is not None else f"prompt {batch.prompts[row]!r}"
