"""C2 log-prob identity: the probability in the PPO ratio must be the one each sample was drawn from.

Before any optimizer step on an experience, the gate re-scores every captured LM token and every
captured SDE step under the unchanged weights and compares with the behavior log-probs. A padding
mask that differs between decode and recompute, a temperature or top-k the recompute ignores, a
sigma off by one step, or weights that changed between rollout and training all show up here.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

import lightning.pytorch as pl
import torch

from unirl_pl.data import Experience
from unirl_pl.losses import k3_kl


class LogProbIdentityError(RuntimeError):
    """The recomputed log-probs of a captured behavior differ from the behavior log-probs."""


class LogProbIdentityCheck(pl.Callback):
    """Check ``|logp_recompute - logp_behavior| <= tolerance`` for both experts, every ``every_n_steps``.

    Logs ``c2/<expert>_max_abs_diff``, ``_mean_abs_diff``, ``_frac_bitwise_equal``, ``_ratio_min``,
    ``_ratio_max`` and ``_k3_mismatch`` (mean k3 KL between behavior and recompute).

    Args:
        tolerance: Largest allowed absolute log-prob difference (1e-5 suits float32 on CPU; under
            bf16 on GPU use about 1e-2 with ``action: warn``).
        action: ``raise`` stops the run with an error naming the expert, step and worst sample; ``warn`` only warns.
        every_n_steps: Check every n-th training step (1: every step).
    """

    def __init__(self, tolerance: float = 1e-5, action: Literal["raise", "warn"] = "raise", every_n_steps: int = 1) -> None:
        if tolerance < 0:
            raise ValueError(f"tolerance must be >= 0, got {tolerance}")
        if action not in ("raise", "warn"):
            raise ValueError(f"action must be 'raise' or 'warn', got {action!r}")
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.tolerance, self.action, self.every_n_steps = tolerance, action, every_n_steps
        self.last: dict[str, dict[str, float]] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if not isinstance(batch, Experience) or trainer.global_step % self.every_n_steps:
            return
        self.last = {}
        for name, (new, old, mask) in pl_module.recompute_logprobs(batch).items():
            stats, worst = _compare(new, old, mask)
            self.last[name] = stats
            pl_module.log_dict({f"c2/{name}_{k}": v for k, v in stats.items()}, batch_size=len(batch.prompts))
            if stats["max_abs_diff"] > self.tolerance:
                row = worst[0]
                where = _describe(batch, name, row)
                msg = (
                    f"C2 log-prob identity failed for expert {name!r} at step {trainer.global_step}: "
                    f"max |logp_recompute - logp_behavior| = {stats['max_abs_diff']:.3e} > tolerance "
                    f"{self.tolerance:.1e}, worst at sample {row} ({where}), position {worst[1]}. The training "
                    "recompute does not score the distribution the sample was drawn from."
                )
                if self.action == "raise":
                    raise LogProbIdentityError(msg)
                warnings.warn(msg, stacklevel=1)


def _compare(new: torch.Tensor, old: torch.Tensor, mask: torch.Tensor) -> tuple[dict[str, float], tuple[int, int]]:
    mask = mask.bool()
    diff = torch.where(mask, (new - old).abs(), torch.zeros_like(new))
    flat = int(diff.argmax())
    worst = divmod(flat, diff.shape[1])
    real = diff[mask]
    ratio = torch.exp(new - old)[mask]
    stats = {
        "max_abs_diff": float(real.max()) if real.numel() else 0.0,
        "mean_abs_diff": float(real.mean()) if real.numel() else 0.0,
        "frac_bitwise_equal": float((new[mask] == old[mask]).float().mean()) if real.numel() else 1.0,
        "ratio_min": float(ratio.min()) if real.numel() else 1.0,
        "ratio_max": float(ratio.max()) if real.numel() else 1.0,
        "k3_mismatch": float(k3_kl(new[mask], old[mask]).mean()) if real.numel() else 0.0,
    }
    return stats, worst


def _describe(batch: Experience, name: str, row: int) -> str:
    if name == "llm" and batch.lm is not None:
        text_row = int(batch.lm.rows[row])
        images = (batch.text_index == text_row).nonzero()
        prompt = batch.prompts[int(images[0])] if len(images) else "?"
        return f"prompt {prompt!r}"
    return f"prompt {batch.prompts[row]!r}, refined {batch.refined[row]!r}"
