"""``python -m unirl_pl {fit,validate,predict}``: one LightningCLI for every recipe.

A recipe names its LightningModule and DataModule by ``class_path`` (the RL trainer
:class:`unirl_pl.module.UniRLModule` with :class:`unirl_pl.data.PromptDataModule`, or a pretraining
module), so RL and pretraining run through the same entry point; dotted overrides may skip
``init_args`` (``--model.mode=prompt_only``). Optimizers are per expert, so LightningCLI's
single-optimizer auto-configuration is off. Unknown or mistyped keys are errors.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.strategies import FSDPStrategy

from unirl_pl.checkpoint import AtomicCheckpointIO


class UniRLCLI(LightningCLI):
    """LightningCLI with the project's module and data, and checks Lightning itself does not make."""

    def before_instantiate_classes(self) -> None:
        config = self.config.get(self.subcommand, self.config) if self.subcommand else self.config
        strategy = config.get("trainer", {}).get("strategy")
        name = strategy if isinstance(strategy, str) else getattr(strategy, "class_path", "") or ""
        if "fsdp" in str(name).lower() and "ModelParallel" not in str(name):
            raise ValueError(
                "FSDPStrategy (FSDP1) is not supported: it needs a GPU and Lightning does not support it with "
                "manual optimization. Use FSDP2 instead: trainer.strategy=lightning.pytorch.strategies."
                "ModelParallelStrategy (see recipes/fsdp.yaml)."
            )

    def instantiate_trainer(self, **kwargs: Any):
        trainer = super().instantiate_trainer(**kwargs)
        if isinstance(trainer.strategy, FSDPStrategy):
            raise ValueError("FSDPStrategy (FSDP1) is not supported; use ModelParallelStrategy (FSDP2).")
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            # A crash while writing must leave the previous checkpoint usable; a user-chosen IO is kept.
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        return trainer


def main(args: list[str] | None = None, run: bool = True) -> UniRLCLI:
    """Run the CLI (``args`` as on the command line; None reads ``sys.argv``)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Frozen components (text encoder, VAE) stay in eval mode on purpose; Lightning warns about it.
    warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode")
    # The module builds each experience from the prompt batch in its on_after_batch_transfer, by design.
    warnings.filterwarnings("ignore", message=r"You have overridden `on_after_batch_transfer` in `LightningModule`")
    return UniRLCLI(
        pl.LightningModule,
        pl.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        auto_configure_optimizers=False,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )
