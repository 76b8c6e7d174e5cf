"""Interleave parity: a request must come out the same whether it ran alone or batched with others.

The loops batch requests (all samples of a step advance together, each on its own
schedule) or runs them one at a time. Each sample draws its randomness from its own seeded generator,
so the two must agree: tokens exactly, latents, images and log-probs to kernel noise. Randomness
shared across requests (a module-global RNG), noise that depends on batch position, or state leaking
between requests breaks that, and this gate catches it on a fixed probe set before training starts
and every ``every_n_steps`` steps.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from torch import Tensor

from unirl_pl import timing
from unirl_pl.callbacks.protocol import SamplingModule, require
from unirl_pl.callbacks.summary import log_gate_metrics
from unirl_pl.card import Loop, Role
from unirl_pl.records import cond_rows

# Probe requests get their own id, far from training (>= 0) and evaluation (-1, -2, ...) ids.
PROBE_REQUEST_ID = -(1 << 40)
PROBE_SEED = 0
ProbeProfile = Literal["serve", "rollout"]


class InterleaveParityError(RuntimeError):
    """A request's batched output differs from its serial output, or the probe produced nothing."""


@dataclass
class ParityReport:
    """Largest batched-vs-serial difference per compared quantity, and the failures found."""

    diffs: dict[str, float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def _empty(self, where: str, batched: Tensor, serial: Tensor) -> bool:
        # Two empty outputs agree trivially; a probe that compares nothing must not pass.
        if batched.numel() == 0 and serial.numel() == 0:
            self.failures.append(f"{where}: both sides are empty")
            return True
        return False

    def tokens(self, where: str, batched: Tensor, serial: Tensor) -> None:
        """Token ids must be identical, including their count."""
        if self._empty(where, batched, serial):
            return
        if batched.shape != serial.shape or not torch.equal(batched, serial):
            n = min(len(batched), len(serial))
            first = next((j for j in range(n) if batched[j] != serial[j]), n)
            self.failures.append(
                f"{where}: tokens differ from position {first} (batched {batched[first : first + 4].tolist()}, "
                f"serial {serial[first : first + 4].tolist()}; lengths {len(batched)} vs {len(serial)})"
            )

    def values(self, where: str, key: str, batched: Tensor, serial: Tensor, tolerance: float) -> None:
        """Floats must agree to ``|batched - serial| <= tolerance * max(1, |serial|)``; the max |diff| is kept."""
        if self._empty(where, batched, serial):
            return
        if batched.shape != serial.shape:
            shapes = f"batched {tuple(batched.shape)} vs serial {tuple(serial.shape)}"
            self.failures.append(f"{where}: shapes differ, {shapes}")
            return
        diff = (batched.double() - serial.double()).abs()
        # Float32 rounding scales with magnitude (a log-prob of -20 has an ulp of 2e-6), so the bound does too.
        excess = diff / serial.double().abs().clamp_min(1.0)
        worst = float(diff.max()) if not diff.isnan().any() else float("nan")
        self.diffs[key] = max(self.diffs.get(key, 0.0), worst)
        if not float(excess.max()) <= tolerance:  # also true for NaN
            at = int(excess.nan_to_num(float("inf")).argmax())
            self.failures.append(
                f"{where}: |batched - serial| = {float(diff.flatten()[at]):.3e} at element {at} "
                f"(value {float(serial.flatten()[at]):.4g}) > tolerance {tolerance:.1e} x max(1, |value|)"
            )

    @property
    def max_abs_diff(self) -> float:
        return max(self.diffs.values(), default=0.0)


class InterleaveParityCheck(pl.Callback):
    """Run a probe set batched and serially in the serve and rollout profiles and require equal results.

    The probe is ``num_requests`` requests of one repeated ``prompt``, each with its own sample index
    (its own seed) and a step count cycling through ``step_counts``, so requests on different schedules
    share the batched run. Compared: refined-prompt tokens exactly; token log-probs, latents, decoded
    images and the generator's behavior record (the SDE steps' x_t, x_next and log-probs, or what its algorithm
    records instead) within ``tolerance``. Logs ``parity/max_abs_diff``
    and ``parity/<expert>_max_abs_diff``. Runs at fit start (before the first rollout) and on every
    ``every_n_steps``-th step; a probe that compares nothing fails rather than passes.

    Args:
        every_n_steps: Check again every n-th training step (the LoRA weights move, the kernels see new values).
        tolerance: Largest allowed ``|batched - serial| / max(1, |serial|)`` of any float output (batched
            kernels reduce in a different order: a few float32 ulps, ~1e-6, on CPU; raise it for bf16).
        prompt: The probe prompt every request repeats.
        num_requests: Requests in the probe (>= 2, else there is nothing to batch).
        step_counts: Denoising step counts cycled over the requests (None: the configured count and about
            half of it, never below the end of the SDE window).
        profiles: Profiles to probe (``serve``: greedy decode and the ODE; ``rollout``: sampling and the SDE).
        action: ``raise`` stops the run with where and by how much; ``warn`` only warns.
    """

    def __init__(
        self,
        every_n_steps: int = 50,
        tolerance: float = 1e-5,
        prompt: str = "a red circle",
        num_requests: int = 4,
        step_counts: list[int] | None = None,
        profiles: tuple[ProbeProfile, ...] = ("serve", "rollout"),
        action: Literal["raise", "warn"] = "raise",
    ) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        if tolerance < 0:
            raise ValueError(f"tolerance must be >= 0, got {tolerance}")
        if num_requests < 2:
            raise ValueError(f"num_requests must be >= 2 (one request has nothing to batch with), got {num_requests}")
        if step_counts is not None and (not step_counts or min(step_counts) < 1):
            raise ValueError(f"step_counts must be a non-empty list of counts >= 1, got {step_counts}")
        if not profiles or any(p not in ("serve", "rollout") for p in profiles):
            raise ValueError(f"profiles must name 'serve' and/or 'rollout', got {profiles}")
        if action not in ("raise", "warn"):
            raise ValueError(f"action must be 'raise' or 'warn', got {action!r}")
        self.every_n_steps, self.tolerance, self.prompt = every_n_steps, tolerance, prompt
        self.num_requests, self.step_counts, self.profiles = num_requests, step_counts, tuple(profiles)
        self.action = action
        self.last: ParityReport | None = None
        self._checked_at: int | None = None

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        require(self, pl_module, SamplingModule)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._run(trainer, pl_module)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step % self.every_n_steps == 0 and trainer.global_step != self._checked_at:
            self._run(trainer, pl_module)

    def _run(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # An editing run probes with its first source image: its generator may need one, its refiner may read it.
        sources = getattr(getattr(trainer, "datamodule", None), "train_sources", None)
        report = self.check(pl_module, trainer.global_step, sources[0].pixels if sources else None)
        self._checked_at = trainer.global_step
        metrics = {"parity/max_abs_diff": report.max_abs_diff}
        metrics.update({f"parity/{k}_max_abs_diff": v for k, v in report.diffs.items()})
        # Straight to the loggers (and the RunSummary): self.log is refused in on_fit_start, and within an
        # epoch Lightning re-emits a step metric on every later step, which would show checks that never ran.
        log_gate_metrics(trainer, metrics, trainer.global_step)

    # ------------------------------------------------------------------ the check
    @timing.timed("gate_parity", opaque=True)
    @torch.no_grad()
    def check(self, pl_module: pl.LightningModule, step: int = 0, source: Tensor | None = None) -> ParityReport:
        """Probe batched vs serial in every profile; raise (or warn) on a divergence or an empty probe. ``source``
        (an edit's source image, float (3, H, W) in [0, 1]) goes with every probe request."""
        denoise = getattr(pl_module, Loop.DENOISE, None)
        if denoise is None:
            raise InterleaveParityError("interleave parity: the module has no loops (configure_model not run)")
        report = ParityReport()
        for profile in self.profiles:
            if pl_module.ar_decode is not None:
                self._compare_lm(pl_module.ar_decode, profile, report, source)
            self._compare_dit(pl_module.generator, denoise, profile, report, source)
        self.last = report
        if report.failures:
            counts = self.probe_step_counts(denoise.config, denoise.least_steps())
            probe = f"probe {self.prompt!r} x {self.num_requests}, step counts {counts}"
            msg = (
                f"Interleave parity failed at step {step} ({probe}): " + "; ".join(report.failures) + ". A request's "
                "result depends on what it is batched with: look for randomness shared across requests or noise "
                "that depends on batch position."
            )
            if self.action == "raise":
                raise InterleaveParityError(msg)
            warnings.warn(msg, stacklevel=1)
        return report

    def _requests(self) -> tuple[list[int], list[int]]:
        return [PROBE_REQUEST_ID] * self.num_requests, list(range(self.num_requests))

    def probe_step_counts(self, config: Any, least: int = 1) -> list[int]:
        """The denoising step count of each probe request (``step_counts`` cycled, or the default mix: the
        configured count and about half of it, never below ``least``, the fewest steps a rollout request of
        the generator's algorithm may run)."""
        options = self.step_counts or [config.num_steps, max(least, (config.num_steps + 1) // 2)]
        return [options[i % len(options)] for i in range(self.num_requests)]

    def _compare_lm(self, loop: Any, profile: ProbeProfile, report: ParityReport, source: Tensor | None) -> None:
        ids, idx = self._requests()
        sees = source is not None and getattr(loop.llm, "sees_images", False)
        images = (lambda n: {"images": [source] * n}) if sees else (lambda n: {})
        _, batched = loop.sample([self.prompt] * len(ids), ids, idx, profile, seed=PROBE_SEED, **images(len(ids)))
        for i, (r, k) in enumerate(zip(ids, idx, strict=True)):
            _, alone = loop.sample([self.prompt], [r], [k], profile, seed=PROBE_SEED, **images(1))
            b_live, s_live = batched.gen_mask[i], alone.gen_mask[0]
            where = f"llm/{profile} request {i}"
            report.tokens(where, batched.gen_ids[i][b_live], alone.gen_ids[0][s_live])
            b_logp, s_logp = batched.old_logp[i][b_live], alone.old_logp[0][s_live]
            report.values(f"{where} log-probs", Role.REFINER, b_logp, s_logp, self.tolerance)

    def _compare_dit(
        self, generator: Any, loop: Any, profile: ProbeProfile, report: ParityReport, source: Tensor | None
    ) -> None:
        ids, idx = self._requests()
        counts = self.probe_step_counts(loop.config, loop.least_steps())
        n = len(ids)
        # Straight to the encoder, not through the module's feature cache: the probe must not move its hit rate.
        edits = source is not None and getattr(generator, "takes_source_images", False)
        reads = edits and getattr(generator, "text_sees_source", False)
        one = generator.encode([self.prompt], [source]) if reads else generator.encode([self.prompt])
        if edits:
            one |= generator.encode_source([source])
        cond = {k: v.repeat(n, *[1] * (v.ndim - 1)) for k, v in one.items()}
        uncond = generator.encode([""]) if loop.config.guided else None
        lat_b, rec_b = loop.sample(cond, ids, idx, profile, seed=PROBE_SEED, uncond=uncond, num_steps=counts)
        img_b = generator.decode(lat_b)
        for i in range(n):
            sl = slice(i, i + 1)
            lat_s, rec_s = loop.sample(
                cond_rows(cond, sl), ids[sl], idx[sl], profile, seed=PROBE_SEED, uncond=uncond, num_steps=counts[sl]
            )
            where = f"transformer/{profile} request {i} ({counts[i]} steps)"
            report.values(f"{where} latents", Role.GENERATOR, lat_b[sl], lat_s, self.tolerance)
            report.values(f"{where} images", "images", img_b[sl], generator.decode(lat_s), self.tolerance)
            if (rec_b is None) != (rec_s is None):
                report.failures.append(f"{where}: only one side captured a behavior record")
            elif rec_b is not None and rec_s is not None:
                serial = rec_s.behavior()
                for name, b_val in rec_b.behavior().items():
                    report.values(f"{where} record.{name}", Role.GENERATOR, b_val[sl], serial[name], self.tolerance)
