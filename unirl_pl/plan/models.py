"""The recipe's experts at real size without their weights: modules built from ``config.json`` files on
the meta device, LoRA attached with the project's own settings, then every parameter and buffer replaced
by a fake tensor (``FakeTensorMode``), so forward and backward passes run as shapes only.

Configs come from a local folder (a diffusers pipeline folder with ``model_index.json``, or a causal LM
folder with ``config.json``) or from the configs shipped under ``unirl_pl/assets/configs`` (the public
checkpoints' ``config.json`` files, no weights; ``README.md`` there names their sources).
"""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from diffusers import ModelMixin
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import AutoConfig, BatchEncoding, PreTrainedModel

from unirl_pl.experts import CausalLMExpert
from unirl_pl.generators import FlowGenerator
from unirl_pl.generators.folder import has_component, read_model_index
from unirl_pl.manifest import ASSETS, verify_assets

SHIPPED = ASSETS / "configs"
"""Config-only copies of public checkpoints (one folder per checkpoint, named as on the hub)."""

DEFAULT_PIPELINES: dict[str, str] = {
    "SD3Generator": "stable-diffusion-3.5-medium",
    "FluxGenerator": "FLUX.1-dev",
    "FluxKontextGenerator": "FLUX.1-Kontext-dev",
    "Flux2KleinGenerator": "FLUX.2-klein-base-4B",
    "WanGenerator": "Wan2.1-T2V-1.3B-Diffusers",
    "QwenImageGenerator": "Qwen-Image",
    "QwenImageEditPlusGenerator": "Qwen-Image-Edit-2509",
    "ZImageGenerator": "Z-Image",
}
"""The shipped pipeline a family's recipe is planned with when no folder is given."""


def shipped_configs() -> list[str]:
    """Names of the shipped config folders."""
    return sorted(p.name for p in SHIPPED.iterdir() if p.is_dir())


def resolve_folder(
    given: str | None,
    recipe: str | None,
    default: str | None,
    what: str,
    settings: tuple[str, str] = ("--pipeline-path", "model.pipeline_path"),
) -> Path:
    """The config folder of a model. ``given`` (a command-line path) must be a local folder or a shipped
    config's name. The recipe's path may be a hub id or a folder of another machine: it is used when it
    is a local folder or names a shipped config by its last component (``Qwen/Qwen2.5-1.5B-Instruct`` is
    the shipped ``Qwen2.5-1.5B-Instruct``). The shipped ``default`` stands in only when neither path is set:
    a path that is set and matches nothing is refused, not planned from another model's config. Raises
    ``FileNotFoundError`` naming the setting (``settings``: the command line's and the recipe's) and the path,
    and listing the shipped configs."""
    candidate, setting = (given, settings[0]) if given else (recipe, settings[1]) if recipe else (default, "")
    if candidate:
        local = Path(candidate).expanduser()
        if local.is_dir():
            return local
        for name in (candidate, local.name):
            if (SHIPPED / name).is_dir():
                verify_assets(SHIPPED / name)
                return SHIPPED / name
    where = f"{setting}={candidate!r} is not a local folder nor a shipped config's name" if setting else "none set"
    raise FileNotFoundError(
        f"no {what} config: {where}; give a local folder (its config.json files are enough) or one of the shipped "
        f"configs: {', '.join(shipped_configs())}"
    )


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build modules in ``dtype`` (as ``from_pretrained(torch_dtype=...)`` does), restoring the default after."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _keep_fp32(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Upcast the parameters ``from_pretrained`` would keep in float32 at ``dtype``: diffusers' models keep
    ``_keep_in_fp32_modules`` at any lower precision, transformers' keep ``_keep_in_fp32_modules_strict``
    at bf16/fp16 and ``_keep_in_fp32_modules`` at fp16 only."""
    if dtype == torch.float32:
        return
    if isinstance(model, ModelMixin):
        names = set(model._keep_in_fp32_modules or [])
    else:
        names = set(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
        if dtype == torch.float16:
            names |= set(getattr(model, "_keep_in_fp32_modules", None) or [])
    if not names:
        return
    for name, param in model.named_parameters():
        if param.is_floating_point() and names & set(name.split(".")):
            param.data = param.data.float()


def meta_model(cls: type, folder: Path, dtype: torch.dtype) -> torch.nn.Module:
    """An instance of ``cls`` (a diffusers ``ModelMixin`` or a transformers ``PreTrainedModel``) built from
    ``folder/config.json`` on the meta device in ``dtype``; frozen and in eval mode."""
    with torch.device("meta"), default_dtype(dtype):
        if issubclass(cls, ModelMixin):
            model = cls.from_config(cls.load_config(str(folder)))
        elif issubclass(cls, PreTrainedModel):
            model = cls(cls.config_class.from_pretrained(str(folder)))
        else:
            raise TypeError(f"{cls.__name__} in {folder} is neither a diffusers nor a transformers model")
    _keep_fp32(model, dtype)
    model.requires_grad_(False)
    return model.eval()


def to_fake(modules: list[torch.nn.Module], mode: FakeTensorMode) -> None:
    """Replace every parameter and buffer of ``modules`` by a fake CPU tensor of the same shape, dtype and
    ``requires_grad``, in place, and every meta tensor a module holds as a plain attribute by a fake one. A tensor
    shared by several modules (tied embeddings) stays shared."""
    seen: dict[int, torch.Tensor] = {}
    with mode:
        for module in modules:
            for sub in module.modules():
                for table, is_param in ((sub._parameters, True), (sub._buffers, False)):
                    for name, tensor in list(table.items()):
                        if tensor is None:
                            continue
                        if id(tensor) not in seen:
                            fake = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
                            seen[id(tensor)] = torch.nn.Parameter(fake, tensor.requires_grad) if is_param else fake
                        table[name] = seen[id(tensor)]
                # Tables a module keeps as plain tensor attributes, built on the meta device with it (Qwen-Image's
                # complex RoPE tables, kept out of the buffers so a dtype cast cannot drop their imaginary part).
                for name, tensor in list(vars(sub).items()):
                    if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                        setattr(sub, name, torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu"))


class LengthTokenizer:
    """Stands in for a pipeline's tokenizer: every text becomes ``max_length`` token ids, which is all the
    memory of a text encoder depends on (the pipelines pad to a fixed length). Call it inside the fake mode.
    A chat template (FLUX.2 [klein]'s Qwen3 prompt) leaves the text as it is: the padding fixes the length."""

    model_max_length = 1 << 30  # the encoder's own limit (CLIP: 77 positions) applies

    def __call__(self, texts: str | list[str], max_length: int | None = None, **_: Any) -> BatchEncoding:
        rows = [texts] if isinstance(texts, str) else texts
        ids = torch.ones(len(rows), int(max_length or 1), dtype=torch.long)
        # Both spellings the pipelines read: ``.input_ids`` and ``["input_ids"]``.
        return BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids)})

    def apply_chat_template(self, messages: list[dict[str, str]], **_: Any) -> str:
        """The last message's text: the template's tokens would be padded away to the same length."""
        return messages[-1]["content"]


def _component_class(entry: list[Any]) -> type:
    library, name = entry
    return getattr(importlib.import_module(library), name)


@dataclass
class FakeExperts:
    """The built experts of one recipe: fake for a plan (or real, loaded by their own ``build()``, to
    check a plan against real tensors).

    Args:
        generator: The recipe's generator with its modules (``model``, ``vae``, text encoders).
        llm: The refiner with its LoRA-wrapped LM, or None.
        mode: The fake mode every phase runs in (None for real experts).
        pipeline_folder: Where the generator's configs came from.
        llm_folder: Where the LM's config came from.
        resident: Further models kept in memory but not traced (Wan2.2's second expert when the
            generator does not hold it).
        reward_models: The reward terms' models on the device (PickScore's CLIP; see
            :mod:`unirl_pl.plan.rewards`), frozen and resident through the whole step.
    """

    generator: FlowGenerator
    llm: CausalLMExpert | None
    mode: FakeTensorMode | None
    pipeline_folder: Path
    llm_folder: Path | None
    resident: list[torch.nn.Module] = field(default_factory=list)
    reward_models: list[torch.nn.Module] = field(default_factory=list)

    def modules(self) -> list[torch.nn.Module]:
        """Every model on the device: the generator (and what it holds), the LM, the extra residents, the
        reward models."""
        llm = [self.llm] if self.llm is not None else []
        return [self.generator, *llm, *self.resident, *self.reward_models]

    def transformers(self) -> list[torch.nn.Module]:
        """The generator's LoRA-adapted transformers (Wan2.2 A14B: both experts)."""
        models = list(getattr(self.generator, "transformers", None) or [self.generator.model])
        return models + [m for m in self.resident if m not in models]


def build_generator(
    cls: type[FlowGenerator], init_args: dict[str, Any], folder: Path, mode: FakeTensorMode
) -> tuple[FlowGenerator, list[torch.nn.Module]]:
    """The family generator ``cls(**init_args)`` over ``folder`` with every component built fake.

    Components come from ``model_index.json`` as diffusers names them (``transformer``, ``vae``,
    ``text_encoder*``; the tokenizers become :class:`LengthTokenizer`), set on the generator under those
    names; the transformer is made trainable by the generator's own ``_adapt`` (its LoRA, or with
    ``finetune: full`` every weight in float32 beside a frozen copy, both counted) and gets gradient
    checkpointing and the VAE its slicing/tiling, as ``build()`` does. A second transformer
    (``transformer_2``, Wan2.2 A14B) gets the same LoRA and is returned as an extra resident model.
    Returns (generator, extras).
    """
    generator = cls(**{**init_args, "pipeline_path": str(folder)})
    index = read_model_index(folder)
    generator.latent_shape  # noqa: B018 - checks height/width/frames against the folder's configs
    names = [name for name in inspect.signature(cls.pipeline_class.__init__).parameters if name != "self"]
    built: dict[str, torch.nn.Module] = {}
    for name in names:
        if name.startswith("tokenizer"):
            setattr(generator, name, LengthTokenizer() if has_component(index, name) else None)
        elif name.startswith("text_encoder"):
            module = None
            if has_component(index, name):
                module = built[name] = meta_model(_component_class(index[name]), folder / name, generator.dtype)
            setattr(generator, name, module)
    # Parts without weights the family builds itself (Qwen-Image-Edit-Plus's image processors, from their config).
    load_processors = getattr(generator, "_load_processors", None)
    if load_processors is not None:
        load_processors()
    vae = built["vae"] = meta_model(_component_class(index["vae"]), folder / "vae", generator.vae_dtype)
    if getattr(generator, "vae_slicing", False):
        vae.enable_slicing()
    if getattr(generator, "vae_tiling", False):
        vae.enable_tiling()
    generator.vae = vae
    experts = [n for n in ("transformer", "transformer_2") if has_component(index, n)]
    if len(experts) > 1 and generator.finetune == "full":
        raise ValueError(f"{cls.__name__}.finetune 'full' is not supported for two-expert folders; use 'lora'")
    models = []
    for name in experts:
        model = meta_model(_component_class(index[name]), folder / name, generator.dtype)
        with torch.device("meta"):
            model = generator._adapt(model)
        if generator.gradient_checkpointing:
            model.enable_gradient_checkpointing()
        models.append(model)
    # The traced expert is the largest; Wan2.2's two experts have one shape. The other stays resident with
    # its LoRA (its weights, gradients and optimizer state count) but outside the generator, so every
    # traced forward runs one known expert instead of routing rows by sigma, which needs sigma's values.
    models.sort(key=lambda m: -sum(p.numel() for p in m.parameters()))
    generator.model, extras = models[0], models[1:]
    to_fake([generator, *extras], mode)
    return generator, extras


def build_llm(
    init_args: dict[str, Any], folder: Path, mode: FakeTensorMode, cls: type[CausalLMExpert] | None = None
) -> CausalLMExpert:
    """The refiner ``cls(**init_args)`` (``CausalLMExpert`` by default) with a fake LM from ``folder/config.json``
    through the expert's own Auto class, made trainable by its own ``_adapt`` (its LoRA, the LoRA in float32 as
    peft keeps it; or with ``finetune: full`` every weight in float32 beside a frozen copy), in the expert's dtype."""
    expert = (cls or CausalLMExpert)(**{**init_args, "pretrained_path": str(folder)})
    config = AutoConfig.from_pretrained(str(folder))
    with torch.device("meta"), default_dtype(expert.dtype):
        base = expert.auto_model_class.from_config(config)
    _keep_fp32(base, expert.dtype)
    with torch.device("meta"):
        expert.model = expert._adapt(base)
    to_fake([expert], mode)
    return expert


def real_experts(
    cls: type[FlowGenerator],
    init_args: dict[str, Any],
    folder: Path,
    llm_args: dict[str, Any] | None,
    llm_folder: Path | None,
    llm_class: type[CausalLMExpert] | None = None,
) -> FakeExperts:
    """The same experts loaded with weights by their own ``build()`` (small folders only): what a plan's
    fake experts are checked against."""
    generator = cls(**{**init_args, "pipeline_path": str(folder)})
    generator.build()
    llm = None
    if llm_args is not None and llm_folder is not None:
        llm = (llm_class or CausalLMExpert)(**{**llm_args, "pretrained_path": str(llm_folder)})
        llm.build()
    return FakeExperts(generator, llm, None, folder, llm_folder)


def config_summary(folder: Path) -> str:
    """One line naming a config folder (shipped configs by name, local folders by path)."""
    return folder.name if folder.is_relative_to(SHIPPED) else str(folder)


def read_json(path: Path) -> dict[str, Any]:
    """A JSON file as a dict."""
    return json.loads(path.read_text())
