"""What rollout captures and training consumes: behavior records and the experience of one step.

A behavior record holds exactly what the training recompute needs to score the same probability the
sample was drawn from (inputs, the sampled output, the sampling settings and the behavior log-prob)
plus the weight version of the expert that produced it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from unirl_pl.card import Loop

Cond = dict[str, Tensor]
"""A generator's conditioning: named tensors with the batch on dim 0 (e.g. ``hidden``, ``pooled``)."""


def cond_rows(cond: Cond, rows: Tensor | slice | None) -> Cond:
    """The conditioning of some samples: ``rows`` is a slice, an index tensor, or None for all."""
    if rows is None:
        return cond
    if isinstance(rows, slice):
        return {k: v[rows] for k, v in cond.items()}
    return {k: v.index_select(0, rows.to(v.device)) for k, v in cond.items()}


def cond_expand(cond: Cond, n: int) -> Cond:
    """A one-row conditioning (the empty prompt) broadcast to ``n`` rows without copying."""
    return {k: v.expand(n, *v.shape[1:]) for k, v in cond.items()}


def vision_batch(
    pixel_values: list[Tensor | None], image_grid_thw: list[Tensor | None]
) -> tuple[Tensor, Tensor] | None:
    """A VLM's ``pixel_values`` (the images' patches concatenated in row order) and ``image_grid_thw``
    (images, 3) of the rows that have an image, from per-row lists; None when no row has one."""
    rows = [(p, g) for p, g in zip(pixel_values, image_grid_thw, strict=True) if g is not None and p is not None]
    if not rows:
        return None
    return torch.cat([p for p, _ in rows]), torch.stack([g for _, g in rows])


def rechunk(chunks: list[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    """Consecutive chunks over ``n`` rows no larger than the largest of ``chunks`` (the micro-batch size)."""
    size = max((b - a for a, b in chunks), default=n) or 1
    return [(i, min(i + size, n)) for i in range(0, n, size)]


@dataclass
class LMRecord:
    """Behavior of ``ar_decode``: left-padded prompt + generated tokens, masks, per-token log-probs.

    ``gen_mask`` marks real generated tokens (through the first eos); ``rows`` maps each record row
    to its text sample. ``temperature``/``top_k`` are the sampling settings the log-probs belong to.
    ``fell_back`` marks the rows whose reply could not be parsed and were replaced by the user prompt.
    ``replies`` is each row's raw decoded reply (before parsing), for rewards that judge the reply itself.

    A refiner that saw source images (editing) also records, per row, the image processor's output it read:
    ``pixel_values`` (the image's patches, (patches, C * T * P * P)) and ``image_grid_thw`` ((3,) long), None
    for a row asked without an image; both empty for a text-only record. They are lists so that ``slice`` and
    ``take`` keep each row's image with it (rows of one prompt share one tensor), and the teacher-forced
    re-score reads exactly what the rollout read.
    """

    input_ids: Tensor
    attention_mask: Tensor
    prompt_len: int
    gen_mask: Tensor
    old_logp: Tensor
    rows: Tensor
    temperature: float
    top_k: int | None
    version: int
    fell_back: list[bool] = field(default_factory=list)
    replies: list[str] = field(default_factory=list)
    pixel_values: list[Tensor | None] = field(default_factory=list)
    image_grid_thw: list[Tensor | None] = field(default_factory=list)

    @property
    def gen_ids(self) -> Tensor:
        """The generated tokens, (R, T)."""
        return self.input_ids[:, self.prompt_len :]

    @property
    def has_images(self) -> bool:
        """Whether any row was asked with a source image."""
        return any(grid is not None for grid in self.image_grid_thw)

    def vision_inputs(self) -> tuple[Tensor, Tensor] | None:
        """The model's ``pixel_values`` (the rows' images' patches concatenated in row order) and
        ``image_grid_thw`` (images, 3) of this record's rows with an image; None when no row has one."""
        return vision_batch(self.pixel_values, self.image_grid_thw)

    def slice(self, start: int, stop: int) -> LMRecord:
        """Rows ``[start, stop)`` of the record (views, same padding and settings): one scoring micro-batch."""
        return self._rows(
            slice(start, stop),
            self.fell_back[start:stop],
            self.replies[start:stop],
            self.pixel_values[start:stop],
            self.image_grid_thw[start:stop],
        )

    def take(self, index: Tensor) -> LMRecord:
        """The rows at ``index`` (1-D long, in that order; same padding and settings): the refinements a
        refiner algorithm trains on when it drops some groups (DAPO's dynamic sampling)."""
        rows = index.tolist()

        def pick(values: list) -> list:
            return [values[i] for i in rows] if values else []

        return self._rows(
            index, pick(self.fell_back), pick(self.replies), pick(self.pixel_values), pick(self.image_grid_thw)
        )

    def _rows(
        self,
        rows: slice | Tensor,
        fell_back: list[bool],
        replies: list[str],
        pixel_values: list[Tensor | None],
        image_grid_thw: list[Tensor | None],
    ) -> LMRecord:
        return replace(
            self,
            input_ids=self.input_ids[rows],
            attention_mask=self.attention_mask[rows],
            gen_mask=self.gen_mask[rows],
            old_logp=self.old_logp[rows],
            rows=self.rows[rows],
            fell_back=fell_back,
            replies=replies,
            pixel_values=pixel_values,
            image_grid_thw=image_grid_thw,
        )


@dataclass
class DiTRecord:
    """Behavior of ``diffusion_denoise`` over its stochastic steps: per sample and step, x_t and x_next.

    ``prev``/``sample`` are (N, S, *latent_shape); ``sigma``/``sigma_next`` (S,) float64 and ``sigma_max``
    a float when every sample ran the same schedule and the same stochastic steps, or (N, S) and (N,) when
    they did not (schedules of different lengths, or per-sample windows as in Flow-GRPO-Fast); ``old_logp``
    (N, S); ``cond``/``uncond`` the conditioning used, so the recompute sees exactly the same inputs;
    ``chunks`` the micro-batches rollout ran, which the recompute repeats; ``kind`` the stochastic step that
    drew ``sample`` (a key of :data:`unirl_pl.sampling.STOCHASTIC_STEPS`: ``sde`` or ``cps``); ``starts``
    (N,) the denoising step of each sample's first recorded step.
    """

    prev: Tensor
    sample: Tensor
    sigma: Tensor
    sigma_next: Tensor
    old_logp: Tensor
    cond: Cond
    sigma_max: float | Tensor
    noise_level: float
    chunks: list[tuple[int, int]]
    version: int
    uncond: Cond | None = None
    kind: str = "sde"
    starts: Tensor | None = None

    @property
    def num_steps(self) -> int:
        """SDE steps recorded per sample."""
        return int(self.sigma.shape[-1])

    def step_sigmas(self, step: int, chunk: tuple[int, int]) -> tuple[float | Tensor, float | Tensor, float | Tensor]:
        """``(sigma, sigma_next, sigma_max)`` of window step ``step`` for the samples in ``chunk``.

        Floats for a shared schedule, (b-a,) tensors for per-sample ones: the same values rollout used.
        """
        if self.sigma.ndim == 1:
            return float(self.sigma[step]), float(self.sigma_next[step]), float(self.sigma_max)
        a, b = chunk
        assert isinstance(self.sigma_max, Tensor)
        return self.sigma[a:b, step], self.sigma_next[a:b, step], self.sigma_max[a:b]

    def steps(self) -> list[tuple[int, tuple[int, int]]]:
        """Every (step, chunk) pair, in rollout's micro-batch composition."""
        return [(step, chunk) for step in range(self.num_steps) for chunk in self.chunks]

    def behavior(self) -> dict[str, Tensor]:
        """The recorded per-sample tensors (batch on dim 0) that must not depend on the batch a sample ran in."""
        return {"prev": self.prev, "sample": self.sample, "old_logp": self.old_logp}

    def take(self, index: Tensor) -> DiTRecord:
        """The samples at ``index`` (1-D long): one training mini-batch. Its forwards run in chunks of the
        rollout's micro-batch size over the new rows (a stale mini-batch is not bit-compared with rollout)."""
        per_sample = self.sigma.ndim == 2
        sigma_max = self.sigma_max
        if isinstance(sigma_max, Tensor):
            sigma_max = sigma_max[index.to(sigma_max.device)]
        starts = None if self.starts is None else self.starts[index.to(self.starts.device)]
        return replace(
            self,
            prev=self.prev[index.to(self.prev.device)],
            sample=self.sample[index.to(self.sample.device)],
            old_logp=self.old_logp[index.to(self.old_logp.device)],
            sigma=self.sigma[index.to(self.sigma.device)] if per_sample else self.sigma,
            sigma_next=self.sigma_next[index.to(self.sigma_next.device)] if per_sample else self.sigma_next,
            sigma_max=self.sigma_max[index.to(self.sigma_max.device)]
            if isinstance(self.sigma_max, Tensor)
            else self.sigma_max,
            cond=cond_rows(self.cond, index),
            chunks=rechunk(self.chunks, len(index)),
            starts=starts,
        )


@dataclass
class FlowPointsRecord:
    """Behavior of a likelihood-free generator algorithm (DiffusionNFT): clean samples and training points.

    ``x0`` (N, *latent_shape) is what the rollout policy's ODE sampler produced; ``xt`` (N, J, ...) the
    forward-process points ``(1 - t) x0 + t eps`` training fits at, ``t`` (N, J) float32 their noise levels
    (each sample's own draw from its schedule, keyed by its seed), and ``old_v`` (N, J, ...) the rollout
    policy's velocity at each point: the "old" prediction of the loss and what the C2 gate recomputes.
    ``cond`` the conditioning, ``chunks`` the micro-batches the recorded forwards ran, which training and the
    gate repeat.
    """

    x0: Tensor
    xt: Tensor
    t: Tensor
    old_v: Tensor
    cond: Cond
    chunks: list[tuple[int, int]]
    version: int

    @property
    def num_points(self) -> int:
        """Training points per sample."""
        return int(self.t.shape[1])

    def points(self) -> list[tuple[int, tuple[int, int]]]:
        """Every (point, chunk) pair, in the recorded micro-batch composition."""
        return [(j, chunk) for j in range(self.num_points) for chunk in self.chunks]

    def behavior(self) -> dict[str, Tensor]:
        """The recorded per-sample tensors (batch on dim 0) that must not depend on the batch a sample ran in."""
        return {"x0": self.x0, "xt": self.xt, "t": self.t, "old_v": self.old_v}

    def take(self, index: Tensor) -> FlowPointsRecord:
        """The samples at ``index`` (1-D long): one training mini-batch."""
        i = index.to(self.x0.device)
        return replace(
            self,
            x0=self.x0[i],
            xt=self.xt[i],
            t=self.t[index.to(self.t.device)],
            old_v=self.old_v[i],
            cond=cond_rows(self.cond, index),
            chunks=rechunk(self.chunks, len(index)),
        )


@dataclass
class Experience:
    """One training batch after rollout.

    Per image sample (N = P * K * M on this rank): ``prompts``, ``refined``, ``text_index`` (which
    text sample, of P*K, the image renders) and ``rewards``; per text sample ``text_rewards`` (mean of its
    images). ``records`` and ``advantages`` are keyed by loop: ``ar_decode`` (the refined rows, in
    ``LMRecord.rows`` order) and ``diffusion_denoise`` (every image); a record is absent when its loop did
    not run or its experts are frozen. ``reward_parts`` holds each weighted reward's raw values (N,) for
    the logged statistics (with ``count_unscored`` also each term's fraction of samples it gave no number);
    ``dropped`` counts samples whose non-finite reward was dropped (their ``rewards`` entry is NaN, their
    advantage 0). ``image_advantages`` (N,) is every image sample's advantage, whether or not the generator
    trains. ``seed`` is the step's sampling seed and ``row_requests`` (per loop, one per record row) the
    request id of the row's prompt group: together they say which mini-batch a row trains in
    (:mod:`unirl_pl.method.minibatch`).
    """

    prompts: list[str]
    refined: list[str]
    text_index: Tensor
    rewards: Tensor
    text_rewards: Tensor
    records: dict[str, LMRecord | DiTRecord | FlowPointsRecord]
    advantages: dict[str, Tensor]
    zero_std_frac: float
    images: Tensor | None = None
    fallback_frac: float | None = None
    dropped: int = 0
    image_advantages: Tensor | None = None
    seed: int = 0
    reward_parts: dict[str, Tensor] = field(default_factory=dict)
    count_unscored: bool = False
    row_requests: dict[str, Tensor] = field(default_factory=dict)

    @property
    def lm(self) -> LMRecord | None:
        """The ``ar_decode`` record, if training captured one."""
        record = self.records.get(Loop.DECODE)
        assert record is None or isinstance(record, LMRecord)
        return record
