"""Supervised fine-tuning of the prompt refiner on (paraphrase -> canonical caption) pairs."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from unirl_pl.experts._common import seeded_cpu_init
from unirl_pl.experts.llm import TinyCausalLMExpert
from unirl_pl.lazy_defaults import lazy_default
from unirl_pl.loops import ARDecode, RolloutConfig
from unirl_pl.manifest import write_manifest
from unirl_pl.pretrain.common import warmup_cosine, weights_sha256
from unirl_pl.pretrain.vocab import VOCABULARIES, build_shapes_tokenizer
from unirl_pl.shapes.edit_prompts import parse_instruction
from unirl_pl.shapes.scenes import parse_caption
from unirl_pl.threads import set_threads

IGNORE = -100


def sft_batch(tokenizer: Any, prompts: list[str], captions: list[str]) -> dict[str, Tensor]:
    """Right-padded ``prompt + caption + eos`` sequences with labels only on the caption and eos.

    No separator goes between prompt and caption because the RL rollout feeds the bare prompt and
    samples the continuation; training must see the exact context the policy will be asked to extend.
    """
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    rows, labels = [], []
    for prompt, cap in zip(prompts, captions, strict=True):
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        c = [*tokenizer(cap, add_special_tokens=False)["input_ids"], eos]
        rows.append(p + c)
        labels.append([IGNORE] * len(p) + c)
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    lab = torch.tensor([r + [IGNORE] * (width - len(r)) for r in labels])
    return {"input_ids": ids, "attention_mask": mask, "labels": lab}


def _parses(text: str, vocabulary: str = "scenes") -> bool:
    try:
        parse_caption(text) if vocabulary == "scenes" else parse_instruction(text)
    except ValueError:
        return False
    return True


class RefinerSFT(pl.LightningModule):
    """Full-weight supervised fine-tuning of the tiny causal-LM refiner (no LoRA).

    The model is the tiny Qwen2 that ``llm`` describes, over the ShapesWorld word tokenizer. The loss
    is next-token cross-entropy on the canonical caption and its end token only; the user prompt is
    context. Data are train-split paraphrases, so held-out synonyms and templates stay unseen and the
    refiner is only partly right on held-out prompts, which leaves RL something to improve.
    Validation decodes greedily with the ``ar_decode`` loop's ``serve`` profile (the RL serve path) and
    logs exact-match and parse rates. At fit end model and tokenizer are saved with
    ``save_pretrained`` to ``export_dir/refiner``.

    Args:
        llm: Describes the LM (tiny-model fields only; LoRA fields are ignored).
        lr: Peak AdamW learning rate.
        weight_decay: AdamW weight decay.
        warmup_steps: Linear warmup steps before the cosine decay.
        lr_floor: Final lr as a fraction of ``lr`` at ``trainer.max_steps``.
        max_new_tokens: Longest greedy refinement at validation.
        num_threads: Torch intra-op threads for this process (None: torch's default); 1 avoids
            OpenMP spin-waiting on a CPU shared with other jobs.
        export_dir: Folder to write ``refiner/`` to at fit end (None: no export).
        fingerprint_every: Record the SHA-256 of the weights after every this many optimizer steps (0: never) and
            export them as ``refiner/fingerprints.json``, so a short run can be checked against a long one inside
            the warmup, whose learning rates do not depend on ``trainer.max_steps``.
        vocabulary: The word tokenizer's words: ``scenes`` (scene prompts and captions) or ``edits`` (those and
            the ShapesWorld-Edit instruction words); validation's parse rate parses captions or instructions.
    """

    def __init__(
        self,
        llm: TinyCausalLMExpert = lazy_default(TinyCausalLMExpert),
        lr: float = 3e-3,
        weight_decay: float = 0.0,
        warmup_steps: int = 50,
        lr_floor: float = 0.05,
        max_new_tokens: int = 12,
        num_threads: int | None = None,
        export_dir: str | None = None,
        vocabulary: str = "scenes",
        fingerprint_every: int = 0,
    ) -> None:
        super().__init__()
        if num_threads is not None:
            set_threads(num_threads)
        if vocabulary not in VOCABULARIES:
            raise ValueError(f"vocabulary must be one of {sorted(VOCABULARIES)}, got {vocabulary!r}")
        self.vocabulary = vocabulary
        self.fingerprint_every = fingerprint_every
        self.fingerprints: dict[str, str] = {}
        self.llm = llm
        self.lr, self.weight_decay = lr, weight_decay
        self.warmup_steps, self.lr_floor = warmup_steps, lr_floor
        self.max_new_tokens = max_new_tokens
        self.export_dir = export_dir

    def configure_model(self) -> None:
        if self.llm.model is not None:
            return
        tokenizer = build_shapes_tokenizer("left", self.vocabulary)
        with seeded_cpu_init(self.llm.init_seed):
            # The expert's own tiny config, so the exported model is what the RL run would have built.
            model = self.llm._base_model(tokenizer)
        self.llm.tokenizer = tokenizer
        self.llm.model = model
        # ``build()`` would pick the cache argument name; transformers 5 warns on the old one every call.
        params = inspect.signature(model.forward).parameters
        self.llm._cache_arg_name = "cache" if "cache" in params else "past_key_values"

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        enc = {
            k: v.to(self.device) for k, v in sft_batch(self.llm.tokenizer, batch["prompts"], batch["captions"]).items()
        }
        logits = self.llm(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), enc["labels"][:, 1:].flatten(), ignore_index=IGNORE
        )
        self.log("train/loss", loss, prog_bar=True, batch_size=len(batch["prompts"]))
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.fingerprint_every and self.global_step % self.fingerprint_every == 0:
            self.fingerprints[str(self.global_step)] = weights_sha256(list(self.llm.parameters()))

    @torch.no_grad()
    def refine(self, prompts: list[str]) -> list[str]:
        """Greedy refinements of ``prompts`` through the ``ar_decode`` loop's ``serve`` profile."""
        loop = ARDecode(self.llm, RolloutConfig(max_new_tokens=self.max_new_tokens))
        texts, _ = loop.sample(prompts, list(range(len(prompts))), [0] * len(prompts), "serve", seed=0)
        return texts

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        refined = self.refine(batch["prompts"])
        n = len(refined)
        exact = sum(r == c for r, c in zip(refined, batch["captions"], strict=True)) / n
        self.log("val/exact_match", exact, batch_size=n, prog_bar=True)
        self.log("val/parse_rate", sum(_parses(r, self.vocabulary) for r in refined) / n, batch_size=n)

    def configure_optimizers(self) -> dict[str, Any]:
        opt = torch.optim.AdamW(self.llm.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        total = self.trainer.max_steps if self.trainer.max_steps > 0 else 10_000
        sched = warmup_cosine(opt, self.warmup_steps, total, self.lr_floor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_fit_end(self) -> None:
        if self.export_dir is not None and self.trainer.is_global_zero:
            self.export(self.export_dir)

    def export(self, export_dir: str | Path) -> None:
        """Save the LM and its tokenizer to ``export_dir/refiner`` (loadable by ``CausalLMExpert``), with the
        folder's ``MANIFEST.sha256``."""
        path = Path(export_dir) / "refiner"
        self.llm.model.save_pretrained(path)
        self.llm.tokenizer.save_pretrained(path)
        if self.fingerprints:
            text = json.dumps({"trained_weights_sha256_after_step": self.fingerprints}, indent=1)
            (path / "fingerprints.json").write_text(text + "\n")
        write_manifest(path)  # checked when CausalLMExpert loads it (unirl_pl.manifest)
