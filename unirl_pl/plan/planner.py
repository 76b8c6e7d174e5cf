"""Trace one RL step of a recipe's real-size experts on fake tensors and find the micro-batch that fits.

The step's phases (:mod:`unirl_pl.plan.phases`) each run under :class:`~unirl_pl.plan.tracker.PlanMemTracker`
with what stays on the device in a running fit tracked alongside: every model's weights, the trained
experts' LoRA gradients and optimizer state (steady state: the previous step's gradients live until the
next ``training_step`` clears them), and the experience that phase of the step holds (see
:func:`~unirl_pl.plan.step.experience`). A phase's peak is therefore the device's peak while it runs.

Under an FSDP2 recipe (``ModelParallelStrategy``) the experts are sharded by the project's own
``distributed.shard_experts`` over a fake process group of ``devices`` ranks (no communication: the
collectives return fake tensors of the right shapes), so the traces hold one rank's shards, its
all-gathered blocks and its reduce-scatter buffers.

The micro-batch search is :mod:`unirl_pl.plan.search`; the step's sizes, resident experience and
training order are :mod:`unirl_pl.plan.step`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from unirl_pl.card import Card, Loop, Role
from unirl_pl.distributed import shard_experts
from unirl_pl.plan import phases
from unirl_pl.plan.models import (
    DEFAULT_PIPELINES,
    FakeExperts,
    build_generator,
    build_llm,
    config_summary,
    real_experts,
    resolve_folder,
)
from unirl_pl.plan.optimizers import StepOptimizer
from unirl_pl.plan.recipe import StepRecipe
from unirl_pl.plan.rewards import PlannedReward, planned_rewards, reward_models, score
from unirl_pl.plan.search import Candidate, MicroBatchSearch
from unirl_pl.plan.step import PHASE_NOTES, PHASES, StepSizes, Tracer, experience, step_sizes, train_step
from unirl_pl.plan.tracker import AllRowsReal

__all__ = ["PHASES", "PHASE_NOTES", "Candidate", "Plan", "plan_step"]


@dataclass
class Plan:
    """The outcome of planning one recipe on ``devices`` ranks with ``budget`` bytes each.

    Args:
        title: The recipe files and overrides, for the header.
        budget: Usable bytes per device.
        devices: Ranks (per-rank sizes and, under FSDP2, the shard count).
        fsdp: Whether the trained experts were sharded over the ranks.
        sizes: One rank's step sizes.
        configs: Where each model's config came from.
        recipe_setting: The recipe's own (micro_batch, checkpointing).
        candidates: Every traced (micro_batch, checkpointing) setting.
        largest: Per checkpointing setting, the largest micro-batch that fits (None: none fits).
        held_lm_graph: Bytes the refiner's loss leaves held through the DiT update (joint mode): its whole
            graph, or only its gradients when it is backpropagated per micro-batch.
        lm_micro_batch: The recipe's ``rollout.lm_micro_batch_size`` (None: the refiner's loss in one batch).
        rewards: The recipe's reward terms as the plan counts them (a model on the device, or where they score).
        searched: Whether the largest fitting micro-batches were searched (else only the recipe's setting).
        notes: What the trace approximates or assumes.
        stood_in: Calls of repeated blocks stood in for by an earlier copy's trace (:mod:`unirl_pl.plan.blocks`).
        seconds: Wall time of the whole plan.
    """

    title: str
    budget: int
    devices: int
    fsdp: bool
    sizes: StepSizes
    configs: dict[str, str]
    recipe_setting: tuple[int, bool]
    candidates: list[Candidate] = field(default_factory=list)
    largest: dict[bool, int | None] = field(default_factory=dict)
    held_lm_graph: int = 0
    lm_micro_batch: int | None = None
    rewards: list[PlannedReward] = field(default_factory=list)
    searched: bool = True
    notes: list[str] = field(default_factory=list)
    stood_in: int = 0
    seconds: float = 0.0

    def candidate(self, micro_batch: int, checkpointing: bool) -> Candidate | None:
        """The traced candidate of this setting, if traced."""
        for c in self.candidates:
            if (c.micro_batch, c.checkpointing) == (micro_batch, checkpointing):
                return c
        return None

    def fits(self, candidate: Candidate) -> bool:
        """Whether every phase of ``candidate`` stays within the budget."""
        return candidate.peak[1].total <= self.budget

    @property
    def recipe_candidate(self) -> Candidate:
        """The recipe's own setting (always traced)."""
        found = self.candidate(*self.recipe_setting)
        assert found is not None, "the recipe's own setting is always traced"
        return found

    @property
    def needs_checkpointing(self) -> bool | None:
        """Whether only gradient checkpointing makes some micro-batch fit (None: nothing fits either way, or
        not searched)."""
        if self.largest.get(False) is not None:
            return False
        return True if self.largest.get(True) is not None else None


def build_experts(
    recipe: StepRecipe, pipeline_path: str | None, llm_path: str | None, mode: FakeTensorMode | None
) -> FakeExperts:
    """The recipe's experts from the given folders or the shipped configs (see ``resolve_folder``): fake
    in ``mode``, or loaded with their weights by their own ``build()`` when ``mode`` is None."""
    default = DEFAULT_PIPELINES.get(recipe.generator_class.__name__)
    folder = resolve_folder(pipeline_path, recipe.pipeline_path, default, "pipeline")
    llm_folder = None
    if recipe.llm_args is not None:
        settings = ("--llm-path", "model.llm.init_args.pretrained_path")
        llm_folder = resolve_folder(llm_path, recipe.llm_args.get("pretrained_path"), None, "refiner LM", settings)
    if mode is None:
        return real_experts(
            recipe.generator_class, recipe.generator_args, folder, recipe.llm_args, llm_folder, recipe.llm_class
        )
    generator, extras = build_generator(recipe.generator_class, recipe.generator_args, folder, mode)
    llm = None if llm_folder is None else build_llm(recipe.llm_args or {}, llm_folder, mode, recipe.llm_class)
    return FakeExperts(generator, llm, mode, folder, llm_folder, extras)


def expert_groups(experts: FakeExperts) -> dict[str, list[torch.nn.Module]]:
    """The models of each card expert: ``transformer`` (every generator transformer) and ``llm``."""
    return {Role.GENERATOR: experts.transformers(), Role.REFINER: [experts.llm] if experts.llm is not None else []}


def freeze_untrained(experts: FakeExperts, trained: list[str]) -> None:
    """Turn off gradients of the experts the mode does not train, as ``configure_model`` does."""
    for name, models in expert_groups(experts).items():
        if name not in trained:
            for model in models:
                model.requires_grad_(False)


@contextmanager
def fake_ranks(world: int) -> Iterator[Any]:
    """A fake process group of ``world`` ranks (this process is rank 0; collectives do not communicate)
    and its 1-D CPU device mesh, torn down afterwards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("plan needs its own (fake) process group; one is already initialized")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield init_device_mesh("cpu", (world,))
    finally:
        dist.destroy_process_group()


def shard(experts: FakeExperts, trained: list[str], mesh: Any, reshard_after_forward: bool) -> None:
    """FSDP2 as a fit applies it: ``distributed.shard_experts`` on the trained experts (every generator
    transformer, the refiner LM, and a full fine-tune's frozen reference copy like its policy); frozen parts stay
    whole on every rank."""
    # The generator's children as ``shard_experts`` reads them (its ``reference_model`` under ``finetune: full``).
    generator = SimpleNamespace(transformers=experts.transformers(), _modules=experts.generator._modules)
    parts = {Role.GENERATOR: generator}
    if experts.llm is not None:
        parts[Role.REFINER] = experts.llm
    shard_experts(parts, trained, mesh, reshard_after_forward)


def steady_state(experts: FakeExperts, recipe: StepRecipe, trained: list[str]) -> list[StepOptimizer]:
    """Give every trainable parameter a gradient and build each trained expert's optimizer with its state
    (one step on zero gradients), as a running fit holds them between steps; run inside the plan's mode."""
    optimizers = []
    for name, models in expert_groups(experts).items():
        if name not in trained:
            continue
        params = list({id(p): p for m in models for p in m.parameters() if p.requires_grad}.values())
        for param in params:
            param.grad = torch.zeros_like(param)
        factory, loss = (
            (recipe.transformer_optimizer, recipe.transformer_loss)
            if name == Role.GENERATOR
            else (recipe.llm_optimizer, recipe.llm_loss)
        )
        optimizer = StepOptimizer(factory, params, loss.grad_clip)
        optimizer.step()
        optimizers.append(optimizer)
    return optimizers


def plan_step(
    recipe: StepRecipe,
    *,
    budget: int,
    title: str,
    pipeline_path: str | None = None,
    llm_path: str | None = None,
    prompt_tokens: int = 128,
    log: Callable[[str], None] = print,
    real: bool = False,
    search: bool = True,
    every_block: bool = False,
) -> Plan:
    """Trace ``recipe``'s step on fake tensors and search the micro-batch and checkpointing that fit in
    ``budget`` bytes per device; returns the :class:`Plan`. ``real`` runs the same code on the experts
    loaded with their weights and real tensors (small folders only): the check of the fake trace. Without
    ``search`` only the recipe's own setting is traced (whether it fits, in a fraction of the time). A fake trace
    stands in for the repeated calls of identical blocks
    (:mod:`unirl_pl.plan.blocks`) unless ``every_block``."""
    start = time.monotonic()
    mode = None if real else FakeTensorMode()
    experts = build_experts(recipe, pipeline_path, llm_path, mode)
    rewards = planned_rewards(recipe.rewards, mode, recipe.reward_paths)
    experts.reward_models = reward_models(rewards)
    card = Card.unified(has_llm=experts.llm is not None, has_vae=True)
    trained = card.trained_components(recipe.mode)
    refines = experts.llm is not None and card.runs_loop(recipe.mode, Loop.DECODE)
    sizes = step_sizes(recipe, refines, prompt_tokens)
    recipe_mb = recipe.rollout.micro_batch_size or sizes.images
    sharded = recipe.fsdp and recipe.devices > 1
    result = Plan(
        title=title,
        budget=budget,
        devices=recipe.devices,
        fsdp=sharded,
        sizes=sizes,
        configs={
            "generator": config_summary(experts.pipeline_folder),
            **({Role.REFINER: config_summary(experts.llm_folder)} if experts.llm_folder else {}),
        },
        recipe_setting=(recipe_mb, recipe.gradient_checkpointing),
        lm_micro_batch=recipe.rollout.lm_micro_batch_size,
        rewards=rewards,
        searched=search,
    )
    result.notes += [
        f"refiner requests of {prompt_tokens} prompt tokens (--prompt-tokens) and {sizes.new_tokens} generated "
        "tokens, none stopping early; the decode's middle steps extend the KV cache in one forward",
        f"the feature cache full: {sizes.cache_entries} texts' features on the device"
        + (" (rollout.feature_cache_offload keeps them in host memory)" if not sizes.cache_entries else ""),
        "fake CPU tensors: attention has its flash kernel's memory; the CUDA context, cuBLAS/NCCL workspaces and "
        "allocator fragmentation hold no tensor and are what --reserve-gb sets aside",
    ]
    if recipe.edits:
        generator = experts.generator
        height, width = getattr(generator, "source_size", None) or (generator.height, generator.width)
        reads = " (the text encoder reads it too)" if getattr(generator, "text_sees_source", False) else ""
        result.notes.append(
            f"editing: each sample's source image ({height} x {width} px) is encoded with its text{reads}, and its "
            "latents' tokens join the target's in every DiT forward"
        )
    if experts.resident:
        result.notes.append(
            f"{len(experts.resident) + 1} generator experts resident with their LoRA state; one traces the step"
        )
    if experts.reward_models:
        result.notes.append(
            "the reward phase holds the step's experience with its images; an image processor on the host is "
            "traced as its 8-bit input copy and float32 output on the device"
        )
    freeze_untrained(experts, trained)
    tensors = mode if mode is not None else nullcontext()
    if sharded and mode is None:
        raise ValueError("a real-tensor plan runs on one rank; FSDP2 plans are fake")
    with fake_ranks(recipe.devices) if sharded else nullcontext() as mesh:
        with tensors, AllRowsReal():  # (sharding under it too: FSDP2's chunks of each parameter are its fast views)
            if sharded:
                shard(experts, trained, mesh, recipe.reshard_after_forward)
            optimizers = steady_state(experts, recipe, trained)
            tracer = Tracer(experts, optimizers, log, stand_ins=mode is not None and not every_block)
            fixed = _fixed_phases(tracer, experts, recipe, sizes, refines, trained, rewards)
            searcher = MicroBatchSearch(tracer, experts, recipe, sizes, trained, fixed)
            result.candidates = searcher.candidates
            searcher.trace(recipe_mb, recipe.gradient_checkpointing, rollout=True)
            for checkpointing in (recipe.gradient_checkpointing, not recipe.gradient_checkpointing) if search else ():
                result.largest[checkpointing] = searcher.largest(budget, checkpointing, [recipe_mb])
            result.held_lm_graph = searcher.held_lm_graph
    result.stood_in = tracer.stood_in
    if tracer.stood_in:
        result.notes.append(
            f"{tracer.stood_in} calls of repeated blocks stood in for by their first copy's trace: "
            "the same peak (--trace-every-block traces each)"
        )
    result.seconds = time.monotonic() - start
    return result


def _fixed_phases(
    tracer: Tracer,
    experts: FakeExperts,
    recipe: StepRecipe,
    sizes: StepSizes,
    refines: bool,
    trained: list[str],
    rewards: Sequence[PlannedReward] = (),
) -> dict[str, Any]:
    """Trace the micro-batch-independent phases; returns their usages and the shapes later phases need."""
    generator = experts.generator
    found: dict[str, Any] = {"usage": {}}
    # One text gives the feature shapes the cache (resident while encoding) is made of: its bytes are not read, but
    # its trace has the stand-ins (a text encoder that reads a source image is traced per text).
    with tracer.tracking("feature shapes", {}, log=False):
        cond = phases.text_encode(generator, 1, recipe.edits)
    cond_rows = {k: (tuple(v.shape[1:]), v.dtype) for k, v in cond.items()}
    del cond
    found["cond_rows"] = cond_rows
    cache = experience(sizes, generator.latent_shape, cond_rows, None, {"cache"})
    if refines:
        with tracer.tracking("lm_decode", cache) as t:
            phases.lm_decode(experts.llm, sizes.refined, sizes.prompt_tokens, sizes.new_tokens)
        found["usage"]["lm_decode"] = t.peak()
    lm_record = {"lm_record"} if Role.REFINER in trained else set()
    resident = experience(sizes, generator.latent_shape, cond_rows, None, {"cache"} | lm_record)
    with tracer.tracking("text_encode", resident) as t:
        phases.text_encode(generator, sizes.encode_batch, recipe.edits)
    found["usage"]["text_encode"] = t.peak()
    parts = {"cache", "cond", "latents"} | lm_record | ({"record"} if Role.GENERATOR in trained else set())
    resident = experience(sizes, generator.latent_shape, cond_rows, None, parts)
    with tracer.tracking("vae_decode", resident) as t:
        pixels = phases.vae_decode(generator, resident["latents"])
    found["usage"]["vae_decode"] = t.peak()
    found["pixel_row"] = tuple(pixels.shape[1:])
    del pixels
    if any(term.on_device for term in rewards):
        # Scoring, between the decode and the update: the decoded images (and the latents they came from)
        # are held with the rest of the experience while every term scores them.
        resident = experience(sizes, generator.latent_shape, cond_rows, found["pixel_row"], parts | {"images"})
        per_prompt = max(1, sizes.images // max(1, sizes.prompts))  # each image is scored with its prompt
        prompts = [f"prompt {i // per_prompt}" for i in range(sizes.images)]
        with tracer.tracking("reward", resident) as t:
            score(rewards, resident["images"], prompts)
        found["usage"]["reward"] = t.peak()
    if Role.REFINER in trained and Role.GENERATOR not in trained:
        # prompt_only: the refiner's update is the whole training step.
        resident = experience(sizes, generator.latent_shape, cond_rows, found["pixel_row"], parts | {"images"})
        with tracer.tracking("lm_update", resident) as t:
            train_step(tracer, experts, recipe, resident, None, True, t)
        found["usage"]["lm_update"] = t.marks["lm_update"]
    return found
