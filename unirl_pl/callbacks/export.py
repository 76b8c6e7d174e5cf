"""``AdapterExport``: write the trained adapters in peft / diffusers format when ``fit`` ends."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl

from unirl_pl.adapters import export_adapters


class AdapterExport(pl.Callback):
    """At the end of ``fit``, write ``<output_dir>/llm`` (peft) and ``<output_dir>/transformer`` (diffusers LoRA).

    Only global rank 0 writes, because every rank holds the same replicated adapter under DDP. Under
    FSDP2 the adapters are sharded DTensors; export from a checkpoint with ``python -m unirl_pl.export``.

    Args:
        output_dir: Folder that receives the two adapter folders (created if missing).
    """

    def __init__(self, output_dir: str) -> None:
        self.output_dir = Path(output_dir)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            export_adapters(pl_module, self.output_dir)
        trainer.strategy.barrier("adapter_export")
