"""The phases of one RL step, each run through the project's own code on whatever tensors the caller's
mode makes (fake tensors for a plan, real ones to check the plan against).

Every function creates its inputs itself (so they are fake inside ``FakeTensorMode``) and calls the
same loops, generator surface and losses a fit calls: ``CausalLMExpert.forward`` with a KV cache as
``ARDecode.sample`` runs it, ``FlowGenerator.encode``/``decode``, ``DiffusionDenoise.velocity`` with
``flow_sde_step_with_logprob``, and the recipe's algorithms' losses (``drivers.dit_loss`` and
``drivers.refiner_loss`` by default). Values never matter, shapes do.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers import DynamicCache

from unirl_pl.algorithms.drivers import LossInputs
from unirl_pl.loops import ARDecode, DiffusionDenoise
from unirl_pl.loops.ar_decode import positions, process_logits
from unirl_pl.losses import LossOutput
from unirl_pl.method.loss_settings import ExpertLoss
from unirl_pl.plan.tracker import carrying_values
from unirl_pl.records import Cond, DiTRecord, LMRecord
from unirl_pl.sampling import flow_sde_step_with_logprob

# One SDE step's sigmas: values do not change memory; 1.0 would take the sigma_max branch, which is fine too.
SIGMA, SIGMA_NEXT, SIGMA_MAX = 0.9, 0.8, 0.95


@dataclass
class PlanRecord(DiTRecord):
    """A one-step ``DiTRecord`` whose shared schedule is given as floats: the plan's record tensors are
    fake and have no values to read a sigma from, and a shared schedule's ``step_sigmas`` are floats."""

    def step_sigmas(self, step: int, chunk: tuple[int, int]) -> tuple[float, float, float]:
        """The fixed sigmas of the traced step."""
        return SIGMA, SIGMA_NEXT, SIGMA_MAX


def lm_decode(llm: torch.nn.Module, rows: int, prompt_tokens: int, new_tokens: int, every_step: bool = False) -> None:
    """``ARDecode.sample``'s allocations for ``rows`` prompts of ``prompt_tokens`` tokens, none stopping
    early: a prefill that fills the KV cache, then one-token forwards, each step's logits processed,
    log-softmaxed and sampled, the previous output alive until the next forward returns (as the loop
    holds it). The peak is at the first step (the prefill's logits are still held) or at the last (the
    cache is longest), so unless ``every_step`` the forwards in between run as one forward that extends
    the cache by their tokens and keeps the logits of its last position only (``logits_to_keep=1``): in
    the loop each of them makes one ``rows x vocab`` row of logits, freed before the next."""
    mask = torch.ones(rows, prompt_tokens, dtype=torch.long)
    mask[0, 0] = 0  # left padding: requests differ in length, so attention takes a mask
    cache = DynamicCache()

    def forward(tokens: int, **extra: object) -> object:
        nonlocal mask
        mask = torch.cat([mask, torch.ones_like(mask[:, :1]).expand(rows, tokens)], dim=1)
        ids = torch.ones(rows, tokens, dtype=torch.long)
        pos = positions(mask)[:, -tokens:]
        if not extra:
            return llm(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
        # The LoRA-wrapped model itself (``llm`` does not pass extra arguments): the same forward.
        return llm.model(
            input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True, **extra
        )

    def sample(out: object) -> None:
        logits = process_logits(out.logits[:, -1], 1.0, None)
        torch.log_softmax(logits, dim=-1).gather(-1, logits.argmax(-1)[:, None])

    forwards = new_tokens - 1  # the last sampled token is never fed back
    with torch.no_grad():
        ids = torch.ones_like(mask)
        out = llm(
            input_ids=ids, attention_mask=mask, position_ids=positions(mask), past_key_values=cache, use_cache=True
        )
        done = 0
        while done < forwards:
            sample(out)
            if not every_step and done == 1 and forwards - done > 1:
                # Forwards 2 .. forwards-1 in one: the cache grows to its final length minus one.
                out = forward(forwards - done - 1, logits_to_keep=1)
                done = forwards - 1
                sample(out)
            out = forward(1)
            done += 1
        sample(out)


def lm_record(input_ids: Tensor, attention_mask: Tensor, gen_mask: Tensor, old_logp: Tensor) -> LMRecord:
    """The ``ar_decode`` record over the given tensors: (rows, prompt + generated) ids and mask, (rows,
    generated) mask of the generated tokens and their behavior log-probs."""
    rows, new_tokens = gen_mask.shape
    return LMRecord(
        input_ids=input_ids,
        attention_mask=attention_mask,
        prompt_len=input_ids.shape[1] - new_tokens,
        gen_mask=gen_mask,
        old_logp=old_logp,
        rows=torch.arange(rows),
        temperature=1.0,
        top_k=None,
        version=0,
    )


def text_encode(generator: torch.nn.Module, texts: int, sources: bool = False) -> Cond:
    """``generator.encode`` of one batch of ``texts`` texts (the feature cache encodes in fixed batches). With
    ``sources`` (an editing step) it also encodes one source image per text, made at the size the family resizes
    sources to (``source_size``, else the sample's), and that conditioning (the source latents, whose tokens
    lengthen every DiT forward) joins the text features', as the trainer merges them. A family whose text encoder
    reads the source too (``text_sees_source``: Qwen-Image-Edit-Plus's Qwen2.5-VL) encodes each text with its
    image, with the values of its inputs' index arithmetic carried (:meth:`AllRowsReal.carrying_values`: the image
    grid sets the vision tower's patches and windows and the prompt's count of image tokens)."""
    if not sources:
        return generator.encode(["a prompt"] * texts)
    height, width = getattr(generator, "source_size", None) or (generator.height, generator.width)
    images = [torch.rand(3, height, width) for _ in range(texts)]
    reads = getattr(generator, "text_sees_source", False)
    with carrying_values() if reads else nullcontext():
        cond = generator.encode(["a prompt"] * texts, images if reads else None)
        cond |= generator.encode_source(images)
    return cond


def noise_level(loop: DiffusionDenoise) -> float:
    """The generator algorithm's noise level (a likelihood-free algorithm has none: the SDE's default)."""
    level = getattr(loop.algorithm, "noise_level", None)
    return float(level(loop.config)) if callable(level) else 0.7


def dit_rollout_step(loop: DiffusionDenoise, cond: Cond, uncond: Cond | None) -> tuple[Tensor, Tensor]:
    """One SDE step of one rollout micro-batch (the rows of ``cond``), guided when the loop is: the
    (conditional and unconditional rows in one batch) velocity and the Flow-GRPO step with its log-prob."""
    rows = next(iter(cond.values())).shape[0]
    with torch.no_grad():
        x = torch.randn(rows, *loop.generator.latent_shape)
        v = loop.velocity(x, SIGMA, cond, uncond)
        x_next, logp, _, _ = flow_sde_step_with_logprob(
            x, v, SIGMA, SIGMA_NEXT, sigma_max=SIGMA_MAX, noise_level=noise_level(loop)
        )
    return x_next, logp


def dit_record(
    loop: DiffusionDenoise, prev: Tensor, sample: Tensor, old_logp: Tensor, cond: Cond, uncond: Cond | None
) -> PlanRecord:
    """The record of one SDE step of one micro-batch: ``prev``/``sample`` (rows, 1, *latent) and
    ``old_logp`` (rows, 1), in a fit slices of the step's whole record, as the recompute reads them."""
    return PlanRecord(
        prev=prev,
        sample=sample,
        sigma=torch.full((1,), SIGMA, dtype=torch.float64),
        sigma_next=torch.full((1,), SIGMA_NEXT, dtype=torch.float64),
        old_logp=old_logp,
        cond=cond,
        sigma_max=SIGMA_MAX,
        noise_level=noise_level(loop),
        chunks=[(0, prev.shape[0])],
        version=0,
        uncond=uncond,
    )


def dit_update(
    algorithm: Any,
    loop: DiffusionDenoise,
    record: DiTRecord,
    settings: ExpertLoss,
    reference: Callable,
    backward: Callable[[Tensor], None],
) -> LossOutput:
    """The DiT's update over ``record`` as ``PolicyLosses.loss`` runs it, through the recipe's generator
    algorithm (Flow-GRPO's ``drivers.dit_loss`` by default): per (step, micro-batch) the recompute with grad,
    the adapter-disabled reference forward when the KL is on, and ``backward``."""
    advantages = torch.zeros(record.old_logp.shape[0])
    algorithm.check_settings(settings)
    try:
        return algorithm.loss(LossInputs(loop, record, advantages, settings, reference), backward)
    except AttributeError as err:
        # A likelihood-free algorithm (DiffusionNFT) trains from a record of another kind.
        raise NotImplementedError(
            f"plan traces the SDE-step records of Flow-GRPO-style algorithms; {type(algorithm).__name__} reads "
            f"another record ({err})"
        ) from None


def lm_loss_forward(
    algorithm: Any,
    loop: ARDecode,
    record: LMRecord,
    settings: ExpertLoss,
    reference: Callable,
    backward: Callable[[Tensor], None],
) -> LossOutput:
    """The refiner's loss through the recipe's refiner algorithm (token GRPO's ``drivers.refiner_loss``
    by default). With ``rollout.lm_micro_batch_size`` each chunk is backpropagated through ``backward`` as it is
    built; without, the graph of the whole batch is kept for the backward (``backpropagated`` is False)."""
    advantages = torch.zeros(record.old_logp.shape[0])
    algorithm.check_settings(settings)
    return algorithm.loss(LossInputs(loop, record, advantages, settings, reference), backward)


def vae_decode(generator: torch.nn.Module, latents: Tensor) -> Tensor:
    """``generator.decode`` of the step's ``latents`` (the rollout decodes its whole batch in one call; the
    generator's ``vae_slicing`` makes the VAE run them one at a time).

    Sliced, the VAE's ``_decode`` runs once per sample on same-shaped inputs and frees its activations before
    the next, so the k-th decode peaks at the (k - 1) decoded samples plus one decode's activations: the last
    peaks highest. The first and the last are traced; the ones between stand in by their outputs (the same
    bytes they leave held), which keeps the peak and saves tracing dozens of identical decodes."""
    vae = getattr(generator, "vae", None)
    samples = latents.shape[0]
    if not (getattr(vae, "use_slicing", False) and samples > 2 and hasattr(vae, "_decode")):
        return generator.decode(latents)
    real = vae._decode
    calls, like = 0, None  # like: the first output's type and its sample's shape, dtype and device (no tensor held)

    def decode_slice(z: Tensor, *args: Any, **kwargs: Any) -> Any:
        nonlocal calls, like
        calls += 1
        if like is None or calls == samples:
            out = real(z, *args, **kwargs)
            sample = getattr(out, "sample", None)
            if like is None and isinstance(sample, Tensor):
                like = (type(out), sample.shape, sample.dtype, sample.device)
            return out
        kind, shape, dtype, device = like
        return kind(sample=torch.empty(shape, dtype=dtype, device=device))

    vae._decode = decode_slice
    try:
        return generator.decode(latents)
    finally:
        del vae._decode
