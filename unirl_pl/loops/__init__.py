"""The two loops of the design, each sampled in a profile (``serve``, ``rollout``) and re-scored for
training: ``ar_decode`` (the refiner's tokens) and ``diffusion_denoise`` (the flow sampler)."""

from unirl_pl.loops.ar_decode import ARDecode
from unirl_pl.loops.config import EvalSampler, Profile, RolloutConfig, chunk_bounds
from unirl_pl.loops.diffusion_denoise import SCHEDULE_FILE, DiffusionDenoise, write_schedule

__all__ = [
    "SCHEDULE_FILE",
    "ARDecode",
    "DiffusionDenoise",
    "Profile",
    "RolloutConfig",
    "EvalSampler",
    "chunk_bounds",
    "write_schedule",
]
