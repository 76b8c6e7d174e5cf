"""``python -m unirl_pl {fit,validate,predict}``: LightningCLI over :class:`UniRLModule` and :class:`PromptDataModule`.

Optimizers are per expert (``model.llm_optimizer``, ``model.transformer_optimizer``), so
LightningCLI's single-optimizer auto-configuration is off. Unknown or mistyped keys are errors.
"""

from __future__ import annotations

import os
from typing import Any

from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import FSDPStrategy

from unirl_pl.data import PromptDataModule
from unirl_pl.module import UniRLModule


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
        return trainer


def main(args: list[str] | None = None, run: bool = True) -> UniRLCLI:
    """Run the CLI (``args`` as on the command line; None reads ``sys.argv``)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return UniRLCLI(
        UniRLModule,
        PromptDataModule,
        auto_configure_optimizers=False,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )
