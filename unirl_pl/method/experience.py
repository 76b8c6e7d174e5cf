"""The experience source: one step's prompts -> rollout -> rewards -> advantages, as an :class:`Experience`.

It drives the loops in the ``rollout`` profile for the experts the mode trains (``serve`` for a frozen
expert that still runs), scores the images with the reward and turns rewards into advantages. The
DataModule only yields prompts; the LightningModule calls :meth:`ExperienceSource.collect` from its
``on_after_batch_transfer`` hook, so the gates see the experience before ``training_step``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from unirl_pl import timing
from unirl_pl.card import Loop
from unirl_pl.conditioning import Conditioner
from unirl_pl.data import PromptBatch
from unirl_pl.experts.chat import fallback_fraction
from unirl_pl.group_stats import zero_std_fraction
from unirl_pl.loops import ARDecode, DiffusionDenoise, Profile
from unirl_pl.method.advantages import AdvantageConfig, compute_advantages, text_advantages
from unirl_pl.records import Experience, LMRecord
from unirl_pl.rewards import WeightedSum
from unirl_pl.rewards.metadata import Metadata, accepts_keyword, accepts_metadata
from unirl_pl.rewards.overlap import decode_while_scoring, remote_terms
from unirl_pl.rewards.replies import Reply, accepts_replies
from unirl_pl.versioning import VersionLedger


@dataclass
class ExperienceSource:
    """Everything one step's rollout needs, bound once the experts are built.

    Args:
        ar_decode: The refiner loop, or None when the mode never runs it.
        diffusion_denoise: The generator loop.
        conditioning: Text features (versioned cache), the unconditional branch and decoding.
        reward: The weighted reward.
        advantages: The advantage scheme.
        ledger: Weight versions (stamped on every record).
        trained: Loop name -> whether its experts are trained (``rollout`` profile and a record) or
            frozen (``serve`` profile, no record).
        owners: Loop name -> the component whose version stamps its records.
        batch_std: The global batch's reward std across ranks (None on one process).
        drop_nonfinite: Replace non-finite rewards by their group's mean (advantage 0) instead of letting
            them reach the loss (whose non-finite value then skips the step).
        refiner_groups: Which prompt groups the refiner trains on, from every text sample's reward and
            group (its algorithm's ``train_groups``; None: all).
        refiner_rewards: The rewards the refiner's advantages come from, from every text sample's reward and
            the refiner's record (its algorithm's ``shape_rewards``: DAPO's overlong penalty; None, or a None
            result: the reward). The generator's advantages never see them.
    """

    ar_decode: ARDecode | None
    diffusion_denoise: DiffusionDenoise
    conditioning: Conditioner
    reward: WeightedSum
    advantages: AdvantageConfig
    ledger: VersionLedger
    trained: dict[str, bool]
    owners: dict[str, str]
    batch_std: Callable[[Tensor], Tensor | None]
    drop_nonfinite: bool = False
    refiner_groups: Callable[[Tensor, Tensor], Tensor | None] | None = None
    refiner_rewards: Callable[[Tensor, LMRecord], Tensor | None] | None = None

    def __post_init__(self) -> None:
        # Remote reward terms are scored while the rest of the batch decodes (rewards/overlap.py). Read
        # once here, from the WeightedSum itself.
        names, self._chunk = remote_terms(getattr(self.reward, "terms", {}))
        self._remote = {name: partial(self.reward.score_term, name) for name in names}
        self._normalizes = getattr(self.reward, "normalize", "none") == "group"
        # Prompt metadata goes only to a reward that declares it (WeightedSum does, and hands it on to the terms
        # that declare it); the signature is read once.
        self._takes_metadata = accepts_metadata(self.reward)
        self._takes_replies = accepts_replies(self.reward)
        self._takes_sources = accepts_keyword(self.reward, "sources")

    def _decode_and_score(
        self,
        latents: Tensor,
        prompts: list[str],
        refined: list[str],
        groups: Tensor,
        metadata: list[Metadata] | None = None,
        replies: list[Reply] | None = None,
        sources: list[Tensor] | None = None,
    ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """(images, total reward, raw terms); remote terms' requests overlap the decode of later micro-batches."""
        extra: dict = {"groups": groups, "batch_std": self.batch_std} if self._normalizes else {}
        if metadata is not None and self._takes_metadata:
            extra["metadata"] = metadata
        if replies is not None and self._takes_replies:
            extra["replies"] = replies
        if sources is not None and self._takes_sources:
            extra["sources"] = sources
        if self._remote and self._chunk is not None and self._chunk < latents.shape[0]:
            images, extra["pending"] = decode_while_scoring(
                self.conditioning.decode,
                latents,
                self._chunk,
                self._remote,
                prompts,
                refined,
                metadata=extra.get("metadata"),
                replies=extra.get("replies"),
                sources=extra.get("sources"),
            )
        else:
            images = self.conditioning.decode(latents)
        # Only what is needed goes as keywords: any reward(prompts, refined, images) still fits here.
        with timing.phase("reward"):
            rewards, parts = self.reward(prompts, refined, images, **extra)
        return images, rewards, parts

    def _profile(self, loop: str) -> Profile:
        return "rollout" if self.trained.get(loop) else "serve"

    def refine(self, batch: PromptBatch) -> tuple[list[str], list[int], LMRecord | None]:
        """Every text sample of the batch (refined or original), the refined rows, and the LM record."""
        layout, p = batch.layout, len(batch.prompts)
        k = layout.samples_per_prompt
        texts = [q for q in batch.prompts for _ in range(k)]
        rows = layout.refined_rows(p, refine=self.ar_decode is not None)
        if not rows:
            return texts, rows, None
        assert self.ar_decode is not None
        req = [batch.request_ids[i // k] for i in rows]
        idx = [layout.text_sample_index(p)[i] for i in rows]
        # An edit's refiner sees each prompt's source image when it can (a VLM refiner with its image processor);
        # a text refiner rewrites the instruction alone.
        sees = batch.sources is not None and getattr(self.ar_decode.llm, "sees_images", False)
        images = {"images": [batch.sources[i // k].pixels for i in rows]} if sees else {}  # type: ignore[index]
        with timing.phase("decode"):
            refined_rows, record = self.ar_decode.sample(
                [texts[i] for i in rows],
                req,
                idx,
                self._profile(Loop.DECODE),
                seed=batch.seed,
                version=self.ledger[self.owners[Loop.DECODE]],
                **images,
            )
        refined = list(texts)
        for i, text in zip(rows, refined_rows, strict=True):
            refined[i] = text
        record.rows = torch.as_tensor(rows, dtype=torch.long)
        return refined, rows, record

    def _refiner_rows(
        self, record: LMRecord, advantages: Tensor, text_rewards: Tensor, groups: Tensor
    ) -> tuple[LMRecord, Tensor]:
        """The record rows (and their advantages) of the groups the refiner algorithm trains on."""
        keep = self.refiner_groups(text_rewards, groups) if self.refiner_groups is not None else None
        if keep is None:
            return record, advantages
        rows = keep[groups[record.rows]].nonzero().flatten()
        return record.take(rows), advantages[rows.to(advantages.device)]

    @timing.timed("rollout_glue")
    @torch.no_grad()
    def collect(self, batch: PromptBatch, device: torch.device) -> Experience:
        """Rollout for one step: refine, render, score, and compute advantages."""
        layout, p = batch.layout, len(batch.prompts)
        refined, rows, lm_record = self.refine(batch)
        img_text = layout.image_text(p)
        k = layout.samples_per_prompt
        image_texts = [refined[t] for t in img_text.tolist()]
        # Each image's source (an edit), by the same image -> text sample -> prompt map as its prompt.
        sources = None if batch.sources is None else [batch.sources[t // k] for t in img_text.tolist()]
        cond = self.conditioning.encode(image_texts, sources)
        uncond = self.conditioning.uncond(self.diffusion_denoise.config.guided)
        with timing.phase("denoise"):
            latents, dit_record = self.diffusion_denoise.sample(
                cond,
                [batch.request_ids[t // k] for t in img_text.tolist()],
                layout.image_sample_index(p),
                self._profile(Loop.DENOISE),
                seed=batch.seed,
                version=self.ledger[self.owners[Loop.DENOISE]],
                uncond=uncond,
            )
        originals = [batch.prompts[t // k] for t in img_text.tolist()]
        # Each image gets its prompt's metadata, by the same image -> text sample -> prompt map as its prompt.
        metadata = None if batch.metadata is None else [batch.metadata[t // k] for t in img_text.tolist()]
        groups = layout.text_prompt(p)[img_text]
        # Each image gets the raw reply of its text sample; None where the text sample kept its prompt.
        text_replies: list[Reply] = [None] * len(refined)
        for row, reply in zip(rows, lm_record.replies if lm_record is not None else [], strict=False):
            text_replies[row] = reply
        replies = [text_replies[t] for t in img_text.tolist()]
        pixels = None if sources is None else [source.pixels for source in sources]
        images, rewards, parts = self._decode_and_score(
            latents, originals, image_texts, groups, metadata, replies, pixels
        )
        # Advantages come from the combined reward (group-normalized terms when the reward normalizes);
        # the logged reward stays the raw weighted sum.
        with timing.phase("advantages"):
            text_rewards, text_adv, image_adv, dropped = compute_advantages(
                getattr(parts, "combined", rewards),
                layout,
                p,
                self.advantages,
                self.batch_std,
                drop_nonfinite=self.drop_nonfinite,
            )
        advantages = {Loop.DENOISE: image_adv.to(device)}
        if rows:
            shaped = None
            if self.refiner_rewards is not None and lm_record is not None:
                shaped = self.refiner_rewards(text_rewards, lm_record)
            if shaped is not None:  # the refiner's own advantages; image_adv (maybe the same tensor) is kept
                text_adv = text_advantages(shaped, layout, p, self.advantages, self.batch_std, dropped)
            advantages[Loop.DECODE] = text_adv[rows].to(device)
        records: dict = {}
        if lm_record is not None and self.trained.get(Loop.DECODE):
            records[Loop.DECODE], advantages[Loop.DECODE] = self._refiner_rows(
                lm_record, advantages[Loop.DECODE], text_rewards, layout.text_prompt(p)
            )
        if dit_record is not None:
            records[Loop.DENOISE] = dit_record
        # Each record row's prompt group, by its request id: mini-batches keep groups whole.
        image_requests = torch.as_tensor([batch.request_ids[t // k] for t in img_text.tolist()], dtype=torch.long)
        row_requests = {Loop.DENOISE: image_requests}
        if Loop.DECODE in records:
            text_requests = torch.as_tensor(batch.request_ids, dtype=torch.long).repeat_interleave(k)
            row_requests[Loop.DECODE] = text_requests[records[Loop.DECODE].rows]
        fell_back = lm_record.fell_back if lm_record is not None else []
        return Experience(
            prompts=originals,
            refined=image_texts,
            text_index=img_text,
            rewards=torch.where(dropped, torch.nan, rewards).to(device),
            dropped=int(dropped.sum()),
            text_rewards=text_rewards.to(device),
            records=records,
            advantages=advantages,
            reward_parts=dict(parts),
            count_unscored=self.drop_nonfinite,
            zero_std_frac=zero_std_fraction(text_rewards, layout.text_prompt(p)),
            images=images,
            fallback_frac=fallback_fraction(fell_back) if fell_back else None,  # no refinements: no metric
            image_advantages=image_adv.to(device),
            seed=batch.seed,
            row_requests=row_requests,
        )
