"""The sigma schedule a diffusers pipeline samples with, computed by the pipeline folder's own scheduler.

A family pipeline does not sample on ``linspace(1, 0)``: SD3.5's ``FlowMatchEulerDiscreteScheduler``
shifts the sigmas (shift 3.0), FLUX.1-dev shifts them by ``mu``, a function of the image sequence length
(dynamic shifting), and Wan's ``UniPCMultistepScheduler`` uses flow sigmas with ``flow_shift``. Rather
than re-deriving those formulas, the schedule here is read off the scheduler class the folder names in
``scheduler/scheduler_config.json``, after ``set_timesteps`` with exactly the arguments the pipeline
passes (the family supplies them: ``mu``, custom ``sigmas``). The Flow-GRPO sampler then steps on
these sigmas (Euler / SDE), whatever solver the pipeline itself would use between them.

A ``rollout.shift`` override does not leave the pipeline's scheduler either: the same class is built from
the same config with that shift in place of its own (``shifted_config``: ``flow_shift`` for a flow-sigma
scheduler such as Wan's UniPC, ``shift`` for ``FlowMatchEulerDiscreteScheduler``, dynamic shifting off),
so Wan2.2's shift 12 at 4 steps gives UniPC's 0.8006 rather than the SD3 formula's 0.8.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import diffusers
import torch
from diffusers.pipelines.flux.pipeline_flux import calculate_shift
from torch import Tensor

from unirl_pl.generators.folder import has_component, read_model_index
from unirl_pl.paths import read_json_file

SCHEDULER_CONFIG = Path("scheduler") / "scheduler_config.json"
# A first sigma this close to 1 is 1: the start is pure noise (see ``scheduler_sigmas``).
FIRST_SIGMA_SNAP = 1e-5


@dataclass(frozen=True)
class Schedule:
    """A sampling schedule: ``num_steps + 1`` float64 sigmas from 1 down to 0 and where they came from.

    Args:
        sigmas: The sigmas, first 1.0 (pure noise), last 0.0 (the clean sample).
        source: A human-readable origin, e.g. ``FlowMatchEulerDiscreteScheduler(shift=3.0) of /models/sd35``.
        details: The scheduler arguments that shaped it (``mu``, ``shift`` ...), for ``schedule.json``.
    """

    sigmas: Tensor
    source: str
    details: dict[str, Any] = field(default_factory=dict)


def read_scheduler_config(folder: str | Path) -> dict[str, Any]:
    """The scheduler config of a pipeline folder; ``FileNotFoundError`` naming the file when absent."""
    file = Path(folder) / SCHEDULER_CONFIG
    if not file.is_file():
        raise FileNotFoundError(
            f"{str(file)!r} is missing: the pipeline folder has no scheduler to take the schedule from"
        )
    return read_json_file(file)


def scheduler_from_config(config: dict[str, Any]) -> Any:
    """Instantiate the diffusers scheduler class ``config["_class_name"]`` from ``config``."""
    name = config.get("_class_name")
    cls = getattr(diffusers, str(name), None)
    if cls is None or not hasattr(cls, "set_timesteps"):
        raise ValueError(f"scheduler class {name!r} is not a diffusers scheduler")
    return cls.from_config(config)


def shifted_config(config: dict[str, Any], shift: float) -> tuple[dict[str, Any], str]:
    """``config`` with its scheduler's own shift replaced by ``shift``, and the key replaced: ``flow_shift``
    for a scheduler sampling flow sigmas (``use_flow_sigmas``: UniPC, DPM-Solver), else ``shift``
    (``FlowMatchEulerDiscreteScheduler``). Dynamic shifting is turned off, or it would replace the shift by
    its ``mu``. ``ValueError`` for a scheduler class with neither."""
    name = config.get("_class_name")
    cls = getattr(diffusers, str(name), None)
    accepted = set(inspect.signature(cls.__init__).parameters) if cls is not None else set()
    if config.get("use_flow_sigmas") and "flow_shift" in accepted:
        key = "flow_shift"
    elif "shift" in accepted:
        key = "shift"
    else:
        raise ValueError(
            f"model.rollout.shift={shift}: the pipeline's scheduler {name!r} has no shift to replace (neither "
            "shift nor flow_shift with use_flow_sigmas); unset model.rollout.shift to sample on its own schedule"
        )
    out = {**config, key: float(shift)}
    if out.get("use_dynamic_shifting"):
        out["use_dynamic_shifting"] = False
    return out, key


def scheduler_sigmas(
    scheduler: Any, num_steps: int, *, sigmas: list[float] | None = None, mu: float | None = None
) -> Tensor:
    """``scheduler.sigmas`` after ``set_timesteps`` called as the diffusers pipelines call it
    (``retrieve_timesteps``: custom ``sigmas`` replace ``num_inference_steps``; ``mu`` only where the
    scheduler takes it), as float64 (N + 1,); a first sigma within ``FIRST_SIGMA_SNAP`` of 1 becomes 1.
    Raises ``ValueError`` when the result is not a flow schedule from 1 to 0 with ``num_steps`` steps
    (e.g. a scheduler that inverts or repeats sigmas)."""
    accepted = set(inspect.signature(scheduler.set_timesteps).parameters)
    kwargs: dict[str, Any] = {"device": "cpu"}
    if mu is not None and "mu" in accepted:
        kwargs["mu"] = mu
    if sigmas is not None and "sigmas" in accepted:
        scheduler.set_timesteps(sigmas=sigmas, **kwargs)
    else:
        scheduler.set_timesteps(num_steps, **kwargs)
    out = torch.as_tensor(scheduler.sigmas).to(torch.float64).flatten()
    name = type(scheduler).__name__
    if 0 < 1.0 - float(out[0]) <= FIRST_SIGMA_SNAP:
        # UniPC's flow sigmas start at 1 - 1e-6 in float32. Both the pipeline and this sampler start from
        # pure noise; Flow-GRPO's SDE variance uses its sigma_max substitute only at exactly 1, and at
        # 1 - 1e-6 the std would be ~1000x the noise level.
        out[0] = 1.0
    if out.numel() != num_steps + 1:
        raise ValueError(f"{name} gave {out.numel()} sigmas for {num_steps} steps (expected {num_steps + 1})")
    if float(out[0]) != 1.0 or float(out[-1]) != 0.0 or bool((out[1:] > out[:-1]).any()):
        raise ValueError(f"{name} gave sigmas {out.tolist()}: the sampler needs a decreasing schedule from 1 to 0")
    return out


def pipeline_shift(scheduler_config: dict[str, Any], image_seq_len: int, default_max_shift: float) -> float:
    """``mu`` of dynamic shifting for ``image_seq_len`` latent tokens, by diffusers' own ``calculate_shift``
    with the scheduler config's ``base/max_image_seq_len`` and ``base/max_shift`` (the default of
    ``max_shift`` differs by pipeline: 1.15 in FLUX, 1.16 in SD3)."""
    return float(
        calculate_shift(
            image_seq_len,
            scheduler_config.get("base_image_seq_len", 256),
            scheduler_config.get("max_image_seq_len", 4096),
            scheduler_config.get("base_shift", 0.5),
            scheduler_config.get("max_shift", default_max_shift),
        )
    )


def pipeline_schedule(
    folder: str | Path,
    num_steps: int,
    schedule_kwargs: Callable[[int, dict[str, Any]], dict[str, Any]],
    label: str,
    shift: float | None = None,
) -> Schedule:
    """The ``num_steps`` sigmas of the pipeline in ``folder``: its scheduler config with the family's extra
    ``set_timesteps`` arguments from ``schedule_kwargs(num_steps, config)``; ``label`` names the pipeline.
    ``shift`` (a ``rollout.shift`` override) replaces the scheduler's own shift first (``shifted_config``)."""
    config = read_scheduler_config(folder)
    # The pipeline instantiates the class model_index.json names for its scheduler, whatever the scheduler
    # config's own _class_name says.
    entry = read_model_index(folder).get("scheduler")
    if has_component({"scheduler": entry}, "scheduler"):
        config = {**config, "_class_name": entry[1]}
    if shift is not None:
        config, _ = shifted_config(config, shift)
    # The pipeline reads its scheduler's config with the class defaults filled in: an unset max_shift is
    # FlowMatchEulerDiscreteScheduler's 1.15, not StableDiffusion3Pipeline's fallback 1.16.
    scheduler = scheduler_from_config(config)
    kwargs = schedule_kwargs(num_steps, dict(scheduler.config))
    sigmas = scheduler_sigmas(scheduler, num_steps, **kwargs)
    keys = ("shift", "flow_shift", "use_dynamic_shifting", "shift_terminal")
    details = {"scheduler": config.get("_class_name"), **{k: config[k] for k in keys if config.get(k) is not None}}
    if kwargs.get("mu") is not None:
        details["mu"] = float(kwargs["mu"])
    described = ", ".join(f"{k}={v}" for k, v in details.items() if k != "scheduler")
    return Schedule(sigmas, f"{config.get('_class_name')}({described}) of {label}", details)
