"""The one hook through which the policy update hands its on-policy log-probs to the trainer's callbacks.

The method owns the hook's name and its call; the callbacks (the C2 gate) implement it. It lives here, below
both, so the method never imports the callbacks package (``tests/test_import_graph.py`` checks the direction).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # names for the type checker only
    import lightning.pytorch as pl

    from unirl_pl.method.policy import LogProbs
    from unirl_pl.records import Experience

POLICY_LOGPROBS_HOOK = "on_policy_logprobs"
"""A callback method ``(trainer, pl_module, exp, logprobs)`` called before any optimizer step of a step."""


def reads_policy_logprobs(trainer: pl.Trainer | None) -> bool:
    """Whether some callback of ``trainer`` implements :data:`POLICY_LOGPROBS_HOOK` (a gate reads the values)."""
    return trainer is not None and any(hasattr(c, POLICY_LOGPROBS_HOOK) for c in trainer.callbacks)


def notify_policy_logprobs(trainer: pl.Trainer, pl_module: Any, exp: Experience, logprobs: LogProbs) -> None:
    """Call ``on_policy_logprobs(trainer, pl_module, exp, logprobs)`` on every callback that has it.

    The module calls this after its first training forward and before any optimizer step, with
    ``{component: (recomputed, behavior, mask)}`` log-probs (the C2 gate's input).
    """
    for callback in trainer.callbacks:
        hook = getattr(callback, POLICY_LOGPROBS_HOOK, None)
        if hook is not None:
            hook(trainer, pl_module, exp, logprobs)
