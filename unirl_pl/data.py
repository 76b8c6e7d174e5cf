"""Prompt sources and the DataModule: which prompts each step, validation and prediction see.

The DataModule yields :class:`PromptBatch` es: P prompts per step, sharded by rank, in an order
that is a pure function of (seed, step). During ``fit`` the LightningModule hands each batch to its
experience source (:mod:`unirl_pl.method.experience`), which runs the rollout and returns an
:class:`~unirl_pl.records.Experience`; ``training_step`` and the gates see that experience.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from unirl_pl.errors import InputError
from unirl_pl.layout import GroupLayout, check_prompt_counts
from unirl_pl.manifest import verify_assets
from unirl_pl.source_images import SourceImage, load_sources

DEFAULT_PROMPTS = (
    "a red circle",
    "a blue square",
    "a green triangle",
    "two yellow circles",
    "a purple square left of an orange circle",
    "three red triangles",
    "a blue circle above a green square",
    "an orange triangle",
)
DEFAULT_VAL_PROMPTS = ("a green circle", "two blue triangles", "a red square below a yellow circle", "a purple circle")

# A prompt's metadata: its whole JSONL row when the row holds more than "prompt" (GenEval's "tag" and
# "include"), else None. Rewards that declare a ``metadata`` parameter get it per sample.
PromptMeta = dict[str, Any] | None


def load_prompts(source: str | list[str] | None, default: tuple[str, ...] = DEFAULT_PROMPTS) -> list[str]:
    """Prompts from a list, a ``.txt`` file (one per line) or a ``.jsonl`` file (``{"prompt": ...}`` rows).

    ``None`` gives the embedded default set. Blank lines are skipped; a JSONL row whose ``prompt`` is
    missing, not a string or blank is an error naming the file and line, and so is a line that is not
    UTF-8. A missing file, a file or list without prompts, and a list item that is not a string are errors.
    A prompt file shipped in ``unirl_pl/assets`` must match ``MANIFEST.sha256``.
    """
    return load_prompt_records(source, default)[0]


def load_prompt_records(
    source: str | list[str] | None, default: tuple[str, ...] = DEFAULT_PROMPTS
) -> tuple[list[str], list[PromptMeta] | None]:
    """The prompts as :func:`load_prompts` reads them, and each prompt's metadata (aligned with them).

    A ``.jsonl`` row with fields besides ``"prompt"`` (GenEval's ``{"tag", "include", "prompt"}``) is kept
    whole as its prompt's metadata; a row with only ``"prompt"`` gives None. The metadata list is None when
    no prompt has any (``.txt`` files, inline lists, the embedded sets), so such runs are unchanged.
    """
    if source is None:
        return list(default), None
    if isinstance(source, (list, tuple)):
        bad = [(i, item) for i, item in enumerate(source) if not isinstance(item, str)]
        if bad:
            i, item = bad[0]
            raise ValueError(f"prompt list item {i} is {item!r} (type {type(item).__name__}), not a string")
        prompts = [p.strip() for p in source if p.strip()]
        if not prompts:
            raise ValueError("the prompt list is empty (or holds only blank strings)")
        return prompts, None
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {str(path)!r} does not exist")
    verify_assets(path)  # a shipped prompt file (unirl_pl/assets) must match its manifest hash; others pass
    prompts, metadata = [], []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                # A pickle starts with 0x80; other binary files hold NUL bytes: say so, not "save as UTF-8".
                binary = b"\0" in raw or (lineno == 1 and raw[:1] == b"\x80")
                hint = "a binary file (a pickle?), not prompts" if binary else "save the prompt file as UTF-8"
                raise InputError(
                    f"{path}:{lineno}: not UTF-8 text (byte {raw[err.start]:#04x} at column {err.start + 1}); {hint}"
                ) from None
            if lineno == 1:
                line = line.removeprefix("\ufeff")  # a UTF-8 byte-order mark
            if not line.strip():
                continue
            if path.suffix == ".jsonl":
                prompt, meta = _jsonl_prompt(path, lineno, line)
            else:
                prompt, meta = line.strip(), None
            prompts.append(prompt)
            metadata.append(meta)
    if not prompts:
        raise ValueError(f"prompt file {str(path)!r} holds no prompts (it is empty or all lines are blank)")
    return prompts, metadata if any(m is not None for m in metadata) else None


def _jsonl_prompt(path: Path, lineno: int, line: str) -> tuple[str, PromptMeta]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise InputError(f"{path}:{lineno}: not valid JSON ({err.msg}, column {err.colno})") from None
    if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
        raise ValueError(f"{path}:{lineno}: each JSONL row needs a string field 'prompt'")
    prompt = row["prompt"].strip()
    if not prompt:
        raise ValueError(f"{path}:{lineno}: the 'prompt' field is empty; remove the row or give it a prompt")
    # The whole row, as GenEval's scorer reads it (its "prompt" included); nothing more to say: None.
    return prompt, row if len(row) > 1 else None


@dataclass
class PromptBatch:
    """P prompts of one step on this rank, with their global request ids (seed the samples' randomness).

    ``num_real`` counts the leading prompts that are real; the rest pad an evaluation shard so every rank
    runs the same number of batches (None: all are real). ``seed`` seeds every sample's randomness with
    the request ids; ``layout`` says how many samples each prompt gets. ``metadata`` is each prompt's
    metadata (its JSONL row, or None), aligned with ``prompts``; None when the prompt file has none.
    ``sources`` is each prompt's source image (an editing prompt file), aligned with ``prompts``; None without.
    """

    prompts: list[str]
    request_ids: list[int]
    num_real: int | None = None
    seed: int = 0
    layout: GroupLayout = field(default_factory=GroupLayout)
    metadata: list[PromptMeta] | None = None
    sources: list[SourceImage] | None = None

    @property
    def real(self) -> int:
        """How many leading prompts are real (not shard padding)."""
        return len(self.prompts) if self.num_real is None else self.num_real

    @property
    def real_sources(self) -> list[SourceImage] | None:
        """The real prompts' source images (an edit's), or None."""
        return None if self.sources is None else self.sources[: self.real]


class _PromptStream(IterableDataset):
    """An endless, seeded stream of this rank's share of each step's global prompt batch.

    Step ``t``'s global batch is items ``[t*P, (t+1)*P)`` of an epoch-wise shuffled sequence; rank
    ``r`` of ``W`` takes a contiguous slice of it, so the union over ranks is the same P prompts a
    single process would see, and ``start_step`` resumes at an exact position.
    """

    def __init__(
        self,
        prompts: list[str],
        per_step: int,
        seed: int,
        rank: int,
        world: int,
        start_step: int,
        layout: GroupLayout,
        metadata: list[PromptMeta] | None = None,
        sources: list[SourceImage] | None = None,
    ) -> None:
        self.prompts, self.per_step, self.seed, self.layout = prompts, per_step, seed, layout
        self.rank, self.world, self.start_step, self.metadata = rank, world, start_step, metadata
        self.sources = sources

    def _item(self, position: int) -> int:
        n = len(self.prompts)
        epoch, offset = divmod(position, n)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch))
        return int(order[offset])

    def __iter__(self) -> Iterator[PromptBatch]:
        local = self.per_step // self.world
        step = self.start_step
        while True:
            first = step * self.per_step + self.rank * local
            positions = list(range(first, first + local))
            items = [self._item(p) for p in positions]
            # Metadata and source images are picked by the same item indices as the prompts, so shuffling and
            # sharding keep them paired.
            meta = None if self.metadata is None else [self.metadata[i] for i in items]
            sources = None if self.sources is None else [self.sources[i] for i in items]
            yield PromptBatch([self.prompts[i] for i in items], positions, None, self.seed, self.layout, meta, sources)
            step += 1


class _FixedPrompts(torch.utils.data.Dataset):
    """Rank ``rank``'s strided share of a fixed prompt list, padded to ``ceil(len / world)`` prompts.

    Every rank gets the same number of batches of the same sizes (sharded experts run collectives in
    every forward, so ranks must run equally many); padding repeats a real prompt and is marked by
    ``PromptBatch.num_real`` so it is never scored or written.
    """

    def __init__(
        self,
        prompts: list[str],
        per_batch: int,
        rank: int,
        world: int,
        seed: int,
        metadata: list[PromptMeta] | None = None,
        sources: list[SourceImage] | None = None,
    ) -> None:
        self.ids = list(range(rank, len(prompts), world))
        self.length = -(-len(prompts) // world)
        self.prompts, self.per_batch, self.seed, self.metadata = prompts, per_batch, seed, metadata
        self.sources = sources

    def __len__(self) -> int:
        return (self.length + self.per_batch - 1) // self.per_batch

    def __getitem__(self, i: int) -> PromptBatch:
        positions = range(i * self.per_batch, min((i + 1) * self.per_batch, self.length))
        ids = [self.ids[p] if p < len(self.ids) else self.ids[0] if self.ids else 0 for p in positions]
        real = sum(p < len(self.ids) for p in positions)
        meta = None if self.metadata is None else [self.metadata[j] for j in ids]
        sources = None if self.sources is None else [self.sources[j] for j in ids]
        # Negative request ids keep evaluation randomness apart from training's.
        return PromptBatch(
            [self.prompts[j] for j in ids],
            [-1 - j for j in ids],
            num_real=real,
            seed=self.seed,
            metadata=meta,
            sources=sources,
        )


def _identity(batch: list[PromptBatch]) -> PromptBatch:
    return batch[0]


class PromptDataModule(pl.LightningDataModule):
    """Prompts for training, validation and prediction, and how many samples each prompt gets.

    It yields :class:`PromptBatch` es and never calls a model: the LightningModule turns each training
    batch into an experience (its ``on_after_batch_transfer``).

    Args:
        prompts: Training prompts: a ``.txt``/``.jsonl`` path, an inline list, or null for the embedded set. A
            ``.jsonl`` row's other fields (GenEval's ``tag``/``include``) ride along as the prompt's metadata
            (:attr:`PromptBatch.metadata`), for rewards that declare a ``metadata`` parameter. An editing file's
            rows name a source image each (``{"prompt": "<instruction>", "image": "<path relative to the file>"}``):
            every image is read and checked before training (:mod:`unirl_pl.source_images`) and reaches the
            refiner, the generator, the rewards, validation and ``predict`` with its prompt.
        val_prompts: Held-out prompts for ``validate`` (same forms), scored on the deterministic serve path.
        predict_prompts: Prompts for ``predict`` (same forms); null uses ``val_prompts``.
        prompts_per_step: Prompts per optimizer step, summed over all ranks (divisible by the world size).
        samples_per_prompt: K, text samples per prompt; the group size of the LM's advantage (>= 2).
        num_skip_refinement: Of each prompt's K samples, how many keep the original prompt unrefined.
        images_per_refinement: M, images rendered per text sample (M > 1 with the hierarchical scheme).
        val_batch_size: Prompts per validation / prediction batch.
        val_images_per_prompt: Images scored per held-out prompt in validation, each from its own noise;
            the scores are means over all of them. GenEval scores 4 per prompt: one image makes a
            comparison of two runs hinge on a single noise draw per prompt. Image ``c`` of prompt ``j``
            (of N) has request id ``-1 - (c*N + j)``, so the first image of every prompt is the one a
            single-image validation draws. Prediction renders one image per prompt.
        seed: Seed of the prompt order and of every sample's randomness.
        val_seed: Seed of the validation and prediction samples' randomness (null: ``seed``). Fixing it
            scores runs of different seeds on the same noise, so their validation scores differ only by
            what training did (a paired comparison, as the ablation needs).
        max_image_pixels: The most pixels (height x width) a source image of an editing prompt file may have; a
            larger one is refused before training starts.
    """

    def __init__(
        self,
        prompts: str | list[str] | None = None,
        val_prompts: str | list[str] | None = None,
        predict_prompts: str | list[str] | None = None,
        prompts_per_step: int = 4,
        samples_per_prompt: int = 4,
        num_skip_refinement: int = 1,
        images_per_refinement: int = 1,
        val_batch_size: int = 8,
        val_images_per_prompt: int = 1,
        seed: int = 0,
        val_seed: int | None = None,
        max_image_pixels: int = 4096 * 4096,
    ) -> None:
        super().__init__()
        check_prompt_counts(prompts_per_step, val_batch_size, val_images_per_prompt)
        if max_image_pixels < 1:
            raise ValueError(f"data.max_image_pixels must be >= 1, got {max_image_pixels}")
        self.layout = GroupLayout(samples_per_prompt, num_skip_refinement, images_per_refinement)
        self.train_prompts, self.train_metadata = load_prompt_records(prompts)
        self.val_prompt_list, self.val_metadata = load_prompt_records(val_prompts, DEFAULT_VAL_PROMPTS)
        self.predict_prompt_list, self.predict_metadata = (
            load_prompt_records(predict_prompts)
            if predict_prompts is not None
            else (self.val_prompt_list, self.val_metadata)
        )
        self.train_sources = load_sources(prompts, self.train_metadata, max_image_pixels)
        self.val_sources = load_sources(val_prompts, self.val_metadata, max_image_pixels)
        self.predict_sources = (
            load_sources(predict_prompts, self.predict_metadata, max_image_pixels)
            if predict_prompts is not None
            else self.val_sources
        )
        self.prompts_per_step = prompts_per_step
        self.val_batch_size, self.val_images_per_prompt = val_batch_size, val_images_per_prompt
        self.seed, self.val_seed = seed, val_seed

    def _world(self) -> tuple[int, int]:
        trainer = self.trainer
        if trainer is None:
            return 0, 1
        return trainer.global_rank, trainer.world_size

    def train_dataloader(self) -> DataLoader:
        rank, world = self._world()
        if self.prompts_per_step % world:
            raise ValueError(f"prompts_per_step={self.prompts_per_step} must be divisible by the world size {world}")
        # The stream resumes at the RL step the trainer is at (one global step per RL step).
        start = self.trainer.global_step if self.trainer is not None else 0
        stream = _PromptStream(
            self.train_prompts,
            self.prompts_per_step,
            self.seed,
            rank,
            world,
            start,
            self.layout,
            self.train_metadata,
            self.train_sources,
        )
        return DataLoader(stream, batch_size=None)

    def _fixed(
        self, prompts: list[str], metadata: list[PromptMeta] | None, sources: list[SourceImage] | None
    ) -> DataLoader:
        rank, world = self._world()
        seed = self.seed if self.val_seed is None else self.val_seed
        shard = _FixedPrompts(prompts, self.val_batch_size, rank, world, seed, metadata, sources)
        # The shard is this rank's already. Lightning would split a loader again across ranks (a
        # DistributedSampler in validation, an unrepeated one in predict: each rank scored half its share);
        # it leaves a loader alone whose sampler is a DistributedSampler, and one of one replica reads the
        # shard in order.
        sampler = DistributedSampler(shard, num_replicas=1, rank=0, shuffle=False)
        return DataLoader(shard, batch_size=1, sampler=sampler, collate_fn=_identity)

    def val_dataloader(self) -> DataLoader:
        # Copy-major: the list's index is the request id, so copy c of prompt j draws its own noise.
        copies = self.val_images_per_prompt
        metadata = None if self.val_metadata is None else self.val_metadata * copies
        sources = None if self.val_sources is None else self.val_sources * copies
        return self._fixed(self.val_prompt_list * copies, metadata, sources)

    def predict_dataloader(self) -> DataLoader:
        return self._fixed(self.predict_prompt_list, self.predict_metadata, self.predict_sources)

    @property
    def edits(self) -> bool:
        """Whether the training prompts carry source images (an editing run)."""
        return self.train_sources is not None

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        # Prompt batches are strings; the experience is built on the right device by the rollout.
        return batch
