"""``diffusion_denoise``: the flow sampler, sampled in a profile and re-scored for training.

Rollout runs what the generator's algorithm plans (:class:`StepPlan`): a stochastic step (Flow-GRPO's SDE
or CPS) at each sample's planned steps, the ODE elsewhere, and records every stochastic step: x_t, x_next,
the sigmas and the log-prob of x_next. A likelihood-free algorithm samples the ODE and records what it needs
itself. ``step_logprob`` (the ``train`` profile) re-scores one
recorded step under the current weights in rollout's micro-batch composition, with the same
conditioning and guidance, so on unchanged weights the recompute is bit-identical by construction.
The loop is generator-agnostic: it needs ``latent_shape`` and ``velocity(latents, sigma, cond)``.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from unirl_pl.distributed import agree_max
from unirl_pl.generators.schedule import Schedule
from unirl_pl.generators.wan import LOW_NOISE
from unirl_pl.loops.config import Profile, RolloutConfig, SampleRequest, StepPlan, chunk_bounds
from unirl_pl.records import Cond, DiTRecord, cond_expand, cond_rows
from unirl_pl.sampling import STOCHASTIC_STEPS, compress_tail, dpm_solver_2m_step, flow_sigmas, flow_x0, ode_step
from unirl_pl.seeding import STREAM_NOISE, sample_generators

SCHEDULE_FILE = "schedule.json"


def write_schedule(loop: DiffusionDenoise, run_dir: Path, write: bool = True) -> dict[str, Any]:
    """``loop.describe()``, saved as ``run_dir/schedule.json`` when ``write`` (rank 0), so a user can
    compare the sigmas sampled with against their pipeline's."""
    described = loop.describe()
    if write:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / SCHEDULE_FILE).write_text(json.dumps(described, indent=2) + "\n")
    return described


def sigma_table(steps: Sequence[int], sigmas: Callable[[int], Tensor]) -> Tensor:
    """(N, max(steps) + 1) float64: row i is sample i's schedule ``sigmas(steps[i])``, zero-padded past its
    end (never read)."""
    table = torch.zeros(len(steps), max(steps) + 1, dtype=torch.float64)
    for count in set(steps):
        rows = [i for i, c in enumerate(steps) if c == count]
        table[rows, : count + 1] = sigmas(count)
    return table


class DiffusionDenoise:
    """The ``diffusion_denoise`` loop over one flow generator.

    Args:
        generator: Anything with ``latent_shape`` (per sample) and ``velocity(latents, sigma, cond)``.
        config: Sampling settings (steps, shift, noise level, SDE window, micro-batch, guidance).
        algorithm: The generator's training algorithm (:mod:`unirl_pl.algorithms`): it decides what the
            ``rollout`` profile runs and records. None: the loop only serves (the ODE), as for validation
            of a pretrained generator; the module always passes one.
    """

    def __init__(self, generator: Any, config: RolloutConfig, algorithm: Any = None) -> None:
        self.generator, self.config, self.algorithm = generator, config, algorithm

    def schedule(self, num_steps: int) -> Schedule:
        """The schedule sampled with for ``num_steps`` steps: the generator's own (a family pipeline's
        scheduler), recomputed with ``rollout.shift`` in place of the scheduler's shift when that is set;
        for a generator without a pipeline scheduler, SD3's shift formula on ``linspace(1, 0)`` (linear
        without a shift)."""
        shift = self.config.shift
        own = getattr(self.generator, "schedule", None)
        if shift is None and own is not None:
            return own(num_steps)
        if shift is None:
            return Schedule(flow_sigmas(num_steps, 1.0), "linear (the generator has no pipeline scheduler)")
        if own is not None and "shift" in inspect.signature(own).parameters:
            shifted = own(num_steps, shift=shift)
            source = f"{shifted.source}: model.rollout.shift={shift}, overriding the pipeline's {own(num_steps).source}"
            return Schedule(shifted.sigmas, source, {**shifted.details, "rollout_shift": shift})
        source = f"model.rollout.shift={shift}"
        if own is not None:
            source += f", overriding the pipeline's {own(num_steps).source}"
        return Schedule(flow_sigmas(num_steps, shift), source, {"shift": shift})

    def sigmas(self, num_steps: int) -> Tensor:
        """The ``num_steps + 1`` float64 sigmas of :meth:`schedule`."""
        return self.schedule(num_steps).sigmas

    def describe(self) -> dict[str, Any]:
        """What ``schedule.json`` holds: the configured step count's sigmas, the stochastic (trained) step
        indices as the algorithm states them, and the schedule's source."""
        schedule = self.schedule(self.config.num_steps)
        return {
            "sigmas": schedule.sigmas.tolist(),
            **(self.algorithm.describe(self.config) if self.algorithm is not None else {"sde_steps": []}),
            "source": schedule.source,
            **({"details": schedule.details} if schedule.details else {}),
        }

    def least_steps(self) -> int:
        """The fewest denoising steps a ``rollout`` request may run (its algorithm's stochastic steps must fit)."""
        return int(self.algorithm.least_steps(self.config)) if self.algorithm is not None else 1

    def velocity(self, x: Tensor, sigma: float | Tensor, cond: Cond, uncond: Cond | None) -> Tensor:
        """The (guided) velocity at ``sigma``: ``v_u + g * (v_c - v_u)`` when guidance is on.

        Guidance runs the conditional and unconditional inputs as one batched forward (half the weight
        reads and launches of two); rollout and the recompute both do, so the DiT's C2 stays bitwise.
        ``g`` is ``guidance_scale``, or ``guidance_scale_2`` for the rows whose sigma a two-expert Wan2.2
        generator routes to its low-noise expert (:meth:`guidance_scales`). ``detach_uncond`` detaches
        ``v_u`` in both of its places: the same values, and a gradient of ``g * dv_c`` alone. A generator with a
        ``guide(v_c, v_u, g)`` method combines them itself (``QwenImageGenerator``: the pipeline's norm rescale).
        """
        n = x.shape[0]
        s = torch.as_tensor(sigma, dtype=torch.float32, device=x.device).expand(n)
        self._check_guidance_scale_2()
        if uncond is None or not self.config.guided:
            return self.generator.velocity(x, s, cond)
        # A key the unconditional branch lacks (an edit's source latents) is per-sample conditioning both share.
        rows = cond_expand(uncond, n)
        both = {k: torch.cat([v, rows.get(k, v)]) for k, v in cond.items()}
        v, v0 = self.generator.velocity(torch.cat([x, x]), torch.cat([s, s]), both).split(n)
        if self.config.detach_uncond:
            v0 = v0.detach()
        g = self.guidance_scales(s)
        if isinstance(g, Tensor):
            g = g.view(n, *([1] * (v.ndim - 1)))
        # A family whose pipeline combines the two branches its own way (Qwen-Image's norm rescale) says how.
        guide = getattr(self.generator, "guide", None)
        return guide(v, v0, g) if guide is not None else v0 + g * (v - v0)

    def guidance_scales(self, sigma: Tensor) -> float | Tensor:
        """The guidance scale of each row at noise levels ``sigma`` (B,): ``guidance_scale`` (a float), or,
        with ``guidance_scale_2`` set and rows on both sides of a two-expert generator's boundary, a (B,)
        float32 tensor with ``guidance_scale_2`` where ``expert_index`` picks the low-noise expert (the same
        float32 sigmas the generator routes by). ``ValueError`` for ``guidance_scale_2`` on one expert."""
        self._check_guidance_scale_2()
        g, g2 = self.config.guidance_scale, self.config.guidance_scale_2
        if g2 is None or g2 == g:
            return g
        low = self.generator.expert_index(sigma) == LOW_NOISE
        if not bool(low.any()):
            return g
        if bool(low.all()):
            return g2
        return torch.where(low, g2, g).to(device=sigma.device, dtype=torch.float32)

    def _check_guidance_scale_2(self) -> None:
        """``ValueError`` naming ``model.rollout.guidance_scale_2`` when it is set but negative, or set for a
        generator without a low-noise expert (anything but a two-expert Wan2.2 folder)."""
        g2 = self.config.guidance_scale_2
        if g2 is None:
            return
        if g2 < 0:
            raise ValueError(f"model.rollout.guidance_scale_2 must be >= 0 or null, got {g2}")
        if getattr(self.generator, "num_experts", 1) != 2:
            raise ValueError(
                f"model.rollout.guidance_scale_2={g2} is the guidance of a Wan2.2 low-noise expert (transformer_2), "
                f"but this {type(self.generator).__name__} has one expert: unset model.rollout.guidance_scale_2"
            )

    @torch.no_grad()
    def sample(
        self,
        cond: Cond,
        request_ids: Sequence[int],
        sample_indices: Sequence[int],
        profile: Profile,
        *,
        seed: int,
        version: int = 0,
        uncond: Cond | None = None,
        num_steps: Sequence[int] | None = None,
    ) -> tuple[Tensor, Any]:
        """Sample latents (N, *latent_shape); in ``rollout`` also return the algorithm's behavior record.

        ``serve`` runs the ODE. ``rollout`` is the algorithm's (:meth:`GeneratorAlgorithm.rollout`): for the
        likelihood algorithms the stochastic steps of its :class:`StepPlan` with a ``DiTRecord`` of them.
        ``num_steps`` gives each request its own step count (default: the config's for all). The batch
        then advances one step at a time with every sample on its own schedule, a finished sample
        leaving the batch, the way an interleaving server mixes requests; the record's sigmas become
        per-sample. In ``rollout`` every count must reach the end of the sample's stochastic steps, so all
        samples are in the batch for every recorded step and the recompute sees the same composition.
        """
        request = SampleRequest(cond, list(request_ids), list(sample_indices), seed, version, uncond, num_steps)
        if profile == "rollout":
            if self.algorithm is None:
                raise ValueError("the rollout profile needs the generator's training algorithm; this loop only serves")
            return self.algorithm.rollout(self, request)
        return self.run(request, StepPlan.ode(len(request.request_ids)))

    @torch.no_grad()
    def run(self, request: SampleRequest, plan: StepPlan) -> tuple[Tensor, DiTRecord | None]:
        """Run ``plan`` on ``request``: the ODE everywhere but each sample's stochastic steps, which are recorded.

        A denoising step where every live sample is stochastic (or none is) runs as one batched step; where
        some are, the ODE step of the others and the stochastic step of those are each elementwise, so every
        sample's result is the one it gets alone. Each sample draws its noise from its own generator, in
        the order of its own stochastic steps only.
        """
        cfg = self.config
        cond, request_ids, sample_indices = request.cond, request.request_ids, request.sample_indices
        seed, version, uncond, num_steps = request.seed, request.version, request.uncond, request.num_steps
        n = len(request_ids)
        if len(plan.starts) != n:
            raise ValueError(f"the step plan has {len(plan.starts)} starts for {n} requests")
        stochastic = plan.stochastic
        step_fn = STOCHASTIC_STEPS[plan.kind]
        steps = self._step_counts(n, num_steps, plan.least_steps())
        table = sigma_table(steps, self.sigmas)
        # MixGRPO-Flash: the ODE after the stochastic steps runs DPM-Solver++(2M) on a thinned tail.
        post = plan.post_solver == "dpm2" and stochastic
        post_from = plan.starts[0] + plan.size if post else max(steps) + 1
        if post:
            # A request whose stochastic steps reach its last step has no tail to thin.
            tails = {
                c: compress_tail(self.sigmas(c), post_from, plan.post_keep) if post_from < c else self.sigmas(c)
                for c in set(steps)
            }
            table = torch.zeros(n, max(t.numel() for t in tails.values()), dtype=torch.float64)
            for i, count in enumerate(steps):
                table[i, : tails[count].numel()] = tails[count]
            steps = [tails[c].numel() - 1 for c in steps]
        gens_all = sample_generators(seed, request_ids, sample_indices, STREAM_NOISE)
        # Each sample draws its own start first either way, so its generator's later (SDE) draws do not
        # depend on the setting; a shared start then replaces it with the one of the request's sample 0.
        starts = [torch.randn(self.generator.latent_shape, generator=g) for g in gens_all]
        if cfg.shared_start_noise:
            # One draw per request (its sample 0's start, whether or not sample 0 is in this batch).
            ids = sorted(set(request_ids))
            gens_first = sample_generators(seed, ids, [0] * len(ids), STREAM_NOISE)
            shape = self.generator.latent_shape
            first = {r: torch.randn(shape, generator=g) for r, g in zip(ids, gens_first, strict=True)}
            starts = [first[r] for r in request_ids]
        device = next(iter(cond.values())).device
        chunks = chunk_bounds(n, cfg.micro_batch_size)
        size = plan.size
        latents, prevs, samples, logps = [], [], [], []
        for a, b in chunks:
            gens = gens_all[a:b]
            x = torch.stack(starts[a:b]).to(device)
            sig, counts, c_cond = table[a:b], steps[a:b], cond_rows(cond, slice(a, b))
            first = plan.starts[a:b]
            x0_prev: Tensor | None = None  # each sample's previous x0 prediction (dpm2's second order)
            if stochastic:
                c_prev = x.new_empty(b - a, size, *x.shape[1:])
                c_sample = torch.empty_like(c_prev)
                c_logp = torch.zeros(b - a, size, dtype=torch.float32, device=device)
            for i in range(agree_max(max(counts), device)):
                live = [j for j, c in enumerate(counts) if i < c]
                if not live:
                    # Another rank still has steps to run: a discarded forward keeps the sharded all-gathers paired.
                    self.velocity(x[:1], sig[:1, 0], cond_rows(c_cond, slice(0, 1)), uncond)
                    continue
                # Index only when a sample has finished: the common all-live case keeps the tensors as they are.
                rows = None if len(live) == b - a else torch.tensor(live, device=device)
                s, s_next = sig[live, i], sig[live, i + 1]
                xs = x if rows is None else x.index_select(0, rows)
                v = self.velocity(xs, s, cond_rows(c_cond, rows), uncond)
                picked = [k for k, j in enumerate(live) if stochastic and first[j] <= i < first[j] + size]
                if post and i >= post_from:
                    assert x0_prev is not None
                    x0 = flow_x0(xs, v, s)
                    prev = x0_prev if rows is None else x0_prev.index_select(0, rows)
                    x_next = dpm_solver_2m_step(xs, x0, s, s_next, prev, sig[live, i - 1])
                    x0_prev = x0 if rows is None else x0_prev.index_copy(0, rows, x0)
                elif not picked:
                    x_next = ode_step(xs, v, s, s_next)
                else:
                    some = len(picked) < len(live)
                    at = torch.tensor(picked, device=device) if some else None
                    members = [live[k] for k in picked]
                    x_sto, logp, _, _ = step_fn(
                        xs if at is None else xs.index_select(0, at),
                        v if at is None else v.index_select(0, at),
                        s[picked] if some else s,
                        s_next[picked] if some else s_next,
                        sigma_max=sig[members, 1],
                        noise_level=plan.noise_level,
                        generator=[gens[j] for j in members],
                    )
                    x_next = x_sto if at is None else ode_step(xs, v, s, s_next).index_copy(0, at, x_sto)
                    where = (torch.tensor(members), torch.tensor([i - first[j] for j in members]))
                    c_prev[where] = xs if at is None else xs.index_select(0, at)
                    c_sample[where] = x_sto
                    c_logp[where] = logp
                if post and i == post_from - 1:  # the last stochastic step's prediction starts dpm2's history
                    x0 = flow_x0(xs, v, s)
                    x0_prev = x0 if rows is None else torch.zeros_like(x, dtype=torch.float32).index_copy(0, rows, x0)
                x = x_next if rows is None else x.index_copy(0, rows, x_next)
            latents.append(x)
            if stochastic:
                prevs.append(c_prev)
                samples.append(c_sample)
                logps.append(c_logp)
        out = torch.cat(latents)
        if not stochastic:
            return out, None
        # A shared schedule and shared stochastic steps keep the compact (S,) form; otherwise per-sample sigmas.
        offsets = torch.tensor(plan.starts)[:, None] + torch.arange(size)[None, :]
        if len(set(steps)) == 1 and len(set(plan.starts)) == 1:
            start = plan.starts[0]
            sigma, sigma_next = table[0, start : start + size].clone(), table[0, start + 1 : start + size + 1].clone()
            sigma_max: float | Tensor = float(table[0, 1])
        else:
            sigma, sigma_next = table.gather(1, offsets), table.gather(1, offsets + 1)
            sigma_max = table[:, 1].clone()
        record = DiTRecord(
            prev=torch.cat(prevs),
            sample=torch.cat(samples),
            sigma=sigma,
            sigma_next=sigma_next,
            old_logp=torch.cat(logps),
            cond=cond,
            sigma_max=sigma_max,
            noise_level=plan.noise_level,
            chunks=chunks,
            version=version,
            uncond=uncond,
            kind=plan.kind,
            starts=torch.tensor(plan.starts),
        )
        return out, record

    def _step_counts(self, n: int, num_steps: Sequence[int] | None, least: Sequence[int]) -> list[int]:
        if num_steps is None:
            steps = [self.config.num_steps] * n
        else:
            steps = [int(c) for c in num_steps]
            if len(steps) != n:
                raise ValueError(f"num_steps has {len(steps)} entries for {n} requests")
        short = [(c, need) for c, need in zip(steps, least, strict=True) if c < need]
        if short:
            raise ValueError(
                f"every request needs >= {max(need for _, need in short)} steps (rollout records its stochastic "
                f"steps, {self.algorithm.describe(self.config).get('sde_steps')}), got num_steps={steps}"
            )
        return steps

    def step_logprob(self, record: DiTRecord, step: int, chunk: tuple[int, int]) -> tuple[Tensor, Tensor, Tensor]:
        """Re-score step ``step`` of the samples in ``chunk``: (log_prob, mean, std) under current weights, with
        the stochastic step that drew the record (``record.kind``)."""
        a, b = chunk
        # Contiguous copies: strided slices of the (N, S, ...) record cost the forward and its backward.
        x = record.prev[a:b, step].contiguous()
        s, s_next, sigma_max = record.step_sigmas(step, chunk)
        v = self.velocity(x, s, cond_rows(record.cond, slice(a, b)), record.uncond)
        _, logp, mean, std = STOCHASTIC_STEPS[record.kind](
            x,
            v,
            s,
            s_next,
            sigma_max=sigma_max,
            noise_level=record.noise_level,
            prev_sample=record.sample[a:b, step].contiguous(),
        )
        return logp, mean, std

    def score(self, record: DiTRecord) -> Tensor:
        """All SDE-step log-probs of a record under the current weights, (N, S)."""
        out = torch.empty_like(record.old_logp)
        for step, (a, b) in record.steps():
            out[a:b, step] = self.step_logprob(record, step, (a, b))[0]
        return out
