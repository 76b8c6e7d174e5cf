"""The run identity: what a resumed run must share with the run that wrote its checkpoint.

:func:`run_identity` is saved with every checkpoint (``unirl_pl.checkpoint.save_run_state``) and
:func:`check_identity` compares it with the resuming run's, so a resume with a changed recipe (mode, LoRA,
optimizers, learning rates, seed, EMA) stops in one line before it trains instead of silently training
something else.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.trainer.states import TrainerFn

from unirl_pl.errors import InputError

EMA_STATE_KEY = "EMA"
"""Where a checkpoint keeps the ``EMA`` callback's state: ``checkpoint["callbacks"]["EMA"]``."""


def run_identity(module: Any) -> dict[str, Any]:
    """What a resumed run must share with the run that wrote the checkpoint, as a flat dict of plain values.

    Keys: ``mode``, ``trained`` (the trained experts), ``<expert>.finetune``, ``<expert>.lora_rank`` / ``.lora_alpha`` /
    ``.lora_targets`` for every expert present (a frozen expert's adapter is in the checkpoint too),
    ``<expert>.optimizer`` and ``<expert>.lr`` for every trained expert, ``data.seed`` when a datamodule with a
    ``seed`` is attached, and the EMA's (:func:`ema_identity`). Optimizers are read by building each expert's
    optimizer on a dummy parameter, which works before ``configure_optimizers`` has run (as in ``on_load_checkpoint``).
    Call it once the experts exist (after ``configure_model``, as in both checkpoint hooks): a
    signature default that jsonargparse has not initialized yet has no LoRA settings to read.
    """
    identity: dict[str, Any] = {"mode": module.mode, "trained": list(module.trained)}
    for name, expert in module.experts().items():
        # A full fine-tune's checkpoint holds whole models, a LoRA run's adapters: neither resumes as the other.
        identity[f"{name}.finetune"] = str(getattr(expert, "finetune", "lora"))
        for key in ("lora_rank", "lora_alpha"):
            value = getattr(expert, key, None)
            if value is not None:
                identity[f"{name}.{key}"] = float(value) if key == "lora_alpha" else int(value)
        targets = getattr(expert, "lora_target_modules", None)
        if targets is not None:
            identity[f"{name}.lora_targets"] = sorted(str(t) for t in targets)
    for name in module.trained:
        factory = module.optimizer_factories.get(name)
        if factory is None:
            continue
        probe = factory([torch.nn.Parameter(torch.zeros(1))])
        identity[f"{name}.optimizer"] = f"{type(probe).__module__}.{type(probe).__qualname__}"
        lr = probe.defaults.get("lr")
        if lr is not None:
            identity[f"{name}.lr"] = float(lr)
    trainer = getattr(module, "_trainer", None)
    seed = getattr(getattr(trainer, "datamodule", None), "seed", None)
    if isinstance(seed, int):
        identity["data.seed"] = seed
    return identity | ema_identity(module)


def ema_identity(module: Any) -> dict[str, Any]:
    """The EMA's part of the run identity: ``ema`` (``on``/``off``) and, when on, ``ema.components`` (the averaged
    experts) and ``ema.decay``; empty where the run cannot say (no trainer attached, as in export, or not
    fitting: validate and predict may score a checkpoint's raw weights)."""
    trainer = getattr(module, "_trainer", None)
    if getattr(getattr(trainer, "state", None), "fn", None) != TrainerFn.FITTING:
        return {}
    ema = next((c for c in trainer.callbacks if getattr(c, "state_key", None) == EMA_STATE_KEY), None)
    if ema is None:
        return {"ema": "off"}
    components = ema.components if ema.components is not None else module.trained
    return {"ema": "on", "ema.components": sorted(components), "ema.decay": float(ema.decay)}


def saved_ema_identity(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """:func:`ema_identity` of a checkpoint written before the identity held it, read from the EMA state it
    holds (or ``off`` when it holds none)."""
    state = checkpoint.get("callbacks", {}).get(EMA_STATE_KEY)
    if not state or "ema" not in state:
        return {"ema": "off"}
    return {"ema": "on", "ema.components": sorted(state["components"]), "ema.decay": float(state["decay"])}


def check_identity(saved: dict[str, Any], current: dict[str, Any], path: Any = None) -> None:
    """Raise :class:`~unirl_pl.errors.InputError` (one line) listing every key whose value differs between ``saved``
    and ``current``, naming the checkpoint ``path`` when given.

    A key present on one side only counts as changed (``<absent>`` on the other), except ``data.seed`` missing
    from ``current`` (no datamodule attached, as in ``python -m unirl_pl export``) and the EMA's keys when
    ``current`` has none (not fitting) or the checkpoint had no EMA (one may start on resume, from the restored
    weights: docs/ema.md). The message shows ``key: checkpoint=<old> now=<new>`` per key, so a resume with a
    changed recipe stops before it trains.
    """
    missing = "<absent>"
    # Checkpoints from before full fine-tuning existed record no ``<expert>.finetune``: they trained LoRA.
    saved = {**{key: "lora" for key in current if key.endswith(".finetune")}, **saved}
    keys = set(saved) | set(current)
    if "data.seed" not in current:
        keys.discard("data.seed")  # no datamodule attached (e.g. export): nothing to compare against
    if "ema" not in current or saved.get("ema", "off") == "off":
        keys -= {key for key in keys if key == "ema" or key.startswith("ema.")}
    changed = [
        f"{key}: checkpoint={saved.get(key, missing)!r} now={current.get(key, missing)!r}"
        for key in sorted(keys)
        if saved.get(key, missing) != current.get(key, missing)
    ]
    if changed:
        which = f"the checkpoint {path}" if path else "the checkpoint"
        ema = any(line.startswith("ema") for line in changed)
        hint = " (model.ema: resume with the checkpoint's EMA; one can only be added to a run that had none)"
        raise InputError(
            f"{which} was written by a differently configured run; resuming would silently train something else. "
            f"Changed settings: {'; '.join(changed)}{hint if ema else ''}"
        )
