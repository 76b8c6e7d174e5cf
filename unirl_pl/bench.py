"""CPU-time benchmark of one RL step: the project (Lightning, loops, gates) against a bare-torch floor.

``python -m unirl_pl.bench --config recipes/joint.yaml --prompts-per-step 8 --samples-per-prompt 4``

The **project step** is a real ``trainer.fit`` of the recipe (logger, progress bar, checkpointing and
validation off), timed from the end of one step to the end of the next: batch fetch, the rollout in
``on_after_batch_transfer``, ``training_step``, every callback and Lightning's own bookkeeping. Its
phases are timed by wrapping the instances' methods for the run (decode, text encode, denoise, image
decode, reward, advantages, the LM and DiT losses and their backward, the optimizer steps, each gate);
``overhead`` is the step total minus the phases. The interleave-parity gate runs every ``every_n_steps``
steps (and at fit start, outside the timed steps), so its measured cost enters every step amortized
(``cost / every_n_steps``).

The **floor step** is the same math on the same model objects with no framework: tokenize, a KV-cache
decode loop over the LM with ``torch.multinomial`` on the batch (as many tokens as the project step
decoded), one batched text encode of the step's distinct texts, the flow sampler (ODE outside the SDE
window, :func:`unirl_pl.sampling.flow_sde_step_with_logprob` inside), decode to pixels, the reward terms,
group advantages, the LM's teacher-forced forward with the GRPO loss and backward, the DiT's per-step
forward with the Flow-GRPO loss and backward per step, the KL reference forwards (adapter disabled) when
the expert's ``beta`` > 0, gradient clipping and AdamW steps. It runs right after each project step, on the
same prompts (interleaved, so both see the same machine load); the trainable weights are restored after
it, so the project's run is the run it would have been.

Everything is CPU time of this process (``time.process_time``), not wall time: the numbers hold on a
shared machine. One thread per process unless ``OMP_NUM_THREADS`` says otherwise (:mod:`unirl_pl.threads`),
as the documented numbers were measured.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
import yaml

from unirl_pl.threads import set_threads

PHASES: tuple[str, ...] = (
    "decode",
    "text_encode",
    "denoise",
    "image_decode",
    "reward",
    "advantages",
    "lm_loss",
    "lm_backward",
    "dit_loss",
    "dit_backward",
    "optimizer",
    "gate_c2",
    "gate_ledger",
    "gate_parity",
    "rollout_glue",
    "train_glue",
    "logging",
    "overhead",
)
"""Rows of the table: each a disjoint share of the step. ``rollout_glue`` is the rest of
``ExperienceSource.collect`` and ``train_glue`` the rest of ``training_step`` (metrics, staleness, zero_grad,
finiteness checks), ``logging`` is ``self.log``/``self.log_dict``, and ``overhead`` is what no other row
covers (Lightning's loop, batch fetch, callback dispatch)."""

PROJECT_ONLY = ("gate_c2", "gate_ledger", "gate_parity", "rollout_glue", "train_glue", "logging", "overhead")

GATE_PHASES = ("gate_c2", "gate_ledger", "gate_parity")

clock = time.process_time


# ---------------------------------------------------------------------------------------------- timing
class Recorder:
    """Exclusive CPU time per phase: a call nested in another timed call is subtracted from its parent.

    An ``opaque`` phase (a gate) owns everything it calls: loops a gate runs are not counted as loop phases.
    """

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self._stack: list[list[Any]] = []
        self._opaque = 0

    def current(self) -> str | None:
        """The innermost phase being timed."""
        return self._stack[-1][0] if self._stack else None

    def wrap(self, fn: Callable[..., Any], phase: str | Callable[[], str], opaque: bool = False) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._opaque:
                return fn(*args, **kwargs)
            name = phase() if callable(phase) else phase
            self._stack.append([name, 0.0])
            self._opaque += opaque
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = clock() - start
                self._opaque -= opaque
                _, children = self._stack.pop()
                self.totals[name] += elapsed - children
                if self._stack:
                    self._stack[-1][1] += elapsed

        return timed

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Nothing is recorded inside (the floor step)."""
        self._opaque += 1
        try:
            yield
        finally:
            self._opaque -= 1

    def take(self) -> dict[str, float]:
        """The phase totals since the last call."""
        out = dict(self.totals)
        self.totals.clear()
        return out


class Patches:
    """Attribute replacements that are undone in reverse order."""

    def __init__(self) -> None:
        self._undo: list[tuple[Any, str, bool, Any]] = []

    def set(self, obj: Any, name: str, value: Any) -> None:
        own = name in getattr(obj, "__dict__", {})
        self._undo.append((obj, name, own, getattr(obj, name) if own else None))
        setattr(obj, name, value)

    def wrap(
        self, recorder: Recorder, obj: Any, name: str, phase: str | Callable[[], str], opaque: bool = False
    ) -> None:
        self.set(obj, name, recorder.wrap(getattr(obj, name), phase, opaque))

    def undo(self) -> None:
        for obj, name, own, old in reversed(self._undo):
            if own:
                setattr(obj, name, old)
            else:
                delattr(obj, name)
        self._undo.clear()


# ---------------------------------------------------------------------------------------------- floor
def _positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.long().cumsum(-1) - 1).clamp_min(0)


class Floor:
    """The bare-torch step on the module's own experts (joint mode, ``ComponentGenerator``, M = 1)."""

    def __init__(self, model: Any, layout: Any, seed: int = 0) -> None:
        from unirl_pl.generators import ComponentGenerator

        if model.mode != "joint" or model.llm is None:
            raise ValueError(f"the floor covers the joint mode with a refiner LM, got mode={model.mode!r}")
        if not isinstance(model.generator, ComponentGenerator):
            raise ValueError("the floor covers the ComponentGenerator (tiny and ShapesWorld recipes)")
        if layout.images_per_refinement != 1:
            raise ValueError("the floor covers one image per text sample (images_per_refinement=1)")
        self.model, self.layout = model, layout
        self.cfg = model.rollout_config
        self.llm, self.gen = model.llm, model.generator
        self.lm = model.llm.model  # the peft model
        self.dit = model.generator.transformer.model  # the diffusers transformer with its adapter
        self.tokenizer = model.llm.tokenizer
        base = self.lm.get_base_model()
        import inspect

        self.cache_kw = "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
        self.params = {
            name: [p for p in model.experts()[name].parameters() if p.requires_grad] for name in ("llm", "transformer")
        }
        self.opts = {name: model.optimizer_factories[name](ps) for name, ps in self.params.items()}
        self.generator = torch.Generator().manual_seed(seed)

    def _lm(self, **kwargs: Any) -> Any:
        cache = kwargs.pop("cache", None)
        if cache is not None:
            kwargs[self.cache_kw] = cache
        return self.lm(**kwargs)

    def _velocity(self, x: torch.Tensor, sigma: float, hidden: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        t = torch.full((x.shape[0],), sigma * 1000.0)
        if cfg.guided:
            u_h, u_p = self._uncond
            n = x.shape[0]
            h = torch.cat([hidden, u_h.expand(n, *u_h.shape[1:])])
            p = torch.cat([pooled, u_p.expand(n, *u_p.shape[1:])])
            (v,) = self.dit(
                hidden_states=torch.cat([x, x]),
                encoder_hidden_states=h,
                pooled_projections=p,
                timestep=torch.cat([t, t]),
                return_dict=False,
            )
            v_c, v_u = v.split(n)
            return v_u + cfg.guidance_scale * (v_c - v_u)
        (v,) = self.dit(
            hidden_states=x, encoder_hidden_states=hidden, pooled_projections=pooled, timestep=t, return_dict=False
        )
        return v

    @contextmanager
    def _dit_reference(self) -> Iterator[None]:
        self.dit.disable_adapters()
        try:
            yield
        finally:
            self.dit.enable_adapters()

    def step(self, prompts: Sequence[str], num_tokens: int) -> dict[str, float]:
        """One floor step on ``prompts``, decoding ``num_tokens`` tokens; CPU seconds by phase and ``total``."""
        from transformers import DynamicCache

        from unirl_pl.sampling import flow_sde_step_with_logprob, flow_sigmas

        cfg, layout, g = self.cfg, self.layout, self.generator
        tok, llm = self.tokenizer, self.llm
        p, k, skip = len(prompts), layout.samples_per_prompt, layout.num_skip_refinement
        n = p * k
        rows = [i for i in range(n) if i % k >= skip]
        texts = [q for q in prompts for _ in range(k)]
        times: dict[str, float] = {}
        mark = [clock()]

        def lap(name: str) -> None:
            now = clock()
            times[name] = times.get(name, 0.0) + now - mark[0]
            mark[0] = now

        start = mark[0]
        # ---- decode: tokenize, KV-cache loop, batched multinomial, detokenize
        with torch.no_grad():
            if llm.chat is None or not llm.chat.use_chat_template:
                enc = tok([texts[i] for i in rows], return_tensors="pt", padding=True)
            else:
                enc = llm.tokenize_requests([texts[i] for i in rows])
            ids, mask = enc["input_ids"], enc["attention_mask"]
            prompt_len = ids.shape[1]
            cache = DynamicCache()
            out = self._lm(
                input_ids=ids, attention_mask=mask, position_ids=_positions(mask), cache=cache, use_cache=True
            )
            next_pos = _positions(mask)[:, -1:] + 1
            finished = torch.zeros(len(rows), dtype=torch.bool)
            eos, pad = tok.eos_token_id, tok.pad_token_id
            toks, logps, live = [], [], []
            for t in range(num_tokens):
                logits = out.logits[:, -1].float() / cfg.temperature
                if cfg.top_k is not None and cfg.top_k < logits.shape[-1]:
                    kth = torch.topk(logits, cfg.top_k, dim=-1).values[..., -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                logp_all = torch.log_softmax(logits, dim=-1)
                tok_t = torch.multinomial(logp_all.exp(), 1, generator=g)[:, 0]
                tok_t = torch.where(finished, torch.full_like(tok_t, pad), tok_t)
                live.append(~finished)
                logps.append(logp_all.gather(-1, tok_t[:, None])[:, 0])
                toks.append(tok_t)
                finished = finished | (tok_t == eos)
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                if t == num_tokens - 1:
                    break
                out = self._lm(
                    input_ids=tok_t[:, None], attention_mask=mask, position_ids=next_pos, cache=cache, use_cache=True
                )
                next_pos = next_pos + 1
            gen, gen_mask = torch.stack(toks, 1), torch.stack(live, 1)
            old_lm_logp = torch.stack(logps, 1) * gen_mask
            replies = [tok.decode(r[m], skip_special_tokens=True) for r, m in zip(gen, gen_mask, strict=True)]
            refined, _ = llm.parse_replies(replies, [texts[i] for i in rows])
            image_texts = list(texts)
            for i, text in zip(rows, refined, strict=True):
                image_texts[i] = text
            lap("decode")

            # ---- text encode: the step's distinct texts in one batch
            distinct = list(dict.fromkeys(image_texts))
            where = torch.tensor([distinct.index(t) for t in image_texts])
            hidden, pooled = self.gen.text_encoder.encode(distinct)
            hidden, pooled = hidden[where], pooled[where]
            if cfg.guided:
                self._uncond = self.gen.text_encoder.encode([""])
            lap("text_encode")

            # ---- denoise: ODE outside the window, SDE with log-prob inside
            sigmas = flow_sigmas(cfg.num_steps, cfg.shift or 1.0).tolist()
            w0, w1 = cfg.sde_window
            x = torch.randn(n, *self.gen.latent_shape, generator=g)
            prev, sample, old_dit_logp = [], [], []
            for i in range(cfg.num_steps):
                v = self._velocity(x, sigmas[i], hidden, pooled)
                if w0 <= i < w1 and cfg.noise_level > 0:
                    x_next, logp, _, _ = flow_sde_step_with_logprob(
                        x, v, sigmas[i], sigmas[i + 1], sigma_max=sigmas[1], noise_level=cfg.noise_level, generator=g
                    )
                    prev.append(x)
                    sample.append(x_next)
                    old_dit_logp.append(logp)
                else:
                    x_next = x + (sigmas[i + 1] - sigmas[i]) * v
                x = x_next
            lap("denoise")

            images = self.gen.decode(x)
            lap("image_decode")

            originals = [prompts[i // k] for i in range(n)]
            weights, terms = self.model.reward_fn.weights, self.model.reward_fn.terms
            rewards = sum(
                weights[name] * torch.as_tensor(fn(originals, image_texts, images), dtype=torch.float32).reshape(n)
                for name, fn in terms.items()
            )
            lap("reward")

            grouped = rewards.view(p, k)
            adv = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, unbiased=False, keepdim=True) + 1e-4)
            adv = adv.clamp(-self.model.advantage.clip_max, self.model.advantage.clip_max).flatten()
            lm_adv = adv[rows]
            lap("advantages")

        # ---- LM: teacher-forced forward, reference forward, GRPO token loss, backward
        lm_set = self.model.losses["llm"]
        full = torch.cat([ids, gen], 1)
        fpos = _positions(mask)

        def lm_logp() -> torch.Tensor:
            logits = self._lm(input_ids=full, attention_mask=mask, position_ids=fpos).logits
            logits = logits[:, prompt_len - 1 : -1].float() / cfg.temperature
            lp = torch.log_softmax(logits, -1).gather(-1, gen[..., None])[..., 0]
            return torch.where(gen_mask, lp, torch.zeros_like(lp))

        logp = lm_logp()
        m = gen_mask.float()
        ratio = torch.exp(logp - old_lm_logp)
        a = lm_adv[:, None]
        per_token = torch.maximum(-a * ratio, -a * ratio.clamp(1 - lm_set.clip_eps, 1 + lm_set.clip_eps))
        loss = (per_token * m).sum() / m.sum().clamp_min(1)
        if lm_set.beta > 0:
            with torch.no_grad(), self.lm.disable_adapter():
                ref = lm_logp()
            d = ref - logp
            loss = loss + lm_set.beta * ((torch.exp(d) - d - 1) * m).sum() / m.sum().clamp_min(1)
        lap("lm_loss")
        loss.backward()
        lap("lm_backward")

        # ---- DiT: per SDE step forward, reference forward, Flow-GRPO loss, backward per step
        dit_set = self.model.losses["transformer"]
        steps = len(prev)
        for j in range(steps):
            i = w0 + j
            v = self._velocity(prev[j], sigmas[i], hidden, pooled)
            _, logp, mean, std = flow_sde_step_with_logprob(
                prev[j],
                v,
                sigmas[i],
                sigmas[i + 1],
                sigma_max=sigmas[1],
                noise_level=cfg.noise_level,
                prev_sample=sample[j],
            )
            ratio = torch.exp(logp - old_dit_logp[j])
            clipped = ratio.clamp(1 - dit_set.clip_eps, 1 + dit_set.clip_eps)
            loss = torch.maximum(-adv * ratio, -adv * clipped).mean()
            if dit_set.beta > 0:
                with torch.no_grad(), self._dit_reference():
                    v_ref = self._velocity(prev[j], sigmas[i], hidden, pooled)
                    _, _, ref_mean, _ = flow_sde_step_with_logprob(
                        prev[j],
                        v_ref,
                        sigmas[i],
                        sigmas[i + 1],
                        sigma_max=sigmas[1],
                        noise_level=cfg.noise_level,
                        prev_sample=sample[j],
                    )
                kl = ((mean - ref_mean) ** 2).flatten(1).mean(1) / (2 * std.flatten(1)[:, 0] ** 2)
                loss = loss + dit_set.beta * kl.mean()
            lap("dit_loss")
            (loss / steps).backward()
            lap("dit_backward")

        # ---- clip and AdamW
        for name, params in self.params.items():
            clip = self.model.losses[name].grad_clip
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(params, clip)
            self.opts[name].step()
            self.opts[name].zero_grad(set_to_none=True)
        lap("optimizer")
        times["total"] = clock() - start
        return times


# ---------------------------------------------------------------------------------------------- project
@dataclass
class RunResult:
    """Per-repetition CPU seconds by phase (plus ``total``) of the project and the floor, one gate setting."""

    gates: bool
    images_per_step: int
    project: list[dict[str, float]] = field(default_factory=list)
    floor: list[dict[str, float]] = field(default_factory=list)
    parity_cost: float = 0.0
    parity_every: int = 0
    tokens: list[int] = field(default_factory=list)

    def median(self, side: str, phase: str) -> float:
        return statistics.median(rep.get(phase, 0.0) for rep in getattr(self, side))

    def span(self, side: str, phase: str) -> tuple[float, float]:
        values = [rep.get(phase, 0.0) for rep in getattr(self, side)]
        return min(values), max(values)

    @property
    def ratio(self) -> float:
        """Median over repetitions of project total / floor total (interleaved pairs)."""
        return statistics.median(a["total"] / b["total"] for a, b in zip(self.project, self.floor, strict=True))

    @property
    def gate_share(self) -> float:
        """Median over repetitions of gate time / (step total - gate time)."""
        return statistics.median(
            sum(r.get(g, 0.0) for g in GATE_PHASES) / (r["total"] - sum(r.get(g, 0.0) for g in GATE_PHASES))
            for r in self.project
        )


class _Interleave(pl.Callback):
    """Times each project step (end of the previous step, or of the floor step after it, to this one's
    end) and runs a floor step on the same prompts right after it."""

    def __init__(self, recorder: Recorder, floor_factory: Callable[[], Floor], warmup: int, result: RunResult) -> None:
        self.recorder, self.floor_factory, self.warmup, self.result = recorder, floor_factory, warmup, result
        self.floor: Floor | None = None
        self.prompts: list[str] = []
        self.mark = 0.0
        self.parity_costs: list[float] = []
        self.steps = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        fit_start = self.recorder.take()
        if fit_start.get("gate_parity"):
            self.parity_costs.append(fit_start["gate_parity"])
        self.floor = self.floor_factory()
        self.mark = clock()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        total = clock() - self.mark
        phases = self.recorder.take()
        parity = phases.pop("gate_parity", 0.0)
        if parity:
            self.parity_costs.append(parity)
            total -= parity
        phases["total"] = total
        num_tokens = (
            int(batch.lm.gen_mask.shape[1]) if batch.lm is not None else pl_module.rollout_config.max_new_tokens
        )
        assert self.floor is not None
        saved = [[p.detach().clone() for p in ps] for ps in self.floor.params.values()]
        with self.recorder.paused():
            floor = self.floor.step(self.prompts, num_tokens)
        for ps, copies in zip(self.floor.params.values(), saved, strict=True):
            for param, copy in zip(ps, copies, strict=True):
                param.data.copy_(copy)
                param.grad = None
        if self.steps >= self.warmup:
            self.result.project.append(phases)
            self.result.floor.append(floor)
            self.result.tokens.append(num_tokens)
        self.steps += 1
        self.mark = clock()


def _loss_callers() -> list[Any]:
    """The modules that call ``lm_loss`` and ``dit_loss`` by a name of their own."""
    import importlib

    found = []
    # The algorithms (unirl_pl.algorithms) call them as attributes of unirl_pl.method.grpo.
    for name in ("unirl_pl.method.grpo", "unirl_pl.method.policy", "unirl_pl.module"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "lm_loss") and hasattr(module, "dit_loss"):
            found.append(module)
    if not found:
        raise RuntimeError("no module calls lm_loss/dit_loss by name: update unirl_pl.bench._loss_callers")
    return found


def _step_callbacks(recipe: str) -> list[Any]:
    """The recipe's callbacks less the progress bar (off) and the checkpoint one (periodic file I/O, not
    step compute; it would also write into the recipe's run folder)."""
    with open(recipe) as f:
        config = yaml.safe_load(f) or {}
    callbacks = (config.get("trainer") or {}).get("callbacks") or []
    dropped = ("ProgressBar", "ModelCheckpoint", "RunCheckpoint")
    return [c for c in callbacks if not str(c.get("class_path", "") if isinstance(c, dict) else c).endswith(dropped)]


def run_project(
    recipe: str,
    gates: bool,
    prompts_per_step: int | None,
    samples_per_prompt: int | None,
    repeats: int,
    warmup: int,
    overrides: Sequence[str] = (),
    root: str | None = None,
) -> RunResult:
    """Build the recipe through the CLI and fit ``warmup + repeats`` steps, each followed by a floor step.

    Files written at fit end go under ``root`` (a temporary folder when None).
    """
    if root is None:
        with tempfile.TemporaryDirectory(prefix="unirl_bench_") as tmp:
            return run_project(recipe, gates, prompts_per_step, samples_per_prompt, repeats, warmup, overrides, tmp)
    # Anything a callback writes at fit end (RunSummary's reward curve) goes to ``root``, not the repository.
    import unirl_pl.method.experience as experience_mod
    import unirl_pl.module as module_mod
    from unirl_pl.callbacks import InterleaveParityCheck, LogProbIdentityCheck, WeightVersionLedger
    from unirl_pl.cli import main

    args = [
        "--config",
        recipe,
        "--trainer.logger=false",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.enable_model_summary=false",
        "--trainer.limit_val_batches=0",
        "--trainer.num_sanity_val_steps=0",
        f"--trainer.max_steps={warmup + repeats}",
        "--trainer.callbacks=" + json.dumps(_step_callbacks(recipe)),
    ]
    if prompts_per_step is not None:
        args.append(f"--data.prompts_per_step={prompts_per_step}")
    if samples_per_prompt is not None:
        args.append(f"--data.samples_per_prompt={samples_per_prompt}")
    args.extend(overrides)
    args.append(f"--trainer.default_root_dir={root}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cli = main(args, run=False)
    trainer, model, data = cli.trainer, cli.model, cli.datamodule
    gate_types = (LogProbIdentityCheck, InterleaveParityCheck, WeightVersionLedger)
    # SaveConfigCallback would write config.yaml into the working directory: not part of a step.
    kept = [c for c in trainer.callbacks if type(c).__name__ != "SaveConfigCallback"]
    trainer.callbacks = kept if gates else [c for c in kept if not isinstance(c, gate_types)]

    recorder, patches = Recorder(), Patches()
    model.configure_model()
    p = data.prompts_per_step
    result = RunResult(
        gates=gates, images_per_step=p * data.layout.samples_per_prompt * data.layout.images_per_refinement
    )
    interleave = _Interleave(recorder, lambda: Floor(model, data.layout), warmup, result)
    trainer.callbacks.append(interleave)
    source = model.source
    assert source is not None
    try:
        original_collect = source.collect

        def collect(batch: Any, device: Any) -> Any:
            interleave.prompts = list(batch.prompts)
            return original_collect(batch, device)

        patches.set(source, "collect", recorder.wrap(collect, "rollout_glue"))
        patches.wrap(recorder, model, "training_step", "train_glue")
        patches.wrap(recorder, model, "log", "logging")
        patches.wrap(recorder, model, "log_dict", "logging")
        patches.wrap(recorder, module_mod, "log_step", "logging")
        if source.ar_decode is not None:
            patches.wrap(recorder, source.ar_decode, "sample", "decode")
        patches.wrap(recorder, source.conditioning, "encode", "text_encode")
        patches.wrap(recorder, source.diffusion_denoise, "sample", "denoise")
        patches.wrap(recorder, source.conditioning, "decode", "image_decode")
        patches.wrap(recorder, source, "reward", "reward")
        patches.wrap(recorder, experience_mod, "compute_advantages", "advantages")
        # The losses are called by name from the module that imported them (the policy, or the LightningModule).
        for caller in _loss_callers():
            patches.wrap(recorder, caller, "lm_loss", "lm_loss")
            patches.wrap(recorder, caller, "dit_loss", "dit_loss")
        patches.wrap(
            recorder,
            model,
            "manual_backward",
            lambda: "dit_backward" if recorder.current() == "dit_loss" else "lm_backward",
        )
        patches.wrap(recorder, model, "_step", "optimizer")
        patches.wrap(recorder, model, "_grad_norm", "optimizer")
        for callback in trainer.callbacks:
            if isinstance(callback, LogProbIdentityCheck):
                patches.wrap(recorder, callback, "on_policy_logprobs", "gate_c2", opaque=True)
            elif isinstance(callback, WeightVersionLedger):
                patches.wrap(recorder, callback, "on_train_batch_end", "gate_ledger", opaque=True)
            elif isinstance(callback, InterleaveParityCheck):
                patches.wrap(recorder, callback, "check", "gate_parity", opaque=True)
                result.parity_every = callback.every_n_steps
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(model, datamodule=data)
    finally:
        patches.undo()
    if result.parity_every and interleave.parity_costs:
        result.parity_cost = statistics.mean(interleave.parity_costs)
        share = result.parity_cost / result.parity_every
        for rep in result.project:
            rep["gate_parity"] = share
            rep["total"] += share
    for side in (result.project, result.floor):
        for rep in side:
            rep["overhead"] = rep["total"] - sum(v for k, v in rep.items() if k not in ("total", "overhead"))
    return result


# ---------------------------------------------------------------------------------------------- report
def format_table(result: RunResult, recipe: str, repeats: int, warmup: int) -> str:
    """The per-phase table of one gate setting (milliseconds of CPU time per step)."""
    ms = 1000.0
    n = result.images_per_step
    tokens = statistics.median(result.tokens) if result.tokens else 0
    lines = [
        f"{recipe}: {n} images/step, gates {'on' if result.gates else 'off'}, median of {len(result.project)} "
        f"steps after {warmup} warmup (decode {tokens:g} tokens); CPU ms per step",
        f"{'phase':<14}{'project median (min-max)':>30}{'floor median':>14}{'ratio':>8}",
    ]
    for phase in PHASES:
        proj = result.median("project", phase)
        lo, hi = result.span("project", phase)
        floor = result.median("floor", phase)
        ratio = f"{proj / floor:.2f}" if phase not in PROJECT_ONLY and floor > 1e-9 else "-"
        lines.append(f"{phase:<14}{f'{proj * ms:.1f} ({lo * ms:.1f}-{hi * ms:.1f})':>30}{floor * ms:>14.1f}{ratio:>8}")
    proj, floor = result.median("project", "total"), result.median("floor", "total")
    lo, hi = result.span("project", "total")
    lines.append(
        f"{'total':<14}{f'{proj * ms:.1f} ({lo * ms:.1f}-{hi * ms:.1f})':>30}{floor * ms:>14.1f}{result.ratio:>8.2f}"
    )
    lines.append(f"images/s (CPU): project {n / proj:.1f}, floor {n / floor:.1f}")
    if result.gates:
        parity = (
            f"parity check {result.parity_cost * ms:.1f} ms every {result.parity_every} steps"
            if result.parity_every
            else "no parity gate"
        )
        lines.append(f"gates: {result.gate_share:.1%} of the rest of the step ({parity})")
    return "\n".join(lines)


@dataclass
class BenchResult:
    """Both gate settings' runs (whichever were asked for) and the printed report."""

    runs: dict[str, RunResult]
    report: str

    @property
    def gate_overhead(self) -> float | None:
        """Total ratio with gates on over total ratio with gates off, minus 1 (None unless both ran)."""
        if "on" not in self.runs or "off" not in self.runs:
            return None
        return self.runs["on"].ratio / self.runs["off"].ratio - 1


def run(argv: Sequence[str] | None = None) -> BenchResult:
    """Parse ``argv`` (unknown ``--key=value`` arguments go to the CLI as overrides) and run the bench."""
    parser = argparse.ArgumentParser(prog="python -m unirl_pl.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the recipe (e.g. recipes/joint.yaml)")
    parser.add_argument("--prompts-per-step", type=int, default=None, help="P (default: the recipe's)")
    parser.add_argument("--samples-per-prompt", type=int, default=None, help="K (default: the recipe's)")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps (the medians' sample)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--gates", choices=("on", "off", "both"), default="on")
    args, overrides = parser.parse_known_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        parser.error("need --repeats >= 1 and --warmup >= 0")
    set_threads()
    settings = ("on", "off") if args.gates == "both" else (args.gates,)
    runs = {}
    for setting in settings:
        runs[setting] = run_project(
            args.config,
            setting == "on",
            args.prompts_per_step,
            args.samples_per_prompt,
            args.repeats,
            args.warmup,
            overrides,
        )
    tables = [format_table(r, args.config, args.repeats, args.warmup) for r in runs.values()]
    result = BenchResult(runs, "")
    if result.gate_overhead is not None:
        tables.append(
            f"gate overhead (total ratio on / off - 1): {result.gate_overhead:+.1%}; "
            f"measured share with gates on: {runs['on'].gate_share:.1%}"
        )
    result.report = "\n\n".join(tables)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    result = run(argv)
    print(result.report)
    return 0 if all(math.isfinite(r.ratio) and r.ratio > 0 for r in result.runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
