"""The floor step: one RL step's math as bare torch on the module's own experts, no framework.

Tokenize, a KV-cache decode loop over the LM with ``torch.multinomial`` on the batch (as many tokens as the
project step decoded), one batched text encode of the step's distinct texts, the flow sampler (ODE outside
the SDE window, the recipe's stochastic step inside: Flow-GRPO's SDE or Flow-CPS), decode to pixels, the reward
terms, group advantages, the LM's teacher-forced forward with the GRPO loss and backward, the DiT's per-step
forward with the Flow-GRPO loss and backward per step, the KL reference forwards (adapter disabled) when the
expert's ``beta`` > 0, gradient clipping and AdamW steps. It times itself phase by phase (the same rows as
the project step, :data:`unirl_pl.bench.record.PHASES`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from unirl_pl.bench.record import clock
from unirl_pl.card import Role


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
        from unirl_pl.algorithms import FlowCPS, FlowGRPO
        from unirl_pl.sampling import STOCHASTIC_STEPS

        algorithm = model.generator_algorithm
        if type(algorithm) not in (FlowGRPO, FlowCPS) or algorithm.guard:
            raise ValueError(
                f"the floor covers Flow-GRPO and Flow-CPS on a fixed window, got {type(algorithm).__name__}"
            )
        self.model, self.layout = model, layout
        self.cfg = model.rollout_config
        # The recipe's own stochastic step (Flow-GRPO's SDE or CPS), noise level and window.
        self.stochastic_step = STOCHASTIC_STEPS[algorithm.kind]
        self.noise_level, self.window = algorithm.noise_level(self.cfg), algorithm.window(self.cfg)
        self.llm, self.gen = model.llm, model.generator
        self.lm = model.llm.model  # the peft model
        self.dit = model.generator.transformer.model  # the diffusers transformer with its adapter
        self.tokenizer = model.llm.tokenizer
        base = self.lm.get_base_model()
        import inspect

        self.cache_kw = "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
        self.params = {
            name: [p for p in model.experts()[name].parameters() if p.requires_grad]
            for name in (Role.REFINER, Role.GENERATOR)
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

        from unirl_pl.sampling import flow_sigmas

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
            old_lm_logp = torch.where(gen_mask, torch.stack(logps, 1), 0.0)
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
            (w0, w1), noise, step_fn = self.window, self.noise_level, self.stochastic_step
            x = torch.randn(n, *self.gen.latent_shape, generator=g)
            prev, sample, old_dit_logp = [], [], []
            for i in range(cfg.num_steps):
                v = self._velocity(x, sigmas[i], hidden, pooled)
                if w0 <= i < w1 and noise > 0:
                    x_next, logp, _, _ = step_fn(
                        x, v, sigmas[i], sigmas[i + 1], sigma_max=sigmas[1], noise_level=noise, generator=g
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
        lm_set = self.model.losses[Role.REFINER]
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
        dit_set = self.model.losses[Role.GENERATOR]
        steps = len(prev)
        for j in range(steps):
            i = w0 + j
            v = self._velocity(prev[j], sigmas[i], hidden, pooled)
            _, logp, mean, std = step_fn(
                prev[j],
                v,
                sigmas[i],
                sigmas[i + 1],
                sigma_max=sigmas[1],
                noise_level=noise,
                prev_sample=sample[j],
            )
            ratio = torch.exp(logp - old_dit_logp[j])
            clipped = ratio.clamp(1 - dit_set.clip_eps, 1 + dit_set.clip_eps)
            loss = torch.maximum(-adv * ratio, -adv * clipped).mean()
            if dit_set.beta > 0:
                with torch.no_grad(), self._dit_reference():
                    v_ref = self._velocity(prev[j], sigmas[i], hidden, pooled)
                    _, _, ref_mean, _ = step_fn(
                        prev[j],
                        v_ref,
                        sigmas[i],
                        sigmas[i + 1],
                        sigma_max=sigmas[1],
                        noise_level=noise,
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
