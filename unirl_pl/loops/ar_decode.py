"""``ar_decode``: the refiner's token loop, sampled in a profile and re-scored for training.

Rollout samples token by token with a KV cache and records each token's log-prob under the exact
sampling distribution (temperature and top-k applied). ``score`` (the ``train`` profile) recomputes the
same log-probs teacher-forced under the current weights, with the record's own mask, positions and
sampling settings: any of these differing from rollout would bias the PPO ratio, which the C2 gate
catches. Only generated tokens are recorded and scored; the prompt (and any chat template around it)
is context.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from transformers import DynamicCache

from unirl_pl.distributed import agree_max
from unirl_pl.loops.config import Profile, RolloutConfig, chunk_bounds
from unirl_pl.records import LMRecord
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


class ARDecode:
    """The ``ar_decode`` loop over one causal-LM expert (anything with ``stop_token_ids``, ``pad_token_id``,
    ``reply_texts``, ``parse_replies``, ``tokenize_requests`` and a
    ``forward(input_ids, attention_mask, position_ids, past_key_values, use_cache)``).

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
    ) -> tuple[list[str], LMRecord]:
        """Refine each prompt: ``serve`` decodes greedily, ``rollout`` samples; both return the record.

        Each sample's tokens come from counter-based noise keyed by (seed, request, sample, position)
        (:mod:`unirl_pl.seeding`), drawn for the whole batch in one call, so they do not depend on the
        batch. The loop stops when every sequence on every rank has ended.
        """
        cfg, llm = self.config, self.llm
        device = next(llm.parameters()).device
        enc = llm.tokenize_requests(list(prompts))
        ids, mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)
        n, prompt_len = ids.shape
        greedy = profile == "serve"
        temperature = 1.0 if greedy else cfg.temperature
        top_k = None if greedy else cfg.top_k
        keys = sample_keys(seed, request_ids, sample_indices, STREAM_LM, device)
        stops, pad = torch.tensor(llm.stop_token_ids, device=device), llm.pad_token_id

        cache = DynamicCache()
        out = llm(
            input_ids=ids, attention_mask=mask, position_ids=positions(mask), past_key_values=cache, use_cache=True
        )
        next_pos = positions(mask)[:, -1:] + 1
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
        mask = record.attention_mask
        out = self.llm(input_ids=record.input_ids, attention_mask=mask, position_ids=positions(mask))
        p = record.prompt_len
        logits = process_logits(out.logits[:, p - 1 : -1], record.temperature, record.top_k)
        logp = torch.log_softmax(logits, dim=-1).gather(-1, record.gen_ids[..., None])[..., 0]
        # A where, not a product: a pad token outside the top-k is -inf here, and -inf * 0 is NaN.
        return torch.where(record.gen_mask, logp, torch.zeros_like(logp))
