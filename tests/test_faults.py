"""Faults that once slipped past the suite, each pinned by a test that fails on it.

Each test states the fault it exists to catch. The module-level tests share one module built from
``recipes/tiny.yaml`` with deliberately distinct LM and DiT loss settings, so a DiT loss that reads
the LM's settings is visible. Weight perturbations and patched settings are undone after each test.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

import numpy as np
import pytest
import torch

from tests.helpers import TINY, read_metrics, run_cli, series
from unirl_pl.callbacks import LogProbIdentityCheck
from unirl_pl.callbacks.c2 import LogProbIdentityError
from unirl_pl.cli import main
from unirl_pl.data import PromptBatch
from unirl_pl.loops import DiffusionDenoise
from unirl_pl.losses import flow_grpo_loss, k3_kl, token_policy_loss
from unirl_pl.records import Experience
from unirl_pl.sampling import flow_kl

PROMPTS = ["a red circle", "a blue square"]
REQUEST_IDS = [3, 7]
QUIET = ["--trainer.logger=false", "--trainer.callbacks=[]", "--trainer.enable_progress_bar=false"]
# Distinct on purpose: every field of the DiT's settings differs from the LM's.
LLM_LOSS = {"clip_eps": 0.3, "beta": 0.5}
DIT_LOSS = {"clip_eps": 1e-4, "beta": 0.004}


@pytest.fixture(scope="module")
def built():
    llm = f"--model.llm_loss={{clip_eps: {LLM_LOSS['clip_eps']}, beta: {LLM_LOSS['beta']}, grad_clip: 1.0}}"
    dit = f"--model.transformer_loss={{clip_eps: {DIT_LOSS['clip_eps']}, beta: {DIT_LOSS['beta']}, grad_clip: 1.0}}"
    cli = main(["--config", TINY, *QUIET, llm, dit], run=False)
    cli.model.configure_model()
    return cli.model, cli.datamodule


def collect(model, dm) -> Experience:
    """One training step's rollout of PROMPTS with the data module's seed and group layout."""
    batch = PromptBatch(list(PROMPTS), list(REQUEST_IDS), seed=dm.seed, layout=dm.layout)
    return model.source.collect(batch, model.device)


@pytest.fixture(scope="module")
def clean_exp(built):
    return collect(*built)


@pytest.fixture
def model(built, monkeypatch):
    """The shared module; every trainable weight is put back (and its gradient cleared) after the test.

    Outside a trainer, ``manual_backward`` (which the DiT loss may call per denoising step) is a plain
    ``backward``, as Lightning's full-precision plugin runs it.
    """
    module, _ = built
    monkeypatch.setattr(module, "manual_backward", lambda loss, *args, **kwargs: loss.backward(*args, **kwargs))
    saved = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    yield module
    with torch.no_grad():
        for n, p in module.named_parameters():
            if n in saved:
                p.copy_(saved[n])
                p.grad = None


def perturb_dit_lora(model, scale: float = 0.05, seed: int = 0) -> None:
    """Give every DiT LoRA B matrix seeded noise (B starts at zero, so the adapter is then not a no-op)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.generator.transformer.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn(p.shape, generator=g) * scale)


def with_dit_loss(monkeypatch, model, **changes) -> None:
    monkeypatch.setattr(
        model, "losses", {**model.losses, "transformer": replace(model.losses["transformer"], **changes)}
    )


def dit_terms(model, exp: Experience) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (sample, step) log-probs and KLs, computed here from the loop and the adapter toggle: (N, S) each."""
    rec, loop = exp.records["diffusion_denoise"], model.diffusion_denoise
    logp = torch.empty_like(rec.old_logp)
    kl = torch.empty_like(rec.old_logp)
    with torch.no_grad():
        for step, (a, b) in rec.steps():
            lp, mean, std = loop.step_logprob(rec, step, (a, b))
            with model.generator.transformer.adapter_disabled():
                _, ref_mean, _ = loop.step_logprob(rec, step, (a, b))
            logp[a:b, step] = lp
            kl[a:b, step] = flow_kl(mean, ref_mean, std)
    return logp, kl


def with_lm(exp: Experience, lm) -> Experience:
    """The experience with its ``ar_decode`` record replaced."""
    return replace(exp, records={**exp.records, "ar_decode": lm})


def rel_close(a: float, b: float, rtol: float) -> bool:
    return abs(a - b) <= rtol * max(abs(a), abs(b))


# ------------------------------------------------------------------------------------ DiT loss


def test_dit_kl_is_against_the_adapter_disabled_reference(model, clean_exp):
    """Fault: the reference forward runs with the adapter enabled, so the KL is identically 0."""
    perturb_dit_lora(model)
    out = model._loss("transformer", clean_exp)
    _, kl = dit_terms(model, clean_exp)
    assert float(out.kl) > 0 and float(kl.mean()) > 0
    # The KL is ~1e-6 here, so the comparison is relative: same float32 ops, only summation order differs.
    assert rel_close(float(out.kl), float(kl.mean()), 1e-5), (float(out.kl), float(kl.mean()))


def test_dit_kl_term_is_added_with_beta(model, clean_exp, monkeypatch):
    """Fault: the DiT loss adds the KL with the wrong sign (``pg - beta * kl``)."""
    perturb_dit_lora(model)
    # The KL is ~1e-6 on this perturbation: a large weight lifts beta * kl far above float32 rounding of the loss.
    beta = 100.0
    with_dit_loss(monkeypatch, model, beta=beta)
    with_kl = model._loss("transformer", clean_exp)
    with_dit_loss(monkeypatch, model, beta=0.0)
    without = model._loss("transformer", clean_exp)
    assert float(without.kl) == 0.0 and float(with_kl.kl) > 0
    assert torch.equal(with_kl.pg_loss, without.pg_loss), "the KL weight must not change the policy-gradient term"
    a, b = float(with_kl.loss.detach()), float(without.loss.detach())
    added, want = a - b, beta * float(with_kl.kl)
    rounding = 4 * torch.finfo(torch.float32).eps * max(abs(a), abs(b))
    assert added > 0 and abs(added - want) <= 1e-5 * want + rounding, (added, want)


def test_dit_loss_uses_the_transformer_settings_not_the_llm_settings(model, clean_exp):
    """Fault: the DiT loss gets ``losses['llm']`` (clip 0.3, beta 0.5) instead of its own settings."""
    assert model.losses["transformer"].clip_eps == DIT_LOSS["clip_eps"]
    assert model.losses["llm"].beta == LLM_LOSS["beta"]
    perturb_dit_lora(model)
    out = model._loss("transformer", clean_exp)
    logp, kl = dit_terms(model, clean_exp)
    rec = clean_exp.records["diffusion_denoise"]
    adv = clean_exp.advantages["diffusion_denoise"]
    args = (logp.flatten(), rec.old_logp.flatten(), adv.repeat_interleave(rec.num_steps))
    own = flow_grpo_loss(*args, kl=kl.flatten(), **DIT_LOSS)
    lm = flow_grpo_loss(*args, kl=kl.flatten(), **LLM_LOSS)
    # Power: the two settings give visibly different losses and clip fractions on this perturbation.
    assert float(own.clip_frac) > 0 and float(lm.clip_frac) == 0
    assert abs(float(own.loss) - float(lm.loss)) > 1e-3 * abs(float(own.loss))
    assert float(out.clip_frac) == float(own.clip_frac)
    # The KL weight: what the loss adds to the policy-gradient term is the DiT's beta times the KL (the LM's
    # beta is 125x larger). Both terms come from the same float32 sums, so only rounding separates them.
    added, kl_mean = float(out.loss.detach()) - float(out.pg_loss), float(out.kl)
    assert rel_close(kl_mean, float(kl.mean()), 1e-5), (kl_mean, float(kl.mean()))
    rounding = 4 * torch.finfo(torch.float32).eps * abs(float(out.loss.detach()))
    assert abs(added - DIT_LOSS["beta"] * kl_mean) <= 1e-4 * DIT_LOSS["beta"] * kl_mean + rounding, (added, kl_mean)
    # The clipped surrogate is a mean of ~1-sized terms of both signs that cancel to ~1e-5, so the order the
    # loss sums its (step, micro-batch) terms in moves it by ~1e-8: compare on the scale that separates the
    # two settings (a hundredth of it), not relative to the cancelled value.
    for field in ("pg_loss", "loss"):
        got, want, other = (float(getattr(o, field).detach()) for o in (out, own, lm))
        assert abs(got - want) <= 1e-2 * abs(want - other), (field, got, want, other)


# --------------------------------------------------------------------------------- SDE sampling


def test_rollout_samples_differ_from_serve_samples_for_the_same_seeds(model):
    """Fault: the ODE step runs inside the SDE window while log-probs are still recorded."""
    cond = model.generator.encode(PROMPTS * 2)
    ids, idx = REQUEST_IDS * 2, [0, 0, 1, 1]
    with torch.no_grad():
        serve, none = model.diffusion_denoise.sample(cond, ids, idx, "serve", seed=0)
        rollout, rec = model.diffusion_denoise.sample(cond, ids, idx, "rollout", seed=0)
    assert none is None and rec is not None
    # Same initial noise (a sample's generator does not depend on the profile), different path.
    per_sample = (rollout - serve).flatten(1).abs().amax(1)
    assert (per_sample > 1e-2).all(), per_sample


def test_recorded_step_noise_is_standard_normal(model, clean_exp):
    """Fault: the ODE step inside the SDE window, with log-probs of the ODE sample recorded (C2 still passes).

    eps = (x_next - mean) / (std * sqrt(-dt)) must be the N(0, 1) draw. Each step holds n = 8 images x 4 x 16 x 16
    = 8192 independent draws: the sample mean has sd 1/sqrt(n) = 0.011 and the sample variance sd sqrt(2/n) = 0.016,
    so 5-sd bounds (0.055 and 0.08) fail a correct sampler with probability ~1e-6. The ODE sample gives
    eps = -sqrt(-dt) std (x + (1 - s) v) / (2 s), with variance ~0.1 here.
    """
    rec = clean_exp.records["diffusion_denoise"]
    assert rec is not None
    for step in range(rec.num_steps):
        eps = []
        for a, b in rec.chunks:
            s, s_next, _ = rec.step_sigmas(step, (a, b))
            with torch.no_grad():  # flow_sde_step_with_logprob on rec.prev with prev_sample=rec.sample
                _, mean, std = model.diffusion_denoise.step_logprob(rec, step, (a, b))
            eps.append((rec.sample[a:b, step] - mean) / (std * math.sqrt(-(s_next - s))))
        eps = torch.cat(eps).double().flatten()
        n = eps.numel()
        assert n >= 8000
        mean_bound, var_bound = 5 / math.sqrt(n), 5 * math.sqrt(2 / n)
        assert abs(float(eps.mean())) < mean_bound, (step, float(eps.mean()))
        assert abs(float(eps.var()) - 1) < var_bound, (step, float(eps.var()))


# -------------------------------------------------------------------------------- CFG recompute


@pytest.fixture
def guided(built, monkeypatch):
    module, dm = built
    # The module and its experience source hold the same loop object: change its settings in place.
    assert module.source.diffusion_denoise is module.diffusion_denoise
    monkeypatch.setattr(module, "rollout_config", replace(module.rollout_config, guidance_scale=3.0))
    loop = module.diffusion_denoise
    monkeypatch.setattr(loop, "config", replace(loop.config, guidance_scale=3.0))
    return module, dm


def test_c2_holds_bitwise_with_guidance_and_fires_when_the_recompute_drops_it(guided, monkeypatch):
    """Fault: rollout uses classifier-free guidance, the training recompute does not."""
    model, dm = guided
    exp = collect(model, dm)
    assert exp.records["diffusion_denoise"] is not None and exp.records["diffusion_denoise"].uncond is not None, (
        "guidance 3.0 records the unconditional features"
    )
    stats = LogProbIdentityCheck().check(model, exp)["transformer"]
    assert stats["frac_bitwise_equal"] == 1.0 and stats["max_abs_diff"] == 0.0
    unguided = replace(
        exp, records={**exp.records, "diffusion_denoise": replace(exp.records["diffusion_denoise"], uncond=None)}
    )
    with pytest.raises(LogProbIdentityError, match="expert 'transformer'"):
        LogProbIdentityCheck().check(model, unguided)
    original = DiffusionDenoise.step_logprob
    monkeypatch.setattr(
        DiffusionDenoise,
        "step_logprob",
        lambda self, rec, step, chunk: original(self, replace(rec, uncond=None), step, chunk),
    )
    with pytest.raises(LogProbIdentityError, match="expert 'transformer'"):
        LogProbIdentityCheck().check(model, exp)


@pytest.mark.slow
def test_fit_with_guidance_passes_c2(tmp_path):
    cli = run_cli(
        tmp_path,
        "--model.rollout.guidance_scale=3.0",
        "--trainer.max_steps=2",
        "--trainer.limit_val_batches=0",
        "--trainer.enable_checkpointing=false",
    )
    rows = read_metrics(cli)
    assert set(series(rows, "c2/transformer_max_abs_diff")) == {0.0}
    assert set(series(rows, "c2/transformer_frac_bitwise_equal")) == {1.0}
    assert len(series(rows, "transformer/pg_loss")) == 2


# ------------------------------------------------------------------------------------ RNG resume


def _draw() -> tuple[torch.Tensor, float, np.ndarray]:
    return torch.rand(3), random.random(), np.random.rand(3)


def test_on_load_checkpoint_restores_the_global_rngs(model):
    """Fault: ``on_load_checkpoint`` skips ``set_rng_states``."""
    ckpt = {"state_dict": model.state_dict()}
    model.on_save_checkpoint(ckpt)
    assert {"torch", "python", "numpy"} <= set(ckpt["unirl_rng"])
    first = _draw()
    model.on_load_checkpoint(ckpt)
    again = _draw()
    assert torch.equal(first[0], again[0]), "torch RNG not restored"
    assert first[1] == again[1], "python RNG not restored"
    assert np.array_equal(first[2], again[2]), "numpy RNG not restored"


# ---------------------------------------------------------------------------------------- k3 KL


def test_k3_kl_is_an_unbiased_estimate_of_kl_policy_to_reference():
    """Fault: k3 with its arguments swapped estimates a different quantity.

    Over all outcomes of two categoricals, E_{x~p}[exp(d) - d - 1] with d = log q(x) - log p(x) is
    sum q - 1 + KL(p || q) = KL(p || q) exactly.
    """
    p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    q = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    exact = float((p * (p / q).log()).sum())
    assert float((p * k3_kl(p.log(), q.log())).sum()) == pytest.approx(exact, rel=1e-12, abs=1e-12)
    swapped = float((p * k3_kl(q.log(), p.log())).sum())
    reverse = float((q * (q / p).log()).sum())
    assert abs(swapped - exact) > 0.1 and abs(swapped - reverse) > 0.1, (swapped, exact, reverse)
    # The estimate through samples x ~ p: Monte Carlo agrees within 5 standard errors.
    g = torch.Generator().manual_seed(0)
    x = torch.multinomial(p, 200_000, replacement=True, generator=g)
    values = k3_kl(p.log()[x], q.log()[x])
    assert abs(float(values.mean()) - exact) < 5 * float(values.std()) / math.sqrt(len(x))


# ------------------------------------------------------------------------------------- LM mask


def test_llm_loss_ignores_positions_outside_the_generation_mask(model, clean_exp):
    """Fault: the LM loss hands ``token_policy_loss`` an all-ones mask instead of ``gen_mask``."""
    lm = clean_exp.lm
    assert lm is not None
    # Rows 0 and 3 ended early (as after an eos): their tail tokens are not part of the refinement.
    gen_mask = lm.gen_mask.clone()
    gen_mask[0, -4:] = False
    gen_mask[3, -7:] = False
    assert gen_mask.any(1).all() and not gen_mask.all()
    old_logp = torch.where(gen_mask, lm.old_logp, torch.zeros_like(lm.old_logp))
    ended = with_lm(clean_exp, replace(lm, gen_mask=gen_mask, old_logp=old_logp))
    # Huge behaviour log-probs where the mask is off: ratio exp(0 - 1e4) = 0 there, a finite nonzero term if used.
    garbage = with_lm(clean_exp, replace(lm, gen_mask=gen_mask, old_logp=old_logp.masked_fill(~gen_mask, 1e4)))
    out = model._loss("llm", ended)
    assert torch.equal(model._loss("llm", garbage).loss, out.loss)
    advantages = clean_exp.advantages["ar_decode"]
    with torch.no_grad():
        logp = model.ar_decode.score(lm)
        with model.llm.adapter_disabled():
            ref = model.ar_decode.score(lm)
    eps, beta = LLM_LOSS["clip_eps"], LLM_LOSS["beta"]
    clip = {"eps_low": eps, "eps_high": eps, "beta": beta}
    expected = token_policy_loss(logp, old_logp, advantages, gen_mask, ref_logp=ref, **clip)
    assert float(out.loss.detach()) == pytest.approx(float(expected.loss), rel=1e-5, abs=1e-7)
    everything = token_policy_loss(logp, old_logp, advantages, torch.ones_like(gen_mask), ref_logp=ref, **clip)
    assert abs(float(everything.loss) - float(expected.loss)) > 1e-3, "power: the masked tokens do matter"
