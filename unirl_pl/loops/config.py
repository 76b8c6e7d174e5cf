"""How the two loops sample: the settings shared by rollout, serving and the training recompute."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

Profile = Literal["serve", "rollout"]
"""``serve``: no grad, greedy tokens, ODE (deterministic). ``rollout``: no grad, sampled tokens and the SDE
inside the window, behavior captured. The third profile, ``train``, is each loop's ``score`` method: it
recomputes a record's log-probs with grad under the current weights."""


@dataclass(frozen=True)
class RolloutConfig:
    """How the loops sample.

    Args:
        max_new_tokens: Most tokens the refiner generates per refinement.
        temperature: LM sampling temperature in the ``rollout`` profile (the recompute applies the same).
        top_k: Keep only the k most likely tokens when sampling (None: the full vocabulary).
        num_steps: Denoising steps of the flow sampler.
        shift: SD3-style schedule shift ``s' = shift*s / (1 + (shift-1)*s)`` of ``linspace(1, 0)``. ``None``
            (the default): the generator's own schedule, i.e. a family pipeline's scheduler config exactly as
            its diffusers pipeline computes it (shift, dynamic shift from the image size, terminal sigma),
            or linear for the project's own generator. A value overrides the pipeline (logged at fit start).
        noise_level: Moved: the generator algorithm owns it (``model.generator_algorithm.init_args.noise_level``).
            Setting it here is an error that names the new key.
        sde_window: Moved: the generator algorithm owns it (``model.generator_algorithm.init_args.sde_window``).
            Setting it here is an error that names the new key.
        micro_batch_size: Images per DiT forward in rollout and in the recompute (None: all at once).
            Both use the same chunks, which keeps batch-variant kernels from breaking the log-prob identity.
        lm_micro_batch_size: Refinements per refiner forward when the trainer scores them (the loss, with a
            backward per chunk, and the gates' recompute; None: all at once). The logits of a real
            vocabulary dominate the refiner's memory (rows x tokens x ~152k floats), so real-size recipes set
            it; the loss is the same up to float rounding (each chunk is weighted by its share of the
            aggregation units: tokens, or refinements for the sequence-level aggregations).
        feature_cache_size: Texts whose text-encoder features the conditioning cache keeps (least recently
            used leave first; a group's K samples of one prompt, and the next steps' repeats, encode once).
        feature_cache_offload: Keep the cached features in host memory and copy a step's rows to the device
            when used: a real text encoder's features are megabytes per text (T5-XXL: 333 x 4096 floats),
            so a full cache on the GPU costs tens of GiB.
        guidance_scale: Classifier-free guidance scale (1.0 disables it; >1 also runs an empty prompt).
            On a two-expert Wan2.2 generator, the scale of the high-noise expert (``transformer``).
        guidance_scale_2: The guidance scale of the steps a two-expert Wan2.2 generator runs on its
            low-noise expert (``transformer_2``), as ``WanPipeline(guidance_scale_2=...)`` (None: the same
            as ``guidance_scale``). Read only while guidance is on (``guidance_scale`` != 1), as
            ``WanPipeline`` guides only for ``guidance_scale > 1``. A generator with one expert refuses it.
        detach_uncond: Keep classifier-free guidance's unconditional branch out of the gradient of the
            training recompute: the guided velocity is ``v_u.detach() + g * (v_c - v_u.detach())``, the
            same values (rollout and the log-prob gates are unchanged), gradient ``g * dv_c`` instead of
            ``(1 - g) * dv_u + g * dv_c``.
        shared_start_noise: Every sample of a request starts from the initial noise of the request's
            sample 0 (the SDE steps still draw their own noise). The start is not an action of either
            policy, so with it shared the rewards within a group differ only by the refinement and the
            trained SDE steps: a cleaner advantage for both experts. Sample 0, and so the serve path,
            is unchanged.
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int | None = None
    num_steps: int = 8
    shift: float | None = None
    noise_level: float | None = None
    sde_window: tuple[int, int] | None = None
    micro_batch_size: int | None = None
    lm_micro_batch_size: int | None = None
    feature_cache_size: int = 4096
    feature_cache_offload: bool = False
    guidance_scale: float = 1.0
    guidance_scale_2: float | None = None
    detach_uncond: bool = False
    shared_start_noise: bool = False

    def __post_init__(self) -> None:
        for moved in ("noise_level", "sde_window"):
            if getattr(self, moved) is not None:
                raise ValueError(
                    f"model.rollout.{moved} moved: the generator algorithm owns its sampler settings; set "
                    f"model.generator_algorithm.init_args.{moved} (in a recipe: under generator_algorithm's init_args)"
                )
        if self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 or null, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1 or null, got {self.micro_batch_size}")
        if self.lm_micro_batch_size is not None and self.lm_micro_batch_size < 1:
            raise ValueError(f"lm_micro_batch_size must be >= 1 or null, got {self.lm_micro_batch_size}")
        if self.feature_cache_size < 1:
            raise ValueError(f"feature_cache_size must be >= 1, got {self.feature_cache_size}")
        if self.shift is not None and self.shift <= 0:
            raise ValueError(f"shift must be > 0, got {self.shift}")
        if self.guidance_scale < 0:
            raise ValueError(f"guidance_scale must be >= 0 (1.0 disables guidance), got {self.guidance_scale}")

    @property
    def guided(self) -> bool:
        """Whether sampling runs classifier-free guidance (an unconditional branch)."""
        return self.guidance_scale != 1.0


@dataclass(frozen=True)
class EvalSampler:
    """How validation and predict sample: the references evaluate with their own settings (Flow-GRPO's SD3
    configs train on 10 steps and evaluate on 40; see ``docs/reproduce.md``). Unset values are the rollout's.

    Args:
        num_steps: Denoising steps of the deterministic (ODE) sampler validation and predict run (None: the
            rollout's ``num_steps``).
        guidance_scale: Classifier-free guidance scale of validation and predict (None: the rollout's).
    """

    num_steps: int | None = None
    guidance_scale: float | None = None

    def __post_init__(self) -> None:
        if self.num_steps is not None and self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1 or null, got {self.num_steps}")
        if self.guidance_scale is not None and self.guidance_scale < 0:
            raise ValueError(f"guidance_scale must be >= 0 or null, got {self.guidance_scale}")

    def apply(self, rollout: RolloutConfig) -> RolloutConfig:
        """The rollout's sampler settings with these in place of the ones they set."""
        changes: dict[str, Any] = {}
        if self.num_steps is not None:
            changes["num_steps"] = self.num_steps
        if self.guidance_scale is not None:
            changes["guidance_scale"] = self.guidance_scale
        return replace(rollout, **changes) if changes else rollout


@dataclass(frozen=True)
class StepPlan:
    """Which denoising steps of each sample a rollout runs stochastically (and records for training).

    Sample ``i`` runs the stochastic step ``kind`` (a key of :data:`unirl_pl.sampling.STOCHASTIC_STEPS`) at
    steps ``[starts[i], starts[i] + size)`` and the ODE elsewhere. ``size == 0`` (or ``noise_level == 0``) is
    the ODE everywhere, with no record. Every sample records the same number of steps, so the record is
    rectangular; where they are varies by sample only when ``starts`` does. An algorithm builds one per
    rollout (:meth:`unirl_pl.algorithms.GeneratorAlgorithm.plan`).

    ``post_solver`` is the ODE after the stochastic steps: ``euler`` (as before them), or ``dpm2``
    (DPM-Solver++(2M), :func:`unirl_pl.sampling.dpm_solver_2m_step`) on the schedule's tail thinned to the
    fraction ``post_keep`` of its points (:func:`unirl_pl.sampling.compress_tail`): MixGRPO-Flash. ``dpm2``
    needs every sample at the same stochastic steps and step count.
    """

    starts: tuple[int, ...]
    size: int
    kind: str = "sde"
    noise_level: float = 0.7
    post_solver: str = "euler"
    post_keep: float = 1.0

    def __post_init__(self) -> None:
        if self.post_solver not in ("euler", "dpm2"):
            raise ValueError(f"post_solver must be 'euler' or 'dpm2', got {self.post_solver!r}")
        if not 0 < self.post_keep <= 1:
            raise ValueError(f"post_keep must be in (0, 1], got {self.post_keep}")
        if self.post_solver == "dpm2" and len(set(self.starts)) > 1:
            raise ValueError("post_solver 'dpm2' needs every sample's stochastic steps at the same place")
        if self.size < 0 or any(s < 0 for s in self.starts):
            raise ValueError(f"a step plan needs size >= 0 and starts >= 0, got size {self.size}, starts {self.starts}")
        if self.noise_level < 0:
            raise ValueError(f"noise_level must be >= 0, got {self.noise_level}")

    @classmethod
    def ode(cls, n: int) -> StepPlan:
        """The deterministic sampler for ``n`` samples: no stochastic step, no record."""
        return cls(starts=(0,) * n, size=0)

    @property
    def stochastic(self) -> bool:
        """Whether any step draws noise (and the rollout returns a record)."""
        return self.size > 0 and self.noise_level > 0

    def least_steps(self) -> list[int]:
        """Per sample, the fewest denoising steps that reach the end of its stochastic steps (1 without any)."""
        return [s + self.size if self.stochastic else 1 for s in self.starts]


def chunk_bounds(n: int, size: int | None) -> list[tuple[int, int]]:
    """Consecutive ``[start, end)`` slices of at most ``size`` items (one slice when size is None)."""
    size = n if size is None else size
    return [(i, min(i + size, n)) for i in range(0, n, max(size, 1))]


@dataclass(frozen=True)
class SampleRequest:
    """One batch of generator samples to draw: what ``DiffusionDenoise.sample`` was asked for.

    Args:
        cond: The conditioning features of every sample (rows of each tensor).
        request_ids: Each sample's request (prompt) id: with ``sample_indices`` and ``seed`` it keys the
            sample's own noise generator.
        sample_indices: Each sample's index within its request.
        seed: The step's sampling seed.
        version: The generator's weight version, stamped on the record.
        uncond: The unconditional features for guidance (None: unguided).
        num_steps: Each sample's own step count (None: the config's for all).
    """

    cond: Any
    request_ids: Sequence[int]
    sample_indices: Sequence[int]
    seed: int
    version: int = 0
    uncond: Any = None
    num_steps: Sequence[int] | None = None
