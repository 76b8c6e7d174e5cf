"""Trace one RL step of a recipe's real-size experts on fake tensors and find the micro-batch that fits.

The step's phases (:mod:`unirl_pl.plan.phases`) each run under :class:`~unirl_pl.plan.tracker.PlanMemTracker`
with what stays on the device in a running fit tracked alongside: every model's weights, the trained
experts' LoRA gradients and optimizer state (steady state: the previous step's gradients live until the
next ``training_step`` clears them), and the experience that phase of the step holds (see
:func:`experience`). A phase's peak is therefore the device's peak while it runs, not the phase alone.

Under an FSDP2 recipe (``ModelParallelStrategy``) the experts are sharded by the project's own
``distributed.shard_experts`` over a fake process group of ``devices`` ranks (no communication: the
collectives return fake tensors of the right shapes), so the traces hold one rank's shards, its
all-gathered blocks and its reduce-scatter buffers.

The micro-batch (``model.rollout.micro_batch_size``) only changes the DiT's rollout chunk and its update;
the other phases are traced once. For each gradient-checkpointing setting the step is traced at
micro-batches 1 and 2, the largest candidate their straight line allows is traced, and the search steps
up or down by tracing until the largest candidate that fits is found: every verdict comes from a trace.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from unirl_pl.card import Card
from unirl_pl.distributed import shard_experts
from unirl_pl.loops import ARDecode, DiffusionDenoise
from unirl_pl.method.grpo import ExpertLoss
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
from unirl_pl.plan.recipe import StepRecipe
from unirl_pl.plan.tracker import AllRowsReal, PlanMemTracker, Usage
from unirl_pl.versioning import FeatureCache, VersionLedger

PHASES = ("lm_decode", "text_encode", "dit_rollout", "vae_decode", "dit_update", "lm_update")
"""The phases of one step, in the order a step runs them."""

PHASE_NOTES = {
    "lm_decode": "refiner decode of every refined row: prefill, KV-cache steps, no grad",
    "text_encode": "the text encoders on one encode batch, no grad",
    "dit_rollout": "one SDE step of one rollout micro-batch (guided: 2x the rows), no grad",
    "vae_decode": "the VAE decode of the step's latents (one call, as the rollout makes it)",
    "dit_update": "one (step, micro-batch) recompute, its reference forward and backward",
    "lm_update": "the refiner's loss forward with its reference, backward, clipping, optimizer steps",
}


@dataclass(frozen=True)
class StepSizes:
    """One rank's sizes in one RL step.

    Args:
        prompts: Prompts on this rank.
        texts: Text samples (prompts x samples_per_prompt), each encoded once.
        refined: Rows the refiner decodes.
        images: Images (or videos) the generator renders.
        sde_steps: SDE steps the DiT records and trains per image.
        prompt_tokens: Tokens of one refiner request (chat template, instruction and prompt).
        new_tokens: Tokens the refiner generates (``max_new_tokens``, none stopping early).
        encode_batch: Texts per text-encoder call (the feature cache's batch).
        cache_entries: Texts whose features the feature cache keeps on the device.
    """

    prompts: int
    texts: int
    refined: int
    images: int
    sde_steps: int
    prompt_tokens: int
    new_tokens: int
    encode_batch: int
    cache_entries: int


def step_sizes(recipe: StepRecipe, refines: bool, prompt_tokens: int) -> StepSizes:
    """The per-rank sizes of ``recipe``'s step; the feature cache's batch and capacity are its defaults."""
    prompts = recipe.prompts_per_step // recipe.devices
    layout = recipe.layout
    texts = prompts * layout.samples_per_prompt
    start, end = recipe.rollout.sde_window
    cache = FeatureCache(VersionLedger(["text_encoder"]))
    return StepSizes(
        prompts=prompts,
        texts=texts,
        refined=len(layout.refined_rows(prompts, refine=refines)),
        images=texts * layout.images_per_refinement,
        sde_steps=end - start,
        prompt_tokens=prompt_tokens,
        new_tokens=recipe.rollout.max_new_tokens,
        encode_batch=cache.encode_batch,
        cache_entries=cache.max_entries,
    )


@dataclass
class Candidate:
    """One traced setting of the DiT's micro-batch and checkpointing.

    Args:
        micro_batch: ``model.rollout.micro_batch_size``.
        checkpointing: ``model.generator.init_args.gradient_checkpointing``.
        phases: Peak usage per phase at this setting (the micro-batch-independent ones included).
    """

    micro_batch: int
    checkpointing: bool
    phases: dict[str, Usage]

    @property
    def peak(self) -> tuple[str, Usage]:
        """The phase with the highest peak, and its usage."""
        name = max(self.phases, key=lambda n: self.phases[n].total)
        return name, self.phases[name]


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
        held_lm_graph: Bytes of the refiner's loss graph held through the DiT update (joint mode).
        notes: What the trace approximates or assumes.
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
    notes: list[str] = field(default_factory=list)
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
        """Whether only gradient checkpointing makes some micro-batch fit (None: nothing fits either way)."""
        if self.largest.get(False) is not None:
            return False
        return True if self.largest.get(True) is not None else None


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes one rank holds of ``tensor`` (its local shard when it is an FSDP2 ``DTensor``)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


class Tracer:
    """Runs phases under the tracker with the step's steady-state residents tracked alongside.

    Args:
        experts: The experts (fake for a plan, real to check one).
        optimizers: The trained experts' optimizers (their state is resident).
        losses: Each optimizer's expert loss settings (its gradient clip).
        log: Progress messages (one line per trace).
    """

    def __init__(
        self,
        experts: FakeExperts,
        optimizers: list[torch.optim.Optimizer],
        losses: list[ExpertLoss],
        log: Callable[[str], None],
    ) -> None:
        self.experts, self.optimizers, self.losses, self.log = experts, optimizers, losses, log
        params = {id(p): p for m in experts.modules() for p in m.parameters() if p.requires_grad}
        self.trainable_bytes = sum(local_bytes(p) for p in params.values())

    @contextmanager
    def tracking(self, name: str, resident: dict[str, torch.Tensor]) -> Iterator[PlanMemTracker]:
        """A tracker over one trace named ``name`` with the models, optimizer state and ``resident`` tensors."""
        tracker = PlanMemTracker(self.trainable_bytes)
        tracker.track_external(*self.experts.modules(), *self.optimizers, *resident.values())
        start = time.monotonic()
        with tracker:
            yield tracker
        self.log(f"traced {name} in {time.monotonic() - start:.0f} s: peak {tracker.peak().total / 2**30:.1f} GiB")


def experience(
    sizes: StepSizes,
    latent_shape: tuple[int, ...],
    cond_rows: dict[str, tuple[tuple[int, ...], torch.dtype]],
    pixel_row: tuple[int, ...] | None,
    parts: set[str],
) -> dict[str, torch.Tensor]:
    """The step's resident tensors at full size (created in the caller's mode), named by part:

    - ``cache``: the feature cache's rows (``cache_entries`` texts, each of ``cond_rows``' shapes);
    - ``cond``: the step's stacked conditioning of every image and the one-row unconditional branch;
    - ``record``: the DiT record, x_t and x_next of every image and SDE step (float32) and their log-probs;
    - ``latents``: the rollout's final latents (float32);
    - ``images``: the decoded pixels the experience keeps (float32);
    - ``lm_record``: the refiner's tokens, masks and log-probs.

    Phases read slices of them (a micro-batch's rows of the record and the conditioning), as a fit does,
    so a trace counts the copies a phase makes and never a second record.
    """
    out: dict[str, torch.Tensor] = {}
    n, s = sizes.images, sizes.sde_steps
    if "cache" in parts:
        out |= {f"cache.{k}": torch.zeros(sizes.cache_entries, *shape, dtype=d) for k, (shape, d) in cond_rows.items()}
    if "cond" in parts:
        out |= {f"cond.{k}": torch.zeros(n + 1, *shape, dtype=d) for k, (shape, d) in cond_rows.items()}
    if "record" in parts:
        out |= {"prev": torch.zeros(n, s, *latent_shape), "sample": torch.zeros(n, s, *latent_shape)}
        out["old_logp"] = torch.zeros(n, s)
    if "latents" in parts:
        out["latents"] = torch.zeros(n, *latent_shape)
    if "images" in parts and pixel_row is not None:
        out["images"] = torch.zeros(n, *pixel_row)
    if "lm_record" in parts and sizes.refined:
        total = sizes.prompt_tokens + sizes.new_tokens
        out["lm.ids"] = torch.zeros(sizes.refined, total, dtype=torch.long)
        out["lm.mask"] = torch.ones(sizes.refined, total, dtype=torch.long)
        out["lm.mask"][0, 0] = 0  # left padding: requests differ in length, so attention takes a mask
        out["lm.gen_mask"] = torch.ones(sizes.refined, sizes.new_tokens, dtype=torch.bool)
        out["lm.old_logp"] = torch.zeros(sizes.refined, sizes.new_tokens)
    return out


def step_cond(resident: dict[str, torch.Tensor], rows: int) -> tuple[dict[str, torch.Tensor], dict | None]:
    """A micro-batch's conditioning (the first ``rows`` rows of the step's stacked ``cond``) and the
    one-row unconditional branch (its last row), both views."""
    cond = {k[len("cond.") :]: v[:rows] for k, v in resident.items() if k.startswith("cond.")}
    uncond = {k[len("cond.") :]: v[-1:] for k, v in resident.items() if k.startswith("cond.")}
    return cond, uncond


def set_checkpointing(experts: FakeExperts, on: bool) -> None:
    """Turn gradient checkpointing of every generator transformer on or off (diffusers' own switch)."""
    for model in experts.transformers():
        if on:
            model.enable_gradient_checkpointing()
        else:
            model.disable_gradient_checkpointing()


def candidates_up_to(n: int, extra: list[int]) -> list[int]:
    """Powers of two up to ``n``, plus ``n`` and ``extra``: the micro-batches a search may trace."""
    values = {1 << i for i in range(int(math.log2(max(n, 1))) + 1)} | {n} | {m for m in extra if 1 <= m <= n}
    return sorted(values)


def build_experts(
    recipe: StepRecipe, pipeline_path: str | None, llm_path: str | None, mode: FakeTensorMode | None
) -> FakeExperts:
    """The recipe's experts from the given folders or the shipped configs (see ``resolve_folder``): fake
    in ``mode``, or loaded with their weights by their own ``build()`` when ``mode`` is None."""
    default = DEFAULT_PIPELINES.get(recipe.generator_class.__name__)
    folder = resolve_folder(pipeline_path or recipe.pipeline_path, default, "pipeline")
    llm_folder = None
    if recipe.llm_args is not None:
        llm_folder = resolve_folder(llm_path or recipe.llm_args.get("pretrained_path"), None, "refiner LM")
    if mode is None:
        return real_experts(recipe.generator_class, recipe.generator_args, folder, recipe.llm_args, llm_folder)
    generator, extras = build_generator(recipe.generator_class, recipe.generator_args, folder, mode)
    llm = None if llm_folder is None else build_llm(recipe.llm_args or {}, llm_folder, mode)
    return FakeExperts(generator, llm, mode, folder, llm_folder, extras)


def expert_groups(experts: FakeExperts) -> dict[str, list[torch.nn.Module]]:
    """The models of each card expert: ``transformer`` (every generator transformer) and ``llm``."""
    return {"transformer": experts.transformers(), "llm": [experts.llm] if experts.llm is not None else []}


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
    transformer, the refiner LM); frozen parts stay whole on every rank."""
    parts = {"transformer": SimpleNamespace(transformers=experts.transformers())}
    if experts.llm is not None:
        parts["llm"] = experts.llm
    shard_experts(parts, trained, mesh, reshard_after_forward)


def steady_state(
    experts: FakeExperts, recipe: StepRecipe, trained: list[str]
) -> tuple[list[torch.optim.Optimizer], list[ExpertLoss]]:
    """Give every trainable parameter a gradient and build each trained expert's optimizer with its state
    (one step on zero gradients), as a running fit holds them between steps; run inside the plan's mode.
    Returns the optimizers and each one's loss settings."""
    optimizers, losses = [], []
    for name, models in expert_groups(experts).items():
        if name not in trained:
            continue
        params = list({id(p): p for m in models for p in m.parameters() if p.requires_grad}.values())
        for param in params:
            param.grad = torch.zeros_like(param)
        cls, args = recipe.transformer_optimizer if name == "transformer" else recipe.llm_optimizer
        optimizer = cls(params, **args)
        optimizer.step()
        optimizers.append(optimizer)
        losses.append(recipe.transformer_loss if name == "transformer" else recipe.llm_loss)
    return optimizers, losses


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
) -> Plan:
    """Trace ``recipe``'s step on fake tensors and search the micro-batch and checkpointing that fit in
    ``budget`` bytes per device; returns the :class:`Plan`. ``real`` runs the same code on the experts
    loaded with their weights and real tensors (small folders only): the check of the fake trace."""
    start = time.monotonic()
    mode = None if real else FakeTensorMode()
    experts = build_experts(recipe, pipeline_path, llm_path, mode)
    card = Card.unified(has_llm=experts.llm is not None, has_vae=True)
    trained = card.trained_components(recipe.mode)
    refines = experts.llm is not None and card.runs_loop(recipe.mode, "ar_decode")
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
            **({"llm": config_summary(experts.llm_folder)} if experts.llm_folder else {}),
        },
        recipe_setting=(recipe_mb, recipe.gradient_checkpointing),
    )
    result.notes += [
        f"refiner requests of {prompt_tokens} prompt tokens (--prompt-tokens) and {sizes.new_tokens} generated "
        "tokens, none stopping early; the decode's middle steps extend the KV cache in one forward",
        f"the feature cache full: {sizes.cache_entries} texts' features on the device (FeatureCache's default)",
        "fake CPU tensors: attention has its flash kernel's memory; the CUDA context, cuBLAS/NCCL workspaces and "
        "allocator fragmentation hold no tensor and are what --reserve-gb sets aside",
    ]
    if experts.resident:
        result.notes.append(
            f"{len(experts.resident) + 1} generator experts resident with their LoRA state; one traces the step"
        )
    freeze_untrained(experts, trained)
    tensors = mode if mode is not None else nullcontext()
    if sharded and mode is None:
        raise ValueError("a real-tensor plan runs on one rank; FSDP2 plans are fake")
    with fake_ranks(recipe.devices) if sharded else nullcontext() as mesh:
        if sharded:
            with tensors:
                shard(experts, trained, mesh, recipe.reshard_after_forward)
        with tensors, AllRowsReal():
            optimizers, losses = steady_state(experts, recipe, trained)
            tracer = Tracer(experts, optimizers, losses, log)
            fixed = _fixed_phases(tracer, experts, recipe, sizes, refines, trained)
            search = _MicroBatchSearch(tracer, experts, recipe, sizes, trained, fixed)
            result.candidates = search.candidates
            search.trace(recipe_mb, recipe.gradient_checkpointing, rollout=True)
            for checkpointing in (recipe.gradient_checkpointing, not recipe.gradient_checkpointing):
                result.largest[checkpointing] = search.largest(budget, checkpointing, [recipe_mb])
            result.held_lm_graph = search.held_lm_graph
    result.seconds = time.monotonic() - start
    return result


def _fixed_phases(
    tracer: Tracer, experts: FakeExperts, recipe: StepRecipe, sizes: StepSizes, refines: bool, trained: list[str]
) -> dict[str, Any]:
    """Trace the micro-batch-independent phases; returns their usages and the shapes later phases need."""
    generator = experts.generator
    found: dict[str, Any] = {"usage": {}}
    # One untracked text gives the feature shapes the cache (resident while encoding) is made of.
    cond_rows = {k: (tuple(v.shape[1:]), v.dtype) for k, v in phases.text_encode(generator, 1).items()}
    found["cond_rows"] = cond_rows
    cache = experience(sizes, generator.latent_shape, cond_rows, None, {"cache"})
    if refines:
        with tracer.tracking("lm_decode", cache) as t:
            phases.lm_decode(experts.llm, sizes.refined, sizes.prompt_tokens, sizes.new_tokens)
        found["usage"]["lm_decode"] = t.peak()
    lm_record = {"lm_record"} if "llm" in trained else set()
    resident = experience(sizes, generator.latent_shape, cond_rows, None, {"cache"} | lm_record)
    with tracer.tracking("text_encode", resident) as t:
        phases.text_encode(generator, sizes.encode_batch)
    found["usage"]["text_encode"] = t.peak()
    parts = {"cache", "cond", "latents"} | lm_record | ({"record"} if "transformer" in trained else set())
    resident = experience(sizes, generator.latent_shape, cond_rows, None, parts)
    with tracer.tracking("vae_decode", resident) as t:
        pixels = phases.vae_decode(generator, resident["latents"])
    found["usage"]["vae_decode"] = t.peak()
    found["pixel_row"] = tuple(pixels.shape[1:])
    del pixels
    if "llm" in trained and "transformer" not in trained:
        # prompt_only: the refiner's update is the whole training step.
        resident = experience(sizes, generator.latent_shape, cond_rows, found["pixel_row"], parts | {"images"})
        with tracer.tracking("lm_update", resident) as t:
            _train_step(tracer, experts, recipe, resident, None, True, t)
        found["usage"]["lm_update"] = t.marks["lm_update"]
    return found


def _train_step(
    tracer: Tracer,
    experts: FakeExperts,
    recipe: StepRecipe,
    resident: dict[str, torch.Tensor],
    dit: tuple[DiffusionDenoise, Any] | None,
    lm_trained: bool,
    tracker: PlanMemTracker,
    held_graph: int | None = None,
) -> int:
    """``UniRLModule.training_step``'s order: clear the gradients, the refiner's loss forward (its graph
    kept), the DiT's per-(step, micro-batch) updates, the refiner's backward, clipping and optimizer
    steps. Marks ``dit_update`` (the DiT's part, the refiner's graph held) and ``lm_update`` (the rest);
    returns the bytes the refiner's graph holds while the DiT updates.

    The refiner's part does not depend on the DiT's micro-batch: with ``held_graph`` (its bytes, traced
    before) a buffer of that size stands in for its graph during the DiT's update and the refiner's
    forward and backward are not traced again (``lm_update`` is then not marked)."""
    for optimizer in tracer.optimizers:
        optimizer.zero_grad(set_to_none=True)
    before = tracker.current().total
    lm_out = stand_in = None
    if lm_trained and experts.llm is not None and held_graph is None:
        loop = ARDecode(experts.llm, recipe.rollout)
        names = ("lm.ids", "lm.mask", "lm.gen_mask", "lm.old_logp")
        record = phases.lm_record(*(resident[n] for n in names))
        lm_out = phases.lm_loss_forward(loop, record, recipe.llm_loss, experts.llm.adapter_disabled)
    elif lm_trained and held_graph:
        stand_in = torch.empty(held_graph, dtype=torch.uint8)
    held = tracker.current().total - before
    forward = tracker.mark("lm_update")
    if dit is not None:
        loop, record = dit
        phases.dit_update(loop, record, recipe.transformer_loss, experts.generator.adapter_disabled, _backward)
        tracker.mark("dit_update")
    if lm_out is not None:
        lm_out.loss.backward()
    del stand_in
    for optimizer, settings in zip(tracer.optimizers, tracer.losses, strict=True):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if settings.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(params, settings.grad_clip)
        optimizer.step()
    backward = tracker.mark("lm_backward")
    if held_graph is None:
        tracker.marks["lm_update"] = max(forward, backward, key=lambda u: u.total)
    else:
        del tracker.marks["lm_update"]
    return held


def _backward(loss: torch.Tensor) -> None:
    loss.backward()


class _MicroBatchSearch:
    """Traces the micro-batch-dependent phases per (micro_batch, checkpointing) and searches the largest
    micro-batch that fits; every traced setting is kept as a :class:`Candidate`."""

    def __init__(
        self,
        tracer: Tracer,
        experts: FakeExperts,
        recipe: StepRecipe,
        sizes: StepSizes,
        trained: list[str],
        fixed: dict[str, Any],
    ) -> None:
        self.tracer, self.experts, self.recipe, self.sizes, self.trained = tracer, experts, recipe, sizes, trained
        self.fixed = fixed
        self.candidates: list[Candidate] = []
        # The refiner's update, traced with the first setting: its graph's bytes and its peak.
        self.held_lm_graph = 0
        self.lm_update: Usage | None = None
        shape, rows = experts.generator.latent_shape, fixed["cond_rows"]
        self.dit_trained = "transformer" in trained
        base = {"cache", "cond"} | ({"lm_record"} if "llm" in trained else set())
        base |= {"record"} if self.dit_trained else set()
        self.rollout_resident = experience(sizes, shape, rows, None, base)
        self.train_resident = experience(sizes, shape, rows, fixed["pixel_row"], base | {"images"})
        self.guided = recipe.rollout.guided

    def trace(self, micro_batch: int, checkpointing: bool, rollout: bool = False) -> Candidate:
        """Trace (once) the training step at this setting when the DiT trains, and the rollout chunk when
        ``rollout`` or when nothing else depends on the micro-batch. The search leaves the rollout out:
        the update's trace holds the same chunk's forward with gradients (and more resident experience),
        so it peaks above the rollout's; the reported settings are completed with it."""
        found = next(
            (c for c in self.candidates if (c.micro_batch, c.checkpointing) == (micro_batch, checkpointing)), None
        )
        rollout = rollout or not self.dit_trained
        if found is not None and (not rollout or "dit_rollout" in found.phases):
            return found
        set_checkpointing(self.experts, checkpointing)
        loop = DiffusionDenoise(self.experts.generator, self.recipe.rollout)
        usage = dict(self.fixed["usage"]) if found is None else dict(found.phases)
        tag = f"micro-batch {micro_batch}, checkpointing {'on' if checkpointing else 'off'}"
        if rollout:
            cond, uncond = step_cond(self.rollout_resident, micro_batch)
            with self.tracer.tracking(f"dit_rollout ({tag})", self.rollout_resident) as t:
                phases.dit_rollout_step(loop, cond, uncond if self.guided else None)
            usage["dit_rollout"] = t.peak()
        if found is not None:
            found.phases = {p: usage[p] for p in PHASES if p in usage}
            return found
        if self.dit_trained:
            resident = self.train_resident
            cond, uncond = step_cond(resident, micro_batch)
            record = phases.dit_record(
                loop,
                resident["prev"][:micro_batch, :1],
                resident["sample"][:micro_batch, :1],
                resident["old_logp"][:micro_batch, :1],
                cond,
                uncond if self.guided else None,
            )
            lm_trained = "llm" in self.trained
            again = self.lm_update is not None
            with self.tracer.tracking(f"train step ({tag})", resident) as t:
                held = _train_step(
                    self.tracer,
                    self.experts,
                    self.recipe,
                    resident,
                    (loop, record),
                    lm_trained,
                    t,
                    held_graph=self.held_lm_graph if again else None,
                )
            usage["dit_update"] = t.marks["dit_update"]
            if lm_trained:
                if not again:
                    self.lm_update, self.held_lm_graph = t.marks["lm_update"], held
                usage["lm_update"] = self.lm_update
            del record
        candidate = Candidate(micro_batch, checkpointing, {p: usage[p] for p in PHASES if p in usage})
        self.candidates.append(candidate)
        return candidate

    def largest(self, budget: int, checkpointing: bool, extra: list[int]) -> int | None:
        """The largest candidate micro-batch whose trace fits ``budget`` with this checkpointing setting;
        the answer's rollout chunk is traced too, and a smaller candidate is taken if that does not fit."""
        values = candidates_up_to(self.sizes.images, extra)
        while values:
            found = largest_fitting(values, lambda m: self.trace(m, checkpointing).peak[1].total, budget)
            if found is None or self.trace(found, checkpointing, rollout=True).peak[1].total <= budget:
                return found
            values = [m for m in values if m < found]
        return None


def largest_fitting(values: list[int], peak: Callable[[int], int], budget: int) -> int | None:
    """The largest of the sorted ``values`` whose ``peak`` (a trace, cached by the caller) is within
    ``budget``, assuming the peak grows with the value; None when the smallest does not fit.

    ``peak`` at the two smallest values gives a straight line; the search starts at the largest value the
    line keeps within budget and steps up while the next fits, or down until one fits, so the answer is
    always a traced value that fits next to a traced one that does not (or the end of ``values``).
    """
    if peak(values[0]) > budget:
        return None
    if len(values) == 1:
        return values[0]
    low, high = values[0], values[1]
    slope = (peak(high) - peak(low)) / (high - low)
    i = max(j for j, m in enumerate(values) if j == 0 or peak(low) + slope * (m - low) <= budget)
    if peak(values[i]) <= budget:
        while i + 1 < len(values) and peak(values[i + 1]) <= budget:
            i += 1
        return values[i]
    while i > 0 and peak(values[i - 1]) > budget:
        i -= 1
    return values[i - 1] if i > 0 else None
