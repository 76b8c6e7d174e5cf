"""What a plan needs from a recipe: the configuration ``fit`` would run with, reduced to the generator, the
refiner, the rollout, the losses, the optimizers, the step's sizes and the strategy.

The recipe is parsed by the CLI's own parser (:func:`unirl_pl.cli.parse_config`): the same ``--config`` files
and dotted overrides (later wins), a key or a type ``fit`` would reject rejected in ``fit``'s words, and every
key a recipe leaves out at its constructor's default, so no default is written here. What is read keeps its
``fit`` type: the rollout settings become a :class:`~unirl_pl.loops.RolloutConfig`, the loss settings an
:class:`~unirl_pl.method.ExpertLoss`, the algorithms and optimizers the classes the recipe names.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from unirl_pl.card import Role
from unirl_pl.cli import parse_config
from unirl_pl.layout import GroupLayout, check_prompt_counts
from unirl_pl.loops import RolloutConfig
from unirl_pl.method import ExpertLoss
from unirl_pl.rewards.base import reward_name

# What ``model.transformer_optimizer`` / ``model.llm_optimizer`` is once parsed: the module's default (a
# function of the parameters) or the class a recipe names with its init_args bound.
OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


class RecipeError(ValueError):
    """A recipe the plan cannot read, worded for the user (the CLI prints it on one line)."""


def parsed_recipe(args: list[str]) -> dict[str, Any]:
    """The configuration ``fit`` builds from ``args`` (``--config`` files and dotted overrides, as on its command
    line), defaults filled, as plain mappings; :class:`~unirl_pl.errors.ConfigError` when ``fit`` would refuse it."""
    return parse_config(args).as_dict()


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
        generator_args: Its ``init_args``, every one of them (without ``pipeline_path``).
        pipeline_path: The recipe's pipeline folder or hub id, if any.
        llm_args: The refiner's ``init_args``, every one of them (None: no refiner).
        llm_class: The refiner's class (a ``CausalLMExpert`` kind: the causal LM or the VLM refiner; None: no
            refiner).
        rollout: The rollout settings.
        mode: ``joint``, ``prompt_only`` or ``generator_only``.
        transformer_loss: The DiT's loss settings.
        llm_loss: The refiner's loss settings.
        transformer_optimizer: Builds the DiT's optimizer from its trained parameters.
        llm_optimizer: Builds the refiner's optimizer from its trained parameters.
        generator_algorithm: How the DiT learns (``model.generator_algorithm``).
        llm_algorithm: How the refiner learns (``model.llm_algorithm``).
        prompts_per_step: Prompts per step over all ranks.
        layout: Samples per prompt, unrefined samples, images per refinement.
        devices: Ranks (``trainer.devices``, or ``--devices``).
        fsdp: Whether the strategy shards the trained experts (``ModelParallelStrategy``).
        reshard_after_forward: FSDP2's choice after each block's forward.
        rewards: The reward terms by name with their arguments (``model.reward_args`` in the short form, a
            component's ``init_args``).
        reward_paths: The class path of each term given as a component (short-form names resolve by registry).
        edits: Whether the step edits: the generator takes source images and the training prompts hold them (see
            :func:`recipe_edits`), so every DiT forward also carries a source image's tokens.
    """

    generator_class: type
    generator_args: dict[str, Any]
    pipeline_path: str | None
    llm_args: dict[str, Any] | None
    rollout: RolloutConfig
    mode: str
    transformer_loss: ExpertLoss
    llm_loss: ExpertLoss
    transformer_optimizer: OptimizerFactory
    llm_optimizer: OptimizerFactory
    generator_algorithm: Any
    llm_algorithm: Any
    prompts_per_step: int
    layout: GroupLayout
    devices: int
    fsdp: bool
    reshard_after_forward: bool
    rewards: dict[str, dict[str, Any]] = field(default_factory=dict)
    reward_paths: dict[str, str] = field(default_factory=dict)
    llm_class: type | None = None
    edits: bool = False

    @property
    def gradient_checkpointing(self) -> bool:
        """The recipe's own ``model.generator.init_args.gradient_checkpointing``."""
        return bool(self.generator_args["gradient_checkpointing"])


def _optimizer(node: Any) -> OptimizerFactory:
    """The optimizer ``model.*_optimizer`` builds: the module's default function as parsed, or the named class."""
    if callable(node):
        return node
    return functools.partial(import_class(node["class_path"]), **_args(node))


def _build(factory: Callable[..., Any], args: dict[str, Any], key: str) -> Any:
    try:
        return factory(**args)
    except (TypeError, ValueError) as err:
        raise RecipeError(f"{key}: {err}") from None


def _ranks(devices: Any) -> int:
    """The ranks ``trainer.devices`` (or ``--devices``) gives a plan."""
    if devices == "auto":
        # Lightning's default: every device of the machine, which a plan made without the GPUs cannot count. One
        # rank, as Lightning would give a one-GPU machine; --devices plans another count.
        return 1
    if isinstance(devices, str) and devices.isdigit():
        devices = int(devices)
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise RecipeError(f"trainer.devices must be a positive number of ranks for a plan, got {devices!r}")
    return devices


def step_recipe(config: dict[str, Any], devices: int | None = None) -> StepRecipe:
    """Read a parsed recipe (:func:`parsed_recipe`) into a :class:`StepRecipe`; ``devices`` overrides
    ``trainer.devices``."""
    from unirl_pl.experts import TinyCausalLMExpert
    from unirl_pl.generators import FlowGenerator

    model, data, trainer = _args(config["model"]), _args(config["data"]), config["trainer"]
    if "generator" not in model:
        raise RecipeError(
            f"model: plan reads the RL module's settings (UniRLModule), not {config['model']['class_path']}'s"
        )
    generator = model["generator"]
    generator_class = import_class(generator["class_path"])
    if not (isinstance(generator_class, type) and issubclass(generator_class, FlowGenerator)):
        raise RecipeError(
            "model.generator: plan needs a family generator (class_path SD3Generator, FluxGenerator, "
            f"Flux2KleinGenerator or WanGenerator); {generator['class_path']} is built part by part and has no "
            "real-size config"
        )
    generator_args = _args(generator)
    pipeline_path = model["pipeline_path"] or generator_args.pop("pipeline_path", None)
    generator_args.pop("pipeline_path", None)
    llm = model[Role.REFINER]
    if llm is not None and issubclass(import_class(llm["class_path"]), TinyCausalLMExpert):
        raise RecipeError(
            "model.llm: plan needs a pretrained refiner (CausalLMExpert and its pretrained_path) or null; "
            f"{llm['class_path']} builds a test-bed LM of its own"
        )
    layout_keys = ("samples_per_prompt", "num_skip_refinement", "images_per_refinement")
    layout = _build(GroupLayout, {name: data[name] for name in layout_keys}, "data")
    strategy = trainer["strategy"]
    strategy_name = strategy if isinstance(strategy, str) else strategy.get("class_path", "")
    world = _ranks(devices if devices is not None else trainer["devices"])
    # The data module's own check, so a count fit refuses is refused here too (not an IndexError mid-trace).
    counts = ("prompts_per_step", "val_batch_size", "val_images_per_prompt")
    _build(check_prompt_counts, {name: data[name] for name in counts}, "data")
    prompts = data["prompts_per_step"]
    if prompts % world:
        raise RecipeError(f"data.prompts_per_step ({prompts}) must be divisible by the {world} ranks")
    return StepRecipe(
        generator_class=generator_class,
        generator_args=generator_args,
        pipeline_path=pipeline_path,
        llm_args=None if llm is None else _args(llm),
        llm_class=None if llm is None else import_class(llm["class_path"]),
        rollout=_build(RolloutConfig, model["rollout"], "model.rollout"),
        mode=model["mode"],
        transformer_loss=_build(ExpertLoss, model["transformer_loss"], "model.transformer_loss"),
        llm_loss=_build(ExpertLoss, model["llm_loss"], "model.llm_loss"),
        transformer_optimizer=_optimizer(model["transformer_optimizer"]),
        llm_optimizer=_optimizer(model["llm_optimizer"]),
        generator_algorithm=_algorithm(model["generator_algorithm"], "model.generator_algorithm"),
        llm_algorithm=_algorithm(model["llm_algorithm"], "model.llm_algorithm"),
        prompts_per_step=prompts,
        layout=layout,
        devices=world,
        fsdp="ModelParallelStrategy" in str(strategy_name),
        reshard_after_forward=bool(model["reshard_after_forward"]),
        edits=recipe_edits(generator_class, data["prompts"]),
        **_rewards(model),
    )


EDIT_FIRST_FAMILIES = ("FluxKontextGenerator", "QwenImageEditPlusGenerator")
"""Editing models a plan counts with their source images when it cannot read the recipe's prompt file here (a
family that also generates from text alone, FLUX.2 [klein], is then planned without)."""


def recipe_edits(generator_class: type, prompts: Any) -> bool:
    """Whether a step of this recipe carries source images: the generator takes them (``takes_source_images``)
    and the training prompt file names them (``image`` in its rows, as the data module reads it). A prompt file
    that is not here (a path on the training machine) counts as editing for the models in
    :data:`EDIT_FIRST_FAMILIES` only."""
    from unirl_pl.data import load_prompt_records

    if not getattr(generator_class, "takes_source_images", False):
        return False
    if not isinstance(prompts, str):
        return False  # inline prompts or the embedded set: text only
    try:
        _, rows = load_prompt_records(prompts)
    except (OSError, ValueError):
        return generator_class.__name__ in EDIT_FIRST_FAMILIES
    return any(row is not None and "image" in row for row in rows or [])


def _algorithm(node: dict[str, Any], key: str) -> Any:
    """The algorithm a recipe names (``class_path`` and ``init_args``; the module's default when it names none)."""
    return _build(import_class(node["class_path"]), _args(node), key)


def _rewards(model: dict[str, Any]) -> dict[str, Any]:
    """``rewards`` (each term's name -> its arguments) and ``reward_paths`` (name -> class path, for the terms given
    as components; the short form's names resolve through the registry)."""
    terms = model.get("rewards") or {}
    if isinstance(terms, dict):
        args = model.get("reward_args") or {}
        if not isinstance(args, dict):
            raise RecipeError("model.reward_args must be a mapping of reward names")
        return {"rewards": {str(name): dict(args.get(name) or {}) for name in terms}, "reward_paths": {}}
    rewards: dict[str, dict[str, Any]] = {}
    paths: dict[str, str] = {}
    for term in terms:
        reward = term["reward"]
        path = reward["class_path"]
        name = reward_name(import_class(path), term.get("name"))
        rewards[name], paths[name] = dict(reward.get("init_args") or {}), path
    return {"rewards": rewards, "reward_paths": paths}
