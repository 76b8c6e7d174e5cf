"""``EMA``: an exponential moving average of each trained adapter, scored by validation and predict.

Flow-GRPO keeps one (``config.train.ema = True`` in its ``config/grpo.py`` configs;
``EMAModuleWrapper(transformer_trainable_parameters, decay=0.9, update_step_interval=8)`` in
``scripts/train_sd3.py``), evaluates with it and saves it as the LoRA. This callback is that wrapper's
arithmetic on the trainer's global steps; ``docs/ema.md`` has the sources and the one place the
reference's training loop differs (it applies each scheduled update once per micro-batch).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor

from unirl_pl.errors import ConfigError
from unirl_pl.identity import EMA_STATE_KEY

STATE_KEY = EMA_STATE_KEY  # checkpoint["callbacks"]["EMA"], read by the run identity (unirl_pl.identity) too
# The reference's warm-up: min((1 + k) / (10 + k), decay) at the k-th step (flow_grpo/ema.py).
WARMUP_OFFSET = 10


class EMA(pl.Callback):
    """Keep an EMA copy of every trained expert's trainable (LoRA) parameters; validate and predict with it.

    After the optimizer steps of global step ``s`` (``on_train_batch_end``, when ``trainer.global_step == s``)
    and with ``k = s - start_step``, the EMA moves toward the weights when ``k >= 0`` and
    ``(k + 1) % every_n_steps == 0``::

        d = min((1 + k) / (10 + k), decay) if warmup else decay
        ema += (1 - d) * (weights - ema)

    which is Flow-GRPO's ``EMAModuleWrapper.step(parameters, optimization_step=k)`` (so with the defaults the
    first update is after step 7, at ``d = 8/17``, and ``d`` reaches 0.9 at step 87). The EMA starts as a
    copy of the weights at global step ``start_step`` (0: the initial adapters, as in Flow-GRPO) and until
    then follows the weights. Each global step updates at most once.

    ``on_validation_start`` / ``on_predict_start`` (the sanity check too) copy the EMA into the experts and
    keep the training weights aside; the end of the validation / predict epoch (before any checkpoint a
    callback writes in ``on_validation_end``) copies them back exactly, as does an exception. Weight
    versions are untouched: the swap is not a training step. The EMA is saved with the checkpoint (this
    callback's state) and restored on resume, so a resumed run ends with the same EMA bit for bit;
    ``python -m unirl_pl export`` writes the EMA adapters from such a checkpoint (``--raw``: the training
    weights). Under FSDP2 the EMA tensors are DTensors sharded like their parameters and are saved whole.

    Args:
        decay: The EMA's weight on its past (Flow-GRPO: 0.9); in ``[0, 1)``.
        every_n_steps: Update every this many global steps (Flow-GRPO: 8).
        start_step: The global step the EMA starts at: a copy of the weights then, updated from then on.
        warmup: Ramp the decay up as Flow-GRPO does (``min((1 + k) / (10 + k), decay)``); False uses
            ``decay`` from the first update.
        components: The experts to average (``llm``, ``transformer``); None: every trained expert.
    """

    def __init__(
        self,
        decay: float = 0.9,
        every_n_steps: int = 8,
        start_step: int = 0,
        warmup: bool = True,
        components: list[str] | None = None,
    ) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay must be in [0, 1), got {decay}")
        if every_n_steps < 1:
            raise ValueError(f"EMA every_n_steps must be >= 1, got {every_n_steps}")
        if start_step < 0:
            raise ValueError(f"EMA start_step must be >= 0, got {start_step}")
        if components is not None and not components:
            raise ValueError("EMA components is empty: name experts (llm, transformer) or leave it null for all")
        self.decay, self.every_n_steps, self.start_step, self.warmup = float(decay), every_n_steps, start_step, warmup
        self.components = list(components) if components is not None else None
        self.ema: dict[str, Tensor] | None = None  # "<expert>.<parameter name>" -> EMA tensor
        self.last_step = -1  # the last global step the EMA was updated at (or followed the weights at)
        self._params: dict[str, Tensor] = {}
        self._experts: list[torch.nn.Module] = []
        self._trainer: pl.Trainer | None = None
        self._stashed: dict[str, Tensor] | None = None  # the training weights while the EMA is swapped in
        self._loaded: dict[str, Any] | None = None  # checkpoint state that arrived before the tensors existed

    @property
    def state_key(self) -> str:
        return STATE_KEY

    def check_components(
        self, experts: Sequence[str], trained: Sequence[str], mode: str, setting: str = "EMA components"
    ) -> None:
        """Raise ``ValueError`` when ``components`` names an expert the model does not have, or one its ``mode``
        does not train (its weights never move: there is nothing to average); the message names ``setting``.
        The module calls it when it is built from the recipe, so the run stops before any model loads."""
        if self.components is None:
            return
        unknown = sorted(set(self.components) - set(experts))
        if unknown:
            raise ValueError(
                f"{setting}={self.components}: this model has no expert {unknown} (its experts: "
                f"{sorted(experts)}); name some of them, or leave components null for every trained expert"
            )
        frozen = sorted(set(self.components) - set(trained))
        if frozen:
            raise ValueError(
                f"{setting}={self.components}: {frozen} is not trained in mode {mode!r} (trained: "
                f"{list(trained)}), so its weights never change and there is nothing to average; name trained "
                "experts, or leave components null for every trained expert"
            )

    # ------------------------------------------------------------------ the arithmetic
    def decay_at(self, step: int) -> float | None:
        """The decay of the update after global step ``step``; None when that step does not update."""
        k = step - self.start_step
        if k < 0 or (k + 1) % self.every_n_steps != 0:
            return None
        return min((1 + k) / (WARMUP_OFFSET + k), self.decay) if self.warmup else self.decay

    @torch.no_grad()
    def update(self, step: int) -> bool:
        """Apply global step ``step``'s update (or follow the weights before ``start_step``); True if it moved.

        A step already applied is not applied again (a checkpoint written in the same step may have)."""
        if self.ema is None:
            raise RuntimeError("EMA.update() before the EMA was created (it is created at on_train_start)")
        if step <= self.last_step:
            return False
        self.last_step = step
        if 0 < step <= self.start_step:  # not started: the EMA is the weights (the origin at start_step)
            for key, param in self._params.items():
                self.ema[key].copy_(param.detach())
        decay = self.decay_at(step)
        if decay is None:
            return False
        one_minus_decay = 1 - decay
        for key, param in self._params.items():
            ema = self.ema[key]
            ema.add_(one_minus_decay * (param.detach() - ema))
        return True

    # ------------------------------------------------------------------ building
    def trainable(self, pl_module: Any) -> dict[str, Tensor]:
        """``{"<expert>.<parameter name>": parameter}`` of the averaged experts' trainable parameters."""
        experts = pl_module.experts()
        names = self.components if self.components is not None else list(pl_module.trained)
        unknown = sorted(set(names) - set(experts))
        if unknown:
            raise ValueError(f"EMA: no expert {unknown} in this model (it has {sorted(experts)})")
        params = {
            f"{name}.{key}": param
            for name in names
            for key, param in experts[name].named_parameters()
            if param.requires_grad
        }
        if not params:
            raise ValueError(f"EMA: experts {names} have no trainable parameters to average")
        return params

    def _ensure(self, trainer: pl.Trainer, pl_module: Any) -> None:
        """Create the EMA (a clone of the current weights), then apply a checkpoint's state if one arrived."""
        self._trainer = trainer
        if self.ema is not None:
            return
        names = self.components if self.components is not None else list(pl_module.trained)
        self._experts = [expert for name, expert in pl_module.experts().items() if name in names]
        self._reshard()  # FSDP2: name the sharded parameters, not a forward's gathered copies
        self._params = self.trainable(pl_module)
        with torch.no_grad():
            self.ema = {key: param.detach().clone() for key, param in self._params.items()}
        if self._loaded is not None:
            state, self._loaded = self._loaded, None
            self._apply_state(state)
        elif trainer.global_step > 0:
            rank_zero_warn(
                f"EMA: the checkpoint holds no EMA state; the EMA starts from the weights at step {trainer.global_step}"
            )

    # ------------------------------------------------------------------ swapping
    @torch.no_grad()
    def swap_in(self) -> None:
        """Put the EMA into the experts, keeping the training weights aside (no-op when already swapped)."""
        if self.ema is None or self._stashed is not None:
            return
        self._reshard()
        self._stashed = {key: param.detach().clone() for key, param in self._params.items()}
        for key, param in self._params.items():
            param.copy_(self.ema[key])

    @torch.no_grad()
    def swap_out(self) -> None:
        """Put the training weights back, bit for bit (no-op when they are in place)."""
        if self._stashed is None:
            return
        self._reshard()
        for key, param in self._params.items():
            param.copy_(self._stashed[key])
        self._stashed = None

    def _reshard(self) -> None:
        """FSDP2 with ``reshard_after_forward=False`` keeps a no-grad forward's gathered weights and reuses them
        in the next forward: free them, so the forward after a swap gathers the weights just copied in."""
        for expert in self._experts:
            for module in expert.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # An EMA given as a trainer callback (not model.ema, which the module checks when it is built): checked
        # before the models load, and refused as a configuration error (one line on the command line).
        trained, experts = getattr(pl_module, "trained", None), getattr(pl_module, "experts", None)
        if trained is None or not callable(experts):
            return
        try:
            mode = str(getattr(pl_module, "mode", ""))
            self.check_components(list(experts()), list(trained), mode, "the EMA callback's components")
        except ValueError as err:
            raise ConfigError(str(err)) from err

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._ensure(trainer, pl_module)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._ensure(trainer, pl_module)
        self.update(trainer.global_step)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start_scoring(trainer, pl_module)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.swap_out()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.swap_out()

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start_scoring(trainer, pl_module)

    def on_predict_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.swap_out()

    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.swap_out()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.swap_out()

    def _start_scoring(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        fitting = trainer.state.fn == TrainerFn.FITTING
        if self.ema is None and not fitting and self._loaded is None:
            rank_zero_info("EMA: no EMA state was loaded (no checkpoint, or one without it): scoring the weights")
        self._ensure(trainer, pl_module)
        self.swap_in()

    # ------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self._stashed is not None:
            raise RuntimeError("EMA: a checkpoint was written while the EMA weights were swapped into the experts")

    def state_dict(self) -> dict[str, Any]:
        if self.ema is None:
            return dict(self._loaded) if self._loaded is not None else {}
        trainer = self._trainer
        if trainer is not None and trainer.training and self._stashed is None:
            # A checkpoint written in on_train_batch_end by a callback that ran before this one: the step's
            # weights are final, so its update belongs in the checkpoint (update() will not repeat it).
            self.update(trainer.global_step)
        return {
            "decay": self.decay,
            "every_n_steps": self.every_n_steps,
            "start_step": self.start_step,
            "warmup": self.warmup,
            "components": sorted({key.split(".", 1)[0] for key in self.ema}),
            "last_step": self.last_step,
            "ema": {key: _full_cpu(value) for key, value in self.ema.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        settings = {k: state_dict.get(k) for k in ("decay", "every_n_steps", "start_step", "warmup")}
        current = {"decay": self.decay, "every_n_steps": self.every_n_steps, "start_step": self.start_step}
        current["warmup"] = self.warmup
        if settings != current:
            rank_zero_warn(f"EMA: the checkpoint's EMA was kept with {settings}; this run continues it with {current}")
        if self.ema is None:
            self._loaded = dict(state_dict)
        else:
            self._apply_state(state_dict)

    @torch.no_grad()
    def _apply_state(self, state: dict[str, Any]) -> None:
        assert self.ema is not None
        self.last_step = int(state["last_step"])
        copy_into(self.ema, state["ema"])


def _full_cpu(tensor: Tensor) -> Tensor:
    """A whole (FSDP2: gathered) CPU copy of ``tensor``, as a checkpoint keeps it."""
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return tensor.detach().to("cpu", copy=True)


@torch.no_grad()
def copy_into(targets: dict[str, Tensor], saved: dict[str, Tensor]) -> None:
    """Copy whole tensors ``saved`` into ``targets`` by key (a DTensor target takes its own shard of them),
    raising ``ValueError`` when the keys or shapes differ."""
    if set(saved) != set(targets):
        missing, extra = sorted(set(targets) - set(saved)), sorted(set(saved) - set(targets))
        raise ValueError(
            f"EMA: the checkpoint's EMA covers other parameters than this model trains "
            f"(missing {missing[:3]}, unexpected {extra[:3]}): resume with the same experts and LoRA"
        )
    for key, target in targets.items():
        source = saved[key]
        if tuple(source.shape) != tuple(target.shape):
            raise ValueError(
                f"EMA: {key} has shape {tuple(source.shape)} in the checkpoint, {tuple(target.shape)} here"
            )
        if isinstance(target, DTensor):
            local = target.to_local()
            source = distribute_tensor(
                source.to(device=local.device, dtype=local.dtype),
                target.device_mesh,
                target.placements,
                src_data_rank=None,
            )
        target.copy_(source)


def apply_checkpoint_ema(module: Any, checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    """Copy the EMA that ``checkpoint`` holds (the ``EMA`` callback's state) into ``module``'s experts.

    Returns the EMA's settings (``decay``, ``every_n_steps``, ``start_step``, ``warmup``, ``components``,
    ``last_step``), or None when the checkpoint has no EMA; the module's experts must be built.
    """
    state = checkpoint.get("callbacks", {}).get(STATE_KEY)
    if not state or "ema" not in state:
        return None
    experts = module.experts()
    unknown = sorted(set(state["components"]) - set(experts))
    if unknown:
        raise ValueError(f"EMA: the checkpoint's EMA covers experts {unknown} this model does not have")
    params = {f"{name}.{key}": param for name in state["components"] for key, param in experts[name].named_parameters()}
    absent = [key for key in state["ema"] if key not in params]
    if absent:
        raise ValueError(f"EMA: the checkpoint's EMA names parameters this model lacks: {absent[:3]}")
    copy_into({key: params[key] for key in state["ema"]}, state["ema"])
    return {key: value for key, value in state.items() if key != "ema"}
