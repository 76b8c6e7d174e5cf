"""What a plan needs from a recipe: the same YAML files ``fit`` reads (later files and dotted overrides
win, as with LightningCLI), reduced to the generator, the refiner, the rollout, the losses, the
optimizers, the step's sizes and the strategy. Keys keep their ``fit`` meaning and types: the rollout
settings become a :class:`~unirl_pl.loops.RolloutConfig` and the loss settings an
:class:`~unirl_pl.method.ExpertLoss`, so a key ``fit`` would reject is rejected here too."""

from __future__ import annotations

import copy
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from unirl_pl.algorithms import FlowGRPO, TokenGRPO
from unirl_pl.layout import GroupLayout, check_prompt_counts
from unirl_pl.loops import RolloutConfig
from unirl_pl.method import ExpertLoss


class RecipeError(ValueError):
    """A recipe the plan cannot read, worded for the user (the CLI prints it on one line)."""


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``extra`` merged into a copy of ``base``: mappings merge key by key, anything else replaces."""
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def read_recipes(paths: list[str]) -> dict[str, Any]:
    """The merged YAML of ``paths`` (later files win), raising :class:`RecipeError` naming a missing or
    unreadable file."""
    config: dict[str, Any] = {}
    for path in paths:
        file = Path(path)
        if not file.is_file():
            raise RecipeError(f"--config {path}: no such file")
        try:
            loaded = yaml.safe_load(file.read_text()) or {}
        except yaml.YAMLError as err:
            raise RecipeError(f"{path}: not valid YAML ({getattr(err, 'problem', None) or err})") from None
        if not isinstance(loaded, dict):
            raise RecipeError(f"{path}: a recipe is a YAML mapping, got {type(loaded).__name__}")
        config = merge(config, loaded)
    return config


def apply_override(config: dict[str, Any], key: str, value: str) -> None:
    """Set dotted ``key`` (``model.rollout.micro_batch_size``) to the YAML value ``value`` in place; as on
    the ``fit`` command line, a level's ``init_args`` may be skipped."""
    node = config
    parts = key.split(".")
    for part in parts[:-1]:
        if part not in node and isinstance(node.get("init_args"), dict):
            node = node["init_args"]
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise RecipeError(f"--{key}: {part} is not a mapping in the recipe")
    if parts[-1] not in node and isinstance(node.get("init_args"), dict):
        node = node["init_args"]
    node[parts[-1]] = yaml.safe_load(value)


def _args(node: Any) -> dict[str, Any]:
    """The ``init_args`` of a ``class_path`` node (or the node itself when it has none)."""
    if not isinstance(node, dict):
        return {}
    return dict(node.get("init_args", {k: v for k, v in node.items() if k != "class_path"}) or {})


def import_class(path: str) -> type:
    """The class named by a dotted ``class_path``; :class:`RecipeError` when it does not import."""
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        raise RecipeError(f"class_path {path!r} does not name an importable class") from None


@dataclass(frozen=True)
class StepRecipe:
    """The parts of a recipe that set one RL step's memory.

    Args:
        generator_class: The generator's class (a ``FlowGenerator`` family).
        generator_args: Its ``init_args`` (without ``pipeline_path``).
        pipeline_path: The recipe's pipeline folder or hub id, if any.
        llm_args: The refiner's ``init_args`` (None: no refiner).
        rollout: The rollout settings.
        mode: ``joint``, ``prompt_only`` or ``generator_only``.
        transformer_loss: The DiT's loss settings.
        llm_loss: The refiner's loss settings.
        transformer_optimizer: The DiT optimizer's (class, init_args).
        llm_optimizer: The refiner optimizer's (class, init_args).
        generator_algorithm: How the DiT learns (``model.generator_algorithm``; FlowGRPO by default).
        llm_algorithm: How the refiner learns (``model.llm_algorithm``; TokenGRPO by default).
        prompts_per_step: Prompts per step over all ranks.
        layout: Samples per prompt, unrefined samples, images per refinement.
        devices: Ranks (``trainer.devices``, or ``--devices``).
        fsdp: Whether the strategy shards the trained experts (``ModelParallelStrategy``).
        reshard_after_forward: FSDP2's choice after each block's forward.
        rewards: The reward terms (``model.rewards``' names) with their ``model.reward_args``.
    """

    generator_class: type
    generator_args: dict[str, Any]
    pipeline_path: str | None
    llm_args: dict[str, Any] | None
    rollout: RolloutConfig
    mode: str
    transformer_loss: ExpertLoss
    llm_loss: ExpertLoss
    transformer_optimizer: tuple[type, dict[str, Any]]
    llm_optimizer: tuple[type, dict[str, Any]]
    generator_algorithm: Any
    llm_algorithm: Any
    prompts_per_step: int
    layout: GroupLayout
    devices: int
    fsdp: bool
    reshard_after_forward: bool
    rewards: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def gradient_checkpointing(self) -> bool:
        """The recipe's own ``model.generator.init_args.gradient_checkpointing``."""
        return bool(self.generator_args.get("gradient_checkpointing", False))


def _optimizer(node: Any, default_lr: float) -> tuple[type, dict[str, Any]]:
    if not isinstance(node, dict) or "class_path" not in node:
        import torch

        return torch.optim.AdamW, {"lr": default_lr}
    return import_class(node["class_path"]), _args(node)


def _algorithm(node: Any, default: type, key: str) -> Any:
    """The algorithm a recipe names (``class_path`` and ``init_args``), or ``default()``."""
    if not isinstance(node, dict) or "class_path" not in node:
        return default()
    return _build(import_class(node["class_path"]), _args(node), key)


def _build(factory: Callable[..., Any], args: dict[str, Any], key: str) -> Any:
    try:
        return factory(**args)
    except (TypeError, ValueError) as err:
        raise RecipeError(f"{key}: {err}") from None


def step_recipe(config: dict[str, Any], devices: int | None = None) -> StepRecipe:
    """Read a merged recipe into a :class:`StepRecipe`; ``devices`` overrides ``trainer.devices``."""
    model = _args(config.get("model"))
    data = _args(config.get("data"))
    trainer = config.get("trainer") or {}
    generator = model.get("generator")
    if not isinstance(generator, dict) or "class_path" not in generator:
        raise RecipeError(
            "model.generator: plan needs a family generator (class_path SD3Generator, FluxGenerator or "
            "WanGenerator); the default ComponentGenerator is built part by part and has no real-size config"
        )
    from unirl_pl.generators import FlowGenerator

    generator_class = import_class(generator["class_path"])
    if not (isinstance(generator_class, type) and issubclass(generator_class, FlowGenerator)):
        raise RecipeError(f"model.generator: {generator['class_path']} is not a FlowGenerator family")
    generator_args = _args(generator)
    pipeline_path = model.get("pipeline_path") or generator_args.pop("pipeline_path", None)
    generator_args.pop("pipeline_path", None)
    llm = model.get("llm", {}) if "llm" in model else {}
    llm_args = None if llm is None else _args(llm)
    layout = _build(
        GroupLayout,
        {
            "samples_per_prompt": data.get("samples_per_prompt", 4),
            "num_skip_refinement": data.get("num_skip_refinement", 1),
            "images_per_refinement": data.get("images_per_refinement", 1),
        },
        "data",
    )
    strategy = trainer.get("strategy")
    strategy_name = strategy if isinstance(strategy, str) else (strategy or {}).get("class_path", "")
    world = devices if devices is not None else trainer.get("devices", 1)
    if not isinstance(world, int) or world < 1:
        raise RecipeError(f"trainer.devices must be a positive number of ranks for a plan, got {world!r}")
    # The data module's own check, so a count fit refuses is refused here too (not an IndexError mid-trace).
    counts = ("prompts_per_step", "val_batch_size", "val_images_per_prompt")
    _build(check_prompt_counts, {name: data[name] for name in counts if name in data}, "data")
    prompts = data.get("prompts_per_step", 4)
    if prompts % world:
        raise RecipeError(f"data.prompts_per_step ({prompts}) must be divisible by the {world} ranks")
    return StepRecipe(
        generator_class=generator_class,
        generator_args=generator_args,
        pipeline_path=pipeline_path,
        llm_args=llm_args,
        rollout=_build(RolloutConfig, {**(model.get("rollout") or {})}, "model.rollout"),
        mode=model.get("mode", "joint"),
        transformer_loss=_build(
            ExpertLoss, model.get("transformer_loss") or {"clip_eps": 1e-4, "beta": 0.004}, "model.transformer_loss"
        ),
        llm_loss=_build(ExpertLoss, model.get("llm_loss") or {}, "model.llm_loss"),
        transformer_optimizer=_optimizer(model.get("transformer_optimizer"), 3e-4),
        llm_optimizer=_optimizer(model.get("llm_optimizer"), 1e-3),
        generator_algorithm=_algorithm(model.get("generator_algorithm"), FlowGRPO, "model.generator_algorithm"),
        llm_algorithm=_algorithm(model.get("llm_algorithm"), TokenGRPO, "model.llm_algorithm"),
        prompts_per_step=prompts,
        layout=layout,
        devices=world,
        fsdp="ModelParallelStrategy" in str(strategy_name),
        reshard_after_forward=bool(model.get("reshard_after_forward", True)),
        rewards=_rewards(model),
    )


def _rewards(model: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``model.rewards``' names, each with its ``model.reward_args`` (empty when it takes none)."""
    weights = model.get("rewards") or {}
    args = model.get("reward_args") or {}
    if not isinstance(weights, dict) or not isinstance(args, dict):
        raise RecipeError("model.rewards and model.reward_args must be mappings of reward names")
    return {str(name): dict(args.get(name) or {}) for name in weights}
