"""One RL step as the plan sees it: one rank's sizes, the tensors the step keeps resident, the tracer that
runs a phase with them, and the training step's order.

A phase's peak is the device's peak while it runs: every model's weights, the trained experts' LoRA
gradients and optimizer state (steady state: the previous step's gradients live until the next
``training_step`` clears them) and the experience that part of the step holds (:func:`experience`) are
tracked alongside the phase's own tensors.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from unirl_pl.loops import ARDecode, DiffusionDenoise, RolloutConfig
from unirl_pl.plan import phases
from unirl_pl.plan.blocks import BlockStandIns
from unirl_pl.plan.models import FakeExperts
from unirl_pl.plan.optimizers import StepOptimizer, local_shard
from unirl_pl.plan.recipe import StepRecipe
from unirl_pl.plan.tracker import PlanMemTracker
from unirl_pl.versioning import FeatureCache, VersionLedger

PHASES = ("lm_decode", "text_encode", "dit_rollout", "vae_decode", "reward", "dit_update", "lm_update")
"""The phases of one step, in the order a step runs them (``reward`` only with a reward model on the device)."""

PHASE_NOTES = {
    "lm_decode": "refiner decode of every refined row: prefill, KV-cache steps, no grad",
    "text_encode": "the text encoders on one encode batch, no grad",
    "dit_rollout": "one SDE step of one rollout micro-batch (guided: 2x the rows), no grad",
    "vae_decode": "the VAE decode of the step's latents (one call, as the rollout makes it)",
    "reward": "the in-process reward models scoring the step's images (batch_size images a forward), no grad",
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


def recorded_steps(algorithm: Any, rollout: RolloutConfig) -> int:
    """The stochastic (recorded, trained) denoising steps per sample the generator algorithm plans; 0 for one
    that records no steps (DiffusionNFT samples the ODE)."""
    try:
        plan = algorithm.plan(rollout, 0, [0], [0])
    except NotImplementedError:
        return 0
    return plan.size if plan.stochastic else 0


def step_sizes(recipe: StepRecipe, refines: bool, prompt_tokens: int) -> StepSizes:
    """The per-rank sizes of ``recipe``'s step; the feature cache's batch is its default."""
    prompts = recipe.prompts_per_step // recipe.devices
    layout = recipe.layout
    texts = prompts * layout.samples_per_prompt
    sde_steps = recorded_steps(recipe.generator_algorithm, recipe.rollout)
    cache = FeatureCache(VersionLedger(["text_encoder"]))
    # An offloaded cache holds nothing on the device between uses (a step's rows are the ``cond`` part).
    entries = 0 if recipe.rollout.feature_cache_offload else recipe.rollout.feature_cache_size
    return StepSizes(
        prompts=prompts,
        texts=texts,
        refined=len(layout.refined_rows(prompts, refine=refines)),
        images=texts * layout.images_per_refinement,
        sde_steps=sde_steps,
        prompt_tokens=prompt_tokens,
        new_tokens=recipe.rollout.max_new_tokens,
        encode_batch=cache.encode_batch,
        cache_entries=entries,
    )


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes one rank holds of ``tensor`` (its local shard when it is an FSDP2 ``DTensor``)."""
    local = local_shard(tensor)
    return local.numel() * local.element_size()


class Tracer:
    """Runs phases under the tracker with the step's steady-state residents tracked alongside.

    Args:
        experts: The experts (fake for a plan, real to check one).
        optimizers: The trained experts' optimizers, stepped as on GPUs (their state is resident).
        log: Progress messages (one line per trace).
        stand_ins: Stand in for the repeated calls of identical blocks
            (:mod:`unirl_pl.plan.blocks`: the same peak in a fraction of the time); off traces every block.
    """

    def __init__(
        self,
        experts: FakeExperts,
        optimizers: list[StepOptimizer],
        log: Callable[[str], None],
        stand_ins: bool = True,
    ) -> None:
        self.experts, self.optimizers, self.log = experts, optimizers, log
        self.stand_ins = stand_ins
        self.stood_in = 0
        params = {id(p): p for m in experts.modules() for p in m.parameters() if p.requires_grad}
        self.trainable_bytes = sum(local_bytes(p) for p in params.values())

    @contextmanager
    def tracking(self, name: str, resident: dict[str, torch.Tensor], log: bool = True) -> Iterator[PlanMemTracker]:
        """A tracker over one trace named ``name`` with the models, optimizer state and ``resident`` tensors; with
        ``log`` its time and peak are logged."""
        tracker = PlanMemTracker(self.trainable_bytes)
        tracker.track_external(*self.experts.modules(), *(o.optimizer for o in self.optimizers), *resident.values())
        start = time.monotonic()
        with tracker:
            if self.stand_ins:
                with BlockStandIns(self.experts.modules(), tracker) as blocks:
                    yield tracker
                self.stood_in += blocks.stood_in
            else:
                yield tracker
        # A trace with marks (the training step) restarts its peak at each: the trace's peak is the highest part.
        peak = max(u.total for u in [tracker.peak(), *tracker.marks.values()])
        if log:
            self.log(f"traced {name} in {time.monotonic() - start:.0f} s: peak {peak / 2**30:.1f} GiB")


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


def train_step(
    tracer: Tracer,
    experts: FakeExperts,
    recipe: StepRecipe,
    resident: dict[str, torch.Tensor],
    dit: tuple[DiffusionDenoise, Any] | None,
    lm_trained: bool,
    tracker: PlanMemTracker,
    held_graph: int | None = None,
) -> int:
    """``UniRLModule.training_step``'s order: clear the gradients, the refiner's loss forward (backpropagated
    per micro-batch with ``rollout.lm_micro_batch_size``, else its graph kept), the DiT's per-(step,
    micro-batch) updates, the refiner's backward when it was kept, clipping and optimizer steps. Marks
    ``dit_update`` (the DiT's part, with what the refiner left: its graph, or its gradients when it was
    backpropagated per micro-batch) and ``lm_update`` (the rest); returns the bytes the refiner's part holds
    while the DiT updates.

    The refiner's part does not depend on the DiT's micro-batch: with ``held_graph`` (its bytes, traced
    before) a buffer of that size stands in for its graph during the DiT's update and the refiner's
    forward and backward are not traced again (``lm_update`` is then not marked)."""
    for optimizer in tracer.optimizers:
        optimizer.zero_grad()
    before = tracker.current().total
    lm_out = stand_in = None
    if lm_trained and experts.llm is not None and held_graph is None:
        loop = ARDecode(experts.llm, recipe.rollout)
        names = ("lm.ids", "lm.mask", "lm.gen_mask", "lm.old_logp")
        # Backpropagated per chunk, every chunk frees its graph before the next: a chunk peaks as the second
        # does (plus the earlier chunks' detached log-probs, a few KiB), so two full chunks of the (resident,
        # full-size) record are traced, not dozens of identical ones.
        size = recipe.rollout.lm_micro_batch_size
        rows = resident["lm.ids"].shape[0] if size is None else min(resident["lm.ids"].shape[0], 2 * size)
        record = phases.lm_record(*(resident[n][:rows] for n in names))
        lm_out = phases.lm_loss_forward(
            recipe.llm_algorithm, loop, record, recipe.llm_loss, experts.llm.adapter_disabled, _backward
        )
    elif lm_trained and held_graph:
        stand_in = torch.empty(held_graph, dtype=torch.uint8)
    held = tracker.current().total - before
    forward = tracker.mark("lm_update")
    if dit is not None:
        loop, record = dit
        reference = experts.generator.adapter_disabled
        phases.dit_update(recipe.generator_algorithm, loop, record, recipe.transformer_loss, reference, _backward)
        tracker.mark("dit_update")
    if lm_out is not None and not lm_out.backpropagated:
        lm_out.loss.backward()
    del stand_in
    for optimizer in tracer.optimizers:
        optimizer.step()
    backward = tracker.mark("lm_backward")
    if held_graph is None:
        tracker.marks["lm_update"] = max(forward, backward, key=lambda u: u.total)
    else:
        del tracker.marks["lm_update"]
    return held


def _backward(loss: torch.Tensor) -> None:
    loss.backward()
