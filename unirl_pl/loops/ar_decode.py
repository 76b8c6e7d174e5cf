"""``ar_decode``: the refiner's token loop, sampled in a profile and re-scored for training.

Rollout samples token by token with a KV cache and records each token's log-prob under the exact
sampling distribution (temperature and top-k applied). ``score`` (the ``train`` profile) recomputes the
same log-probs teacher-forced under the current weights, with the record's own mask, positions and
sampling settings: any of these differing from rollout would bias the PPO ratio, which the C2 gate
catches. Only generated tokens are recorded and scored; the prompt (and any chat template around it)
is context.

A refiner that sees images (a VLM with its image processor) may be asked with a source image per row: the
request holds the image's placeholder tokens, the prefill reads the image processor's ``pixel_values`` at the
model's multimodal RoPE positions, and each generated token continues its row from the last position + 1 (as
the model's own ``generate`` does with its ``rope_deltas``). The record keeps each row's image so the
re-score reads the same inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import Tensor
from transformers import DynamicCache

from unirl_pl.distributed import agree_max
from unirl_pl.loops.config import Profile, RolloutConfig, chunk_bounds
from unirl_pl.records import LMRecord, vision_batch
from unirl_pl.seeding import STREAM_LM, gumbel_argmax, sample_keys


def process_logits(logits: Tensor, temperature: float, top_k: int | None) -> Tensor:
    """The sampling distribution's logits: divided by temperature, all but the top-k set to -inf."""
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return logits


def positions(mask: Tensor) -> Tensor:
    """Position ids of a left-padded batch: counting starts at each row's first real token."""
    return (mask.long().cumsum(-1) - 1).clamp_min(0)


def check_images(llm: Any, images: Sequence[Tensor | None] | None, n: int) -> bool:
    """Whether any of ``images`` (one per prompt, or None) is a source image the refiner ``llm`` is to see.

    Raises ``ValueError`` (one line, naming the setting) when a row has an image and the refiner cannot see
    it: a text-only refiner, or a VLM refiner without its image processor (``load_image_processor``).
    """
    if images is None:
        return False
    if len(images) != n:
        raise ValueError(f"ar_decode got {len(images)} source images for {n} prompts: give one per prompt (or None)")
    if all(image is None for image in images):
        return False
    sees = getattr(llm, "sees_images", None)
    if sees is None:
        raise ValueError(
            f"the refiner {type(llm).__name__} is text-only and cannot see source images: set model.llm to a "
            "VLMRefinerExpert with load_image_processor: true"
        )
    if not sees:
        raise ValueError(
            f"the refiner {type(llm).__name__} was given source images but load_image_processor is false: "
            "set load_image_processor: true for it to see them"
        )
    return True


def _vision(
    pixel_values: list[Tensor | None], grids: list[Tensor | None], device: torch.device
) -> tuple[list[Tensor | None], list[Tensor | None]]:
    """Each row's image inputs on ``device``; a tensor shared by several rows is moved once and stays shared."""
    moved: dict[int, Tensor] = {}

    def to(t: Tensor | None) -> Tensor | None:
        if t is None:
            return None
        if id(t) not in moved:
            moved[id(t)] = t.to(device)
        return moved[id(t)]

    return [to(p) for p in pixel_values], [to(g) for g in grids]


class ARDecode:
    """The ``ar_decode`` loop over one causal-LM expert (anything with ``stop_token_ids``, ``pad_token_id``,
    ``reply_texts``, ``parse_replies``, ``tokenize_requests`` and a
    ``forward(input_ids, attention_mask, position_ids, past_key_values, use_cache)``). A refiner that sees
    images (``sees_images`` true) also takes ``tokenize_requests(prompts, images=...)``, ``rope_positions`` and
    ``pixel_values``/``image_grid_thw`` in its forward (:class:`~unirl_pl.experts.vlm.VLMRefinerExpert`).

    Args:
        llm: The refiner expert.
        config: Sampling settings (``max_new_tokens``, ``temperature``, ``top_k``).
    """

    def __init__(self, llm: Any, config: RolloutConfig) -> None:
        self.llm, self.config = llm, config

    @torch.no_grad()
    def sample(
        self,
        prompts: Sequence[str],
        request_ids: Sequence[int],
        sample_indices: Sequence[int],
        profile: Profile,
        *,
        seed: int,
        version: int = 0,
        images: Sequence[Tensor | None] | None = None,
    ) -> tuple[list[str], LMRecord]:
        """Refine each prompt: ``serve`` decodes greedily, ``rollout`` samples; both return the record.

        Each sample's tokens come from counter-based noise keyed by (seed, request, sample, position)
        (:mod:`unirl_pl.seeding`), drawn for the whole batch in one call, so they do not depend on the
        batch. The loop stops when every sequence on every rank has ended.

        ``images`` (aligned with ``prompts``) holds each row's source image, a float32 (3, H, W) tensor in
        [0, 1], or None for a row asked with text only; a refiner that cannot see images refuses any
        (``ValueError``). A row's image is preprocessed alone, so its tokens do not depend on the batch either.
        """
        cfg, llm = self.config, self.llm
        device = next(llm.parameters()).device
        seeing = check_images(llm, images, len(prompts))
        if seeing:
            enc = llm.tokenize_requests(list(prompts), images=list(cast(Sequence, images)))
        else:
            enc = llm.tokenize_requests(list(prompts))
        ids, mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)
        n, prompt_len = ids.shape
        greedy = profile == "serve"
        temperature = 1.0 if greedy else cfg.temperature
        top_k = None if greedy else cfg.top_k
        keys = sample_keys(seed, request_ids, sample_indices, STREAM_LM, device)
        stops, pad = torch.tensor(llm.stop_token_ids, device=device), llm.pad_token_id

        pixel_rows, grid_rows = _vision(enc["pixel_values"], enc["image_grid_thw"], device) if seeing else ([], [])
        vision = vision_batch(pixel_rows, grid_rows)
        cache = DynamicCache()
        if vision is None:
            pos = positions(mask)
            out = llm(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
        else:
            # (3, N, L) multimodal positions; every generated token continues its row from the last one + 1.
            pos = llm.rope_positions(ids, mask, vision[1])
            out = llm(
                input_ids=ids,
                attention_mask=mask,
                position_ids=pos,
                past_key_values=cache,
                use_cache=True,
                pixel_values=vision[0],
                image_grid_thw=vision[1],
            )
        next_pos = pos[..., -1:] + 1
        finished = torch.zeros(n, dtype=torch.bool, device=device)
        tokens, logps, live = [], [], []
        for step in range(cfg.max_new_tokens):
            logits = process_logits(out.logits[:, -1], temperature, top_k)
            logp_all = torch.log_softmax(logits, dim=-1)
            # One batched draw whose per-row result does not depend on the batch (keyed by sample and position).
            tok_t = logits.argmax(-1) if greedy else gumbel_argmax(logits, keys, step)
            tok_t = torch.where(finished, torch.full_like(tok_t, pad), tok_t)
            live.append(~finished)
            logps.append(logp_all.gather(-1, tok_t[:, None])[:, 0])
            tokens.append(tok_t)
            finished = finished | torch.isin(tok_t, stops)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            # Stop only when every rank's sequences have ended: sharded forwards must stay in step.
            if step == cfg.max_new_tokens - 1 or not agree_max(int(not bool(finished.all())), device):
                break
            out = llm(
                input_ids=tok_t[:, None],
                attention_mask=mask,
                position_ids=next_pos,
                past_key_values=cache,
                use_cache=True,
            )
            next_pos = next_pos + 1
        gen = torch.stack(tokens, dim=1)
        gen_mask = torch.stack(live, dim=1)
        # A finished row's pad token may lie outside the top-k (log-prob -inf): zero it with a where, never a
        # product with the mask (-inf * 0 is NaN, and a NaN behavior log-prob makes the refiner's loss NaN).
        logp = torch.stack(logps, dim=1)
        record = LMRecord(
            input_ids=torch.cat([ids, gen], dim=1),
            attention_mask=mask,
            prompt_len=prompt_len,
            gen_mask=gen_mask,
            old_logp=torch.where(gen_mask, logp, torch.zeros_like(logp)),
            rows=torch.arange(n),
            temperature=temperature,
            top_k=top_k,
            version=version,
            pixel_values=pixel_rows,
            image_grid_thw=grid_rows,
        )
        replies = llm.reply_texts(gen, gen_mask)
        texts, record.fell_back = llm.parse_replies(replies, list(prompts))
        record.replies = replies
        return texts, record

    def score(self, record: LMRecord) -> Tensor:
        """Teacher-forced log-probs of the recorded tokens under the current weights, (R, T), zero where masked.

        Without grad (the gates' recompute, the reference) it runs ``config.lm_micro_batch_size`` rows per
        forward, so only one chunk's logits exist at a time; with grad the caller chunks (the loss backpropagates
        each chunk before building the next).
        """
        bounds = chunk_bounds(record.input_ids.shape[0], self.config.lm_micro_batch_size)
        if len(bounds) > 1 and not torch.is_grad_enabled():
            return torch.cat([self._score(record.slice(a, b)) for a, b in bounds])
        return self._score(record)

    def _score(self, record: LMRecord) -> Tensor:
        mask, p = record.attention_mask, record.prompt_len
        vision = record.vision_inputs()
        if vision is None:
            out = self.llm(input_ids=record.input_ids, attention_mask=mask, position_ids=positions(mask))
            logits = out.logits[:, p - 1 : -1]
        else:
            logits = self._image_logits(record, *vision)
        logits = process_logits(logits, record.temperature, record.top_k)
        logp = torch.log_softmax(logits, dim=-1).gather(-1, record.gen_ids[..., None])[..., 0]
        # A where, not a product: a pad token outside the top-k is -inf here, and -inf * 0 is NaN.
        return torch.where(record.gen_mask, logp, torch.zeros_like(logp))

    def _image_logits(self, record: LMRecord, pixel_values: Tensor, grids: Tensor) -> Tensor:
        """The logits that predict each generated token of a record whose rows saw images, (R, T, vocab).

        As the rollout read them: the requests with their images at the model's multimodal positions, then the
        generated tokens (text, whatever their ids) each at its row's last position + 1, + 2, ... A generated
        token may be the image placeholder's id, which the model would take for an image slot if it came in the
        same forward as ``pixel_values``, so the requests fill a KV cache first and the generated tokens follow
        through it (gradients flow through the cache as through one forward).
        """
        llm, p = self.llm, record.prompt_len
        ids, mask = record.input_ids, record.attention_mask
        pos = llm.rope_positions(ids[:, :p], mask[:, :p], grids)
        cache = DynamicCache()
        head = llm(
            input_ids=ids[:, :p],
            attention_mask=mask[:, :p],
            position_ids=pos,
            past_key_values=cache,
            use_cache=True,
            pixel_values=pixel_values,
            image_grid_thw=grids,
        )
        steps = ids.shape[1] - p - 1  # the last generated token predicts nothing that is scored
        if steps == 0:
            return head.logits[:, -1:]
        step_pos = pos[..., -1:] + torch.arange(1, steps + 1, device=pos.device)
        tail = llm(
            input_ids=ids[:, p : p + steps],
            attention_mask=mask[:, : p + steps],
            position_ids=step_pos,
            past_key_values=cache,
            use_cache=True,
        )
        return torch.cat([head.logits[:, -1:], tail.logits], dim=1)
