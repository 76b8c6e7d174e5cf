"""What rollout captures and training consumes: behavior records and the experience of one step.

A behavior record holds exactly what the training recompute needs to score the same probability the
sample was drawn from (inputs, the sampled output, the sampling settings and the behavior log-prob)
plus the weight version of the expert that produced it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

Cond = dict[str, Tensor]
"""A generator's conditioning: named tensors with the batch on dim 0 (e.g. ``hidden``, ``pooled``)."""


def cond_rows(cond: Cond, rows: Tensor | slice | None) -> Cond:
    """The conditioning of some samples: ``rows`` is a slice, an index tensor, or None for all."""
    if rows is None:
        return cond
    if isinstance(rows, slice):
        return {k: v[rows] for k, v in cond.items()}
    return {k: v.index_select(0, rows) for k, v in cond.items()}


def cond_expand(cond: Cond, n: int) -> Cond:
    """A one-row conditioning (the empty prompt) broadcast to ``n`` rows without copying."""
    return {k: v.expand(n, *v.shape[1:]) for k, v in cond.items()}


@dataclass
class LMRecord:
    """Behavior of ``ar_decode``: left-padded prompt + generated tokens, masks, per-token log-probs.

    ``gen_mask`` marks real generated tokens (through the first eos); ``rows`` maps each record row
    to its text sample. ``temperature``/``top_k`` are the sampling settings the log-probs belong to.
    ``fell_back`` marks the rows whose reply could not be parsed and were replaced by the user prompt.
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

    @property
    def gen_ids(self) -> Tensor:
        """The generated tokens, (R, T)."""
        return self.input_ids[:, self.prompt_len :]


@dataclass
class DiTRecord:
    """Behavior of ``diffusion_denoise`` over the SDE window: per sample and step, x_t and x_next.

    ``prev``/``sample`` are (N, S, *latent_shape); ``sigma``/``sigma_next`` (S,) float64 and ``sigma_max``
    a float, or (N, S) and (N,) when the requests ran schedules of different lengths; ``old_logp`` (N, S);
    ``cond``/``uncond`` the conditioning used, so the recompute sees exactly the same inputs; ``chunks``
    the micro-batches rollout ran, which the recompute repeats.
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


@dataclass
class Experience:
    """One training batch after rollout.

    Per image sample (N = P * K * M on this rank): ``prompts``, ``refined``, ``text_index`` (which
    text sample, of P*K, the image renders) and ``rewards``; per text sample ``text_rewards`` (mean of its
    images). ``records`` and ``advantages`` are keyed by loop: ``ar_decode`` (the refined rows, in
    ``LMRecord.rows`` order) and ``diffusion_denoise`` (every image); a record is absent when its loop did
    not run or its experts are frozen. ``reward_terms`` holds each weighted reward's raw mean for logging;
    ``dropped`` counts samples whose non-finite reward was dropped (their ``rewards`` entry is NaN, their
    advantage 0).
    """

    prompts: list[str]
    refined: list[str]
    text_index: Tensor
    rewards: Tensor
    text_rewards: Tensor
    records: dict[str, LMRecord | DiTRecord]
    advantages: dict[str, Tensor]
    reward_terms: dict[str, float]
    zero_std_frac: float
    images: Tensor | None = None
    fallback_frac: float | None = None
    dropped: int = 0

    @property
    def lm(self) -> LMRecord | None:
        """The ``ar_decode`` record, if training captured one."""
        record = self.records.get("ar_decode")
        assert record is None or isinstance(record, LMRecord)
        return record

    @property
    def dit(self) -> DiTRecord | None:
        """The ``diffusion_denoise`` record, if training captured one."""
        record = self.records.get("diffusion_denoise")
        assert record is None or isinstance(record, DiTRecord)
        return record
