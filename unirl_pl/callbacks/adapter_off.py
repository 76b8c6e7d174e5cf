"""Validate or predict with some experts' adapters switched off: what each expert's training adds."""

from __future__ import annotations

import lightning.pytorch as pl
import torch


class AdapterOff(pl.Callback):
    """Zero the LoRA ``B`` matrices of ``experts`` once the checkpoint has loaded, before validation or
    prediction: that expert then acts as its pretrained base while the others keep what they learned.

    One jointly trained checkpoint, validated three ways (as is, ``experts: [transformer]``, ``experts:
    [llm]``), splits the joint gain into the refiner's share and the generator's share, on the same held-out
    noise. Refused in ``fit``: it would erase what the run learns.

        python -m unirl_pl validate --config recipes/joint.yaml --ckpt_path last \\
            --trainer.callbacks+=unirl_pl.callbacks.AdapterOff --trainer.callbacks.experts=[transformer]

    Args:
        experts: Names of the experts whose adapter is switched off (``llm``, ``transformer``).
    """

    def __init__(self, experts: list[str]) -> None:
        if not experts:
            raise ValueError("AdapterOff needs at least one expert name (llm, transformer)")
        self.experts = list(experts)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            raise ValueError("AdapterOff switches adapters off for validate and predict only, not for fit")

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.switch_off(pl_module)

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.switch_off(pl_module)

    @torch.no_grad()
    def switch_off(self, pl_module: pl.LightningModule) -> int:
        """Zero every LoRA ``B`` of the named experts; returns how many matrices were zeroed."""
        present = pl_module.experts()
        unknown = sorted(set(self.experts) - set(present))
        if unknown:
            raise ValueError(f"AdapterOff: no expert {unknown} in this model (it has {sorted(present)})")
        zeroed = 0
        for name in self.experts:
            for key, param in present[name].named_parameters():
                if "lora_B" in key:
                    param.zero_()
                    zeroed += 1
        if not zeroed:
            raise ValueError(f"AdapterOff: {self.experts} have no LoRA B matrix to zero")
        return zeroed
