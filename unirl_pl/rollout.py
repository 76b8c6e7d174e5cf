"""The two loops, driven by profile, and the behavior records they capture.

``ar_decode`` samples refinements token by token with a KV cache and records each token's
log-prob under the exact sampling distribution (temperature and top-k applied); ``diffusion_denoise``
runs the flow sampler, SDE inside the window and ODE elsewhere, recording every SDE step. The same
functions re-score a record under the current weights (profile ``train``), in the micro-batch
composition rollout used, so on unchanged weights the recompute is bit-identical by construction.

Every sample draws its randomness from its own generator seeded by (seed, request id, sample
index, stream): a sample's tokens and noise do not depend on batch size, position or rank count.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import DynamicCache

from unirl_pl.distributed import agree_max
from unirl_pl.sampling import flow_sde_step_with_logprob, flow_sigmas, ode_step

Profile = Literal["serve", "rollout", "train"]
STREAM_LM = 0
STREAM_NOISE = 1


def sample_seed(seed: int, request_id: int, sample_index: int, stream: int) -> int:
    """A 63-bit seed that is a pure function of its arguments (stable across processes and Pythons)."""
    digest = hashlib.blake2b(f"{seed}/{request_id}/{sample_index}/{stream}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def make_generators(seeds: Sequence[int], device: torch.device | str = "cpu") -> list[torch.Generator]:
    """One seeded generator per sample."""
    return [torch.Generator(device=device).manual_seed(s) for s in seeds]


@dataclass(frozen=True)
class RolloutConfig:
    """How the loops sample.

    Args:
        max_new_tokens: Most tokens the refiner generates per refinement.
        temperature: LM sampling temperature in the ``rollout`` profile (the recompute applies the same).
        top_k: Keep only the k most likely tokens when sampling (None: the full vocabulary).
        num_steps: Denoising steps of the flow sampler.
        shift: SD3-style schedule shift (1.0 is linear).
        noise_level: Flow-GRPO's SDE noise scale ``a`` inside the window (0 is the ODE).
        sde_window: ``[start, end)`` step indices run as SDE and trained; ODE elsewhere.
        micro_batch_size: Images per DiT forward in rollout and in the recompute (None: all at once).
            Both use the same chunks, which keeps batch-variant kernels from breaking the log-prob identity.
        guidance_scale: Classifier-free guidance scale (1.0 disables it; >1 also runs an empty prompt).
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int | None = None
    num_steps: int = 8
    shift: float = 1.0
    noise_level: float = 0.7
    sde_window: tuple[int, int] = (0, 3)
    micro_batch_size: int | None = None
    guidance_scale: float = 1.0

    def __post_init__(self) -> None:
        start, end = self.sde_window
        if not 0 <= start < end <= self.num_steps:
            raise ValueError(
                f"sde_window {self.sde_window} must satisfy 0 <= start < end <= num_steps={self.num_steps}"
            )
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 or null, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1 or null, got {self.micro_batch_size}")
        if self.noise_level < 0:
            raise ValueError(f"noise_level must be >= 0, got {self.noise_level}")


@dataclass
class LMRecord:
    """Behavior of ``ar_decode``: left-padded prompt + generated tokens, masks, per-token log-probs.

    ``gen_mask`` marks real generated tokens (through the first eos); ``rows`` maps each record row
    to its text sample. ``temperature``/``top_k`` are the sampling settings the log-probs belong to.
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

    @property
    def gen_ids(self) -> Tensor:
        return self.input_ids[:, self.prompt_len :]


@dataclass
class DiTRecord:
    """Behavior of ``diffusion_denoise`` over the SDE window: per image and step, x_t and x_next.

    ``prev``/``sample`` are (N, S, C, H, W); ``sigma``/``sigma_next`` (S,) float64 and ``sigma_max`` a
    float, or (N, S) and (N,) when the requests ran schedules of different lengths; ``old_logp`` (N, S);
    ``hidden``/``pooled`` the conditioning used, so the recompute sees exactly the same inputs.
    """

    prev: Tensor
    sample: Tensor
    sigma: Tensor
    sigma_next: Tensor
    old_logp: Tensor
    hidden: Tensor
    pooled: Tensor
    sigma_max: float | Tensor
    noise_level: float
    chunks: list[tuple[int, int]]
    version: int
    uncond: tuple[Tensor, Tensor] | None = None

    @property
    def num_steps(self) -> int:
        return int(self.sigma.shape[-1])

    def step_sigmas(self, step: int, chunk: tuple[int, int]) -> tuple[float | Tensor, float | Tensor, float | Tensor]:
        """``(sigma, sigma_next, sigma_max)`` of window step ``step`` for the images in ``chunk``.

        Floats for a shared schedule, (b-a,) tensors for per-sample ones: the same values rollout used.
        """
        if self.sigma.ndim == 1:
            return float(self.sigma[step]), float(self.sigma_next[step]), float(self.sigma_max)
        a, b = chunk
        assert isinstance(self.sigma_max, Tensor)
        return self.sigma[a:b, step], self.sigma_next[a:b, step], self.sigma_max[a:b]


def chunk_bounds(n: int, size: int | None) -> list[tuple[int, int]]:
    """Consecutive ``[start, end)`` slices of at most ``size`` items (one slice when size is None)."""
    size = n if size is None else size
    return [(i, min(i + size, n)) for i in range(0, n, max(size, 1))]


def process_logits(logits: Tensor, temperature: float, top_k: int | None) -> Tensor:
    """The sampling distribution's logits: divided by temperature, all but the top-k set to -inf."""
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return logits


def _positions(mask: Tensor) -> Tensor:
    return (mask.long().cumsum(-1) - 1).clamp_min(0)


@dataclass
class RolloutEngine:
    """Runs the loops for the module's experts in one of the three profiles.

    It holds references to the experts (not copies) and the sampling config; requests are batched
    (``interleaved``) or run one at a time (``serial``) with identical per-sample randomness, which is
    what the interleave-parity gate compares.
    """

    llm: torch.nn.Module | None
    transformer: torch.nn.Module
    config: RolloutConfig
    seed: int = 0
    ar_versions: dict[str, int] = field(default_factory=dict)

    # ------------------------------------------------------------------ ar_decode
    def refine(
        self,
        prompts: Sequence[str],
        request_ids: Sequence[int],
        sample_indices: Sequence[int],
        profile: Profile,
        version: int = 0,
    ) -> tuple[list[str], LMRecord]:
        """Refine each prompt; ``serve`` decodes greedily, ``rollout`` samples and records log-probs."""
        assert self.llm is not None, "refine() needs an llm expert"
        cfg = self.config
        tok = self.llm.tokenizer
        device = next(self.llm.parameters()).device
        enc = tok(list(prompts), return_tensors="pt", padding=True)
        ids = enc["input_ids"].to(device)
        mask = enc["attention_mask"].to(device)
        n, prompt_len = ids.shape
        greedy = profile == "serve"
        temperature = 1.0 if greedy else cfg.temperature
        top_k = None if greedy else cfg.top_k
        seeds = [sample_seed(self.seed, r, k, STREAM_LM) for r, k in zip(request_ids, sample_indices, strict=True)]
        gens = make_generators(seeds)
        eos, pad = self.llm.eos_token_id, self.llm.pad_token_id

        cache = DynamicCache()
        out = self.llm(
            input_ids=ids, attention_mask=mask, position_ids=_positions(mask), past_key_values=cache, use_cache=True
        )
        next_pos = _positions(mask)[:, -1:] + 1
        finished = torch.zeros(n, dtype=torch.bool, device=device)
        tokens, logps, live = [], [], []
        for step in range(cfg.max_new_tokens):
            logits = process_logits(out.logits[:, -1], temperature, top_k)
            logp_all = torch.log_softmax(logits, dim=-1)
            if greedy:
                tok_t = logits.argmax(-1)
            else:
                probs = logp_all.exp()
                draws = [torch.multinomial(probs[i].cpu(), 1, generator=gens[i]) for i in range(n)]
                tok_t = torch.cat(draws).to(device)
            tok_t = torch.where(finished, torch.full_like(tok_t, pad), tok_t)
            live.append(~finished)
            logps.append(logp_all.gather(-1, tok_t[:, None])[:, 0])
            tokens.append(tok_t)
            finished = finished | (tok_t == eos)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            # Stop only when every rank's sequences have ended: sharded forwards must stay in step.
            if step == cfg.max_new_tokens - 1 or not agree_max(int(not bool(finished.all())), device):
                break
            out = self.llm(
                input_ids=tok_t[:, None],
                attention_mask=mask,
                position_ids=next_pos,
                past_key_values=cache,
                use_cache=True,
            )
            next_pos = next_pos + 1
        gen = torch.stack(tokens, dim=1)
        gen_mask = torch.stack(live, dim=1)
        record = LMRecord(
            input_ids=torch.cat([ids, gen], dim=1),
            attention_mask=mask,
            prompt_len=prompt_len,
            gen_mask=gen_mask,
            old_logp=torch.stack(logps, dim=1) * gen_mask,
            rows=torch.arange(n),
            temperature=temperature,
            top_k=top_k,
            version=version,
        )
        texts = [tok.decode(g[m], skip_special_tokens=True).strip() for g, m in zip(gen, gen_mask, strict=True)]
        return texts, record

    def lm_logprobs(self, record: LMRecord) -> Tensor:
        """Teacher-forced log-probs of the recorded tokens under the current weights, (R, T), masked.

        Uses the record's own attention mask, positions, temperature and top-k: any of these
        differing from rollout would make the PPO ratio biased, which the C2 gate catches.
        """
        assert self.llm is not None
        mask = record.attention_mask
        out = self.llm(input_ids=record.input_ids, attention_mask=mask, position_ids=_positions(mask))
        p = record.prompt_len
        logits = process_logits(out.logits[:, p - 1 : -1], record.temperature, record.top_k)
        logp = torch.log_softmax(logits, dim=-1).gather(-1, record.gen_ids[..., None])[..., 0]
        return torch.where(record.gen_mask, logp, torch.zeros_like(logp))

    # ------------------------------------------------------------------ diffusion_denoise
    def _velocity(
        self, x: Tensor, sigma: float | Tensor, hidden: Tensor, pooled: Tensor, uncond: tuple[Tensor, Tensor] | None
    ) -> Tensor:
        s = torch.as_tensor(sigma, dtype=torch.float32, device=x.device).expand(x.shape[0])
        v = self.transformer.velocity(x, s, hidden, pooled)
        if uncond is None or self.config.guidance_scale == 1.0:
            return v
        h0 = uncond[0].expand(x.shape[0], *uncond[0].shape[1:])
        p0 = uncond[1].expand(x.shape[0], *uncond[1].shape[1:])
        v0 = self.transformer.velocity(x, s, h0, p0)
        return v0 + self.config.guidance_scale * (v - v0)

    def denoise(
        self,
        hidden: Tensor,
        pooled: Tensor,
        request_ids: Sequence[int],
        sample_indices: Sequence[int],
        profile: Profile,
        version: int = 0,
        uncond: tuple[Tensor, Tensor] | None = None,
        num_steps: Sequence[int] | None = None,
    ) -> tuple[Tensor, DiTRecord | None]:
        """Sample latents (N, C, H, W); in ``rollout`` also return the record of every SDE step.

        ``num_steps`` gives each request its own step count (default: the config's for all). The batch
        then advances one step at a time with every sample on its own schedule, a finished sample
        leaving the batch, the way an interleaving server mixes requests; the record's sigmas become
        per-sample. In ``rollout`` every count must reach the end of the SDE window, so all samples
        are in the batch for every recorded step and the recompute sees the same composition.
        """
        cfg = self.config
        n = hidden.shape[0]
        start, end = cfg.sde_window
        sde = profile == "rollout" and cfg.noise_level > 0
        steps = self._step_counts(n, num_steps, end if sde else 1)
        table = _sigma_table(steps, cfg.shift)
        seeds = [sample_seed(self.seed, r, k, STREAM_NOISE) for r, k in zip(request_ids, sample_indices, strict=True)]
        device = hidden.device
        chunks = chunk_bounds(n, cfg.micro_batch_size)
        latents, prevs, samples, logps = [], [], [], []
        for a, b in chunks:
            gens = make_generators(seeds[a:b])
            x = torch.stack([torch.randn(self.transformer.latent_shape, generator=g) for g in gens]).to(device)
            sig, counts = table[a:b], steps[a:b]
            c_prev, c_sample, c_logp = [], [], []
            for i in range(agree_max(max(counts), device)):
                live = [j for j, c in enumerate(counts) if i < c]
                if not live:
                    # Another rank still has steps to run: a discarded forward keeps the sharded all-gathers paired.
                    self._velocity(x[:1], sig[:1, 0], hidden[a : a + 1], pooled[a : a + 1], uncond)
                    continue
                # Index only when a sample has finished: the common all-live case keeps the tensors as they are.
                rows = None if len(live) == b - a else torch.tensor(live, device=device)
                s, s_next = sig[live, i], sig[live, i + 1]
                xs = _take(x, rows)
                v = self._velocity(xs, s, _take(hidden[a:b], rows), _take(pooled[a:b], rows), uncond)
                if sde and start <= i < end:
                    x_next, logp, _, _ = flow_sde_step_with_logprob(
                        xs, v, s, s_next, sigma_max=sig[:, 1], noise_level=cfg.noise_level, generator=gens
                    )
                    c_prev.append(xs)
                    c_sample.append(x_next)
                    c_logp.append(logp)
                else:
                    x_next = ode_step(xs, v, s, s_next)
                x = x_next if rows is None else x.index_copy(0, rows, x_next)
            latents.append(x)
            if sde:
                prevs.append(torch.stack(c_prev, 1))
                samples.append(torch.stack(c_sample, 1))
                logps.append(torch.stack(c_logp, 1))
        out = torch.cat(latents)
        if not sde:
            return out, None
        # A shared schedule keeps the compact (S,) form; mixed step counts need per-sample sigmas.
        shared = len(set(steps)) == 1
        record = DiTRecord(
            prev=torch.cat(prevs),
            sample=torch.cat(samples),
            sigma=(table[0] if shared else table)[..., start:end].clone(),
            sigma_next=(table[0] if shared else table)[..., start + 1 : end + 1].clone(),
            old_logp=torch.cat(logps),
            hidden=hidden,
            pooled=pooled,
            sigma_max=float(table[0, 1]) if shared else table[:, 1].clone(),
            noise_level=cfg.noise_level,
            chunks=chunks,
            version=version,
            uncond=uncond,
        )
        return out, record

    def _step_counts(self, n: int, num_steps: Sequence[int] | None, least: int) -> list[int]:
        if num_steps is None:
            return [self.config.num_steps] * n
        steps = [int(c) for c in num_steps]
        if len(steps) != n:
            raise ValueError(f"num_steps has {len(steps)} entries for {n} requests")
        if min(steps) < least:
            raise ValueError(
                f"every request needs >= {least} steps (rollout records the SDE window "
                f"{self.config.sde_window}), got num_steps={steps}"
            )
        return steps

    def dit_step_logprob(self, record: DiTRecord, step: int, chunk: tuple[int, int]) -> tuple[Tensor, Tensor, Tensor]:
        """Re-score step ``step`` of the images in ``chunk``: (log_prob, mean, std) under current weights."""
        a, b = chunk
        x = record.prev[a:b, step]
        s, s_next, sigma_max = record.step_sigmas(step, chunk)
        v = self._velocity(x, s, record.hidden[a:b], record.pooled[a:b], record.uncond)
        _, logp, mean, std = flow_sde_step_with_logprob(
            x, v, s, s_next, sigma_max=sigma_max, noise_level=record.noise_level, prev_sample=record.sample[a:b, step]
        )
        return logp, mean, std

    def iter_dit_steps(self, record: DiTRecord) -> Iterator[tuple[int, tuple[int, int]]]:
        """Every (step, chunk) pair of a record, in rollout's micro-batch composition."""
        for step in range(record.num_steps):
            for chunk in record.chunks:
                yield step, chunk

    def dit_logprobs(self, record: DiTRecord) -> Tensor:
        """All SDE-step log-probs of a record under the current weights, (N, S)."""
        out = torch.empty_like(record.old_logp)
        for step, (a, b) in self.iter_dit_steps(record):
            out[a:b, step] = self.dit_step_logprob(record, step, (a, b))[0]
        return out

    def with_config(self, **changes: object) -> RolloutEngine:
        """A copy of this engine with some sampling settings changed (used by gates' probes)."""
        return replace(self, config=replace(self.config, **changes))


def _take(t: Tensor, rows: Tensor | None) -> Tensor:
    return t if rows is None else t.index_select(0, rows)


def _sigma_table(steps: Sequence[int], shift: float) -> Tensor:
    """(N, max(steps) + 1) float64: row i is sample i's schedule, zero-padded past its end (never read)."""
    table = torch.zeros(len(steps), max(steps) + 1, dtype=torch.float64)
    for count in set(steps):
        rows = [i for i, c in enumerate(steps) if c == count]
        table[rows, : count + 1] = flow_sigmas(count, shift)
    return table


def pad_to(x: Tensor, length: int, value: float = 0.0) -> Tensor:
    """Right-pad the last dim of ``x`` to ``length``."""
    return F.pad(x, (0, length - x.shape[-1]), value=value)
