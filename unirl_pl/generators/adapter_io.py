"""A family generator's trainable weights in and out: the reference policy (adapter bypassed, or the frozen copy of
a full fine-tune), the LoRA adapter in the format the family's own diffusers pipeline loads, and a fully fine-tuned
transformer written as a whole pipeline folder. Mixed into :class:`~unirl_pl.generators.base.FlowGenerator`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from peft.utils import get_peft_model_state_dict

from unirl_pl.experts.base import adapter_bypassed
from unirl_pl.experts.finetune import copy_pipeline_folder, reference_swapped, require_lora
from unirl_pl.lora import load_lora_file


class AdapterIO:
    """The adapter and reference methods of a ``FlowGenerator`` (which provides ``_require_built``, ``_folder``,
    ``finetune`` and ``pipeline_class``)."""

    finetune: str
    pipeline_class: Any
    _require_built: Any
    _folder: Any

    @contextmanager
    def adapter_disabled(self) -> Iterator[None]:
        """Context in which ``velocity`` is the frozen reference policy: LoRA bypassed, or (full fine-tuning)
        the frozen copy of the initial weights in the transformer's place. Every parameter's
        ``requires_grad`` is the same afterwards; nested use is a no-op inside."""
        model = self._require_built()
        with reference_swapped(self) if self.finetune == "full" else adapter_bypassed(model):
            yield

    def save_adapter(self, path: str) -> None:
        """Write ``path/pytorch_lora_weights.safetensors`` with the family pipeline's own
        ``save_lora_weights`` (``transformer.``-prefixed peft keys plus the LoRA config as metadata, so
        the scaling survives), which ``<FamilyPipeline>.from_pretrained(...).load_lora_weights(path)``
        reads as is."""
        require_lora(self, "save_adapter")
        model = self._require_built()
        self.pipeline_class.save_lora_weights(
            path,
            transformer_lora_layers=get_peft_model_state_dict(model),
            transformer_lora_adapter_metadata=model.peft_config["default"].to_dict(),
        )

    def load_adapter(self, path: str) -> None:
        """Load LoRA weights written by ``save_adapter`` (a folder or the file) into the adapter in
        place, raising ``ValueError`` when they do not match this model's adapter."""
        require_lora(self, "load_adapter")
        load_lora_file(self._require_built(), path, self.pipeline_class.transformer_name)

    def save_model(self, path: str) -> None:
        """Write the fully fine-tuned generator as a pipeline folder ``DiffusionPipeline.from_pretrained`` loads:
        ``pipeline_path``'s components (hard-linked where possible) with the trained transformer (float32, as
        trained; load with ``torch_dtype`` to cast) in place of the base one."""
        model = self._require_built()
        copy_pipeline_folder(self._folder(), path, skip=("transformer",))
        model.save_pretrained(str(Path(path) / "transformer"))
