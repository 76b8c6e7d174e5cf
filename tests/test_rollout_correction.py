"""Truncated importance sampling (TIS) of the rollout/train numerics mismatch, and the C2 gate around it.

The pure functions first (the weight, its statistics, the weighted losses); then the gate on one tiny
experience; then fits of ``recipes/tiny.yaml`` in bf16 with a mismatch injected into the recorded behavior
log-probs (bf16 on CPU stays inside the half-precision limits on the tiny models: ``scripts/bf16_c2.py``),
with the correction on (trains) and off (stops), and in float32 (stops: C2 stays a hard gate).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace

import lightning.pytorch as pl
import pytest
import torch

import unirl_pl.algorithms.drivers as drivers
from tests.helpers import ROOT, TINY, fit_with_callbacks, read_metrics, series, subprocess_env
from unirl_pl.algorithms.drivers import anchor_and_weights
from unirl_pl.callbacks import LogProbIdentityCheck
from unirl_pl.callbacks.c2 import LogProbIdentityError
from unirl_pl.cli import main
from unirl_pl.data import PromptBatch
from unirl_pl.losses import flow_grpo_loss, token_policy_loss
from unirl_pl.method import ExpertLoss
from unirl_pl.rollout_correction import rollout_correction_stats, truncated_importance_weights

FAST = (
    "--trainer.limit_val_batches=0",
    "--model.rollout.num_steps=4",
    "--model.generator_algorithm.init_args.sde_window=[0,2]",
)
BF16 = ("--model.llm.init_args.dtype=bfloat16", "--model.generator.init_args.transformer.init_args.dtype=bfloat16")
TIS = ("--model.llm_loss.rollout_correction=tis", "--model.transformer_loss.rollout_correction=tis")
# A bf16-GPU-sized mismatch: the LM's per-token noise is above the half-precision mean limit (1e-2); the
# DiT's per-step noise is 5x Flow-GRPO's clip range of 1e-4, so an uncorrected ratio would clip at once.
LM_NOISE, DIT_NOISE = 0.05, 5e-4


# ------------------------------------------------------------------------------------------ the weight
def test_weight_is_the_ratio_truncated_at_the_cap():
    behavior = torch.zeros(5)
    old = torch.tensor([-1.0, 0.0, 0.5, math.log(2.0), 3.0])
    w = truncated_importance_weights(old, behavior, cap=2.0)
    expected = torch.tensor([math.exp(-1.0), 1.0, math.exp(0.5), 2.0, 2.0])
    assert torch.allclose(w, expected, rtol=1e-6), w
    # The ratio is recompute over behavior, not the reverse: a behavior above the recompute weighs less.
    assert float(truncated_importance_weights(torch.zeros(1), torch.ones(1), cap=2.0)) == pytest.approx(math.exp(-1))


def test_weight_is_one_where_the_log_probs_agree_detached_and_finite():
    old = torch.randn(3, 7, requires_grad=True)
    w = truncated_importance_weights(old, old.detach().clone(), cap=2.0)
    assert torch.equal(w, torch.ones_like(w)) and not w.requires_grad
    huge = truncated_importance_weights(torch.tensor([1e4]), torch.tensor([-1e4]), cap=3.0)
    assert float(huge) == pytest.approx(3.0), "the cap applies in log space, so no overflow to inf"
    with pytest.raises(ValueError, match="cap"):
        truncated_importance_weights(old, old, cap=0.0)


def test_stats_of_the_ratio_over_real_terms():
    old = torch.tensor([[0.0, 0.5, 1.0], [-0.5, 9.0, 0.0]])
    behavior = torch.zeros(2, 3)
    mask = torch.tensor([[True, True, True], [True, False, False]])  # 9.0 sits under the mask
    s = rollout_correction_stats(old, behavior, mask, cap=2.0)
    real = torch.tensor([0.0, 0.5, 1.0, -0.5])
    r = real.exp()
    assert float(s["ratio_mean"]) == pytest.approx(float(r.mean()))
    assert float(s["ratio_max"]) == pytest.approx(math.e)
    assert float(s["clipped_frac"]) == pytest.approx(0.25), "only exp(1) > 2 is truncated"
    assert float(s["kl"]) == pytest.approx(float((r - 1 - real).mean()))
    same = rollout_correction_stats(behavior, behavior, None, cap=2.0)
    assert float(same["kl"]) == 0.0 and float(same["ratio_max"]) == 1.0 and float(same["clipped_frac"]) == 0.0
    empty = rollout_correction_stats(old, behavior, torch.zeros_like(mask), cap=2.0)
    assert float(empty["ratio_mean"]) == 1.0 and float(empty["kl"]) == 0.0


# ------------------------------------------------------------------------------------------ the losses
def test_unit_weights_leave_both_losses_unchanged():
    gen = torch.Generator().manual_seed(0)
    logp, old = torch.randn(4, 6, generator=gen), torch.randn(4, 6, generator=gen) * 0.1
    adv, mask = torch.randn(4, generator=gen), torch.rand(4, 6, generator=gen) > 0.3
    ref = logp + 0.1
    plain = token_policy_loss(logp, old, adv, mask, ref_logp=ref, beta=0.1)
    ones = token_policy_loss(logp, old, adv, mask, ref_logp=ref, beta=0.1, is_weights=torch.ones(4, 6))
    assert torch.equal(plain.loss, ones.loss)
    step, step_old = torch.randn(4, generator=gen), torch.randn(4, generator=gen) * 1e-4
    kl = torch.rand(4, generator=gen)
    plain = flow_grpo_loss(step, step_old, adv, kl=kl, beta=0.004)
    ones = flow_grpo_loss(step, step_old, adv, kl=kl, beta=0.004, is_weights=torch.ones(4))
    assert torch.equal(plain.loss, ones.loss)


@pytest.mark.parametrize("which", ["lm", "dit"])
def test_weights_scale_each_terms_policy_gradient_and_not_the_kl(which):
    """Weight w on one term scales that term's gradient by w; the KL term is not weighted (as TRL and verl)."""
    n = 4
    logp = torch.zeros(n, requires_grad=True) if which == "dit" else torch.zeros(1, n, requires_grad=True)
    old, adv = torch.zeros_like(logp), torch.ones(n if which == "dit" else 1)
    weights = torch.tensor([1.0, 2.0, 0.5, 1.0]).reshape(logp.shape)

    def grad(is_weights, beta=0.0):
        logp.grad = None
        if which == "dit":
            kl = (logp - 1) ** 2  # any differentiable per-sample KL
            out = flow_grpo_loss(logp, old, adv, kl=kl, beta=beta, is_weights=is_weights)
        else:
            mask = torch.ones_like(logp, dtype=torch.bool)
            out = token_policy_loss(logp, old, adv, mask, ref_logp=logp.detach() - 1, beta=beta, is_weights=is_weights)
        out.loss.backward()
        return logp.grad.clone()

    assert torch.allclose(grad(weights), weights * grad(None))
    kl_only = grad(None, beta=1.0) - grad(None)
    assert torch.allclose(grad(weights, beta=1.0) - grad(weights), kl_only), "the KL term is not weighted"


def test_expert_loss_settings_and_the_ratio_anchor():
    assert ExpertLoss().rollout_correction == "off" and ExpertLoss().tis_cap == 2.0
    with pytest.raises(ValueError, match="tis_cap"):
        ExpertLoss(rollout_correction="tis", tis_cap=0.5)
    with pytest.raises(ValueError, match="rollout_correction"):
        ExpertLoss(rollout_correction="icepop")  # type: ignore[arg-type]
    logp, behavior = torch.tensor([0.3, -0.2], requires_grad=True), torch.tensor([0.0, 0.0])
    old, weights = anchor_and_weights(logp, behavior, ExpertLoss(), None)
    assert old is behavior and weights is None, "off: the ratio's anchor is the behavior log-prob"
    tis = ExpertLoss(rollout_correction="tis")
    old, weights = anchor_and_weights(logp, behavior, tis, None)
    assert torch.equal(old, logp.detach()) and not old.requires_grad, "first epoch: this forward, detached"
    assert torch.allclose(weights, torch.tensor([math.exp(0.3), math.exp(-0.2)]))
    kept = torch.tensor([0.1, 0.1])
    old, weights = anchor_and_weights(logp, behavior, tis, kept)
    assert old is kept and torch.allclose(weights, torch.full((2,), math.exp(0.1))), "later epochs: the kept anchor"


# ------------------------------------------------------------------------------------- the gate alone
QUIET = ["--trainer.logger=false", "--trainer.callbacks=[]", "--trainer.enable_progress_bar=false"]


@pytest.fixture(scope="module")
def built():
    cli = main(["--config", TINY, *QUIET, *FAST], run=False)
    cli.model.configure_model()
    return cli.model, cli.datamodule


def _collect(model, dm):
    batch = PromptBatch(["a red circle", "a blue square"], [3, 7], seed=dm.seed, layout=dm.layout)
    return model.source.collect(batch, model.device)


def _inject(exp, lm_noise: float, dit_noise: float, seed: int = 0) -> None:
    """Perturb the recorded behavior log-probs in place: the numerics of a sampler that differs from the
    trainer (the LM's only on generated tokens)."""
    gen = torch.Generator().manual_seed(seed)
    lm, dit = exp.records.get("ar_decode"), exp.records.get("diffusion_denoise")
    if lm is not None:
        lm.old_logp = lm.old_logp + torch.randn(lm.old_logp.shape, generator=gen) * lm_noise * lm.gen_mask
    if dit is not None:
        dit.old_logp = dit.old_logp + torch.randn(dit.old_logp.shape, generator=gen) * dit_noise


@pytest.fixture
def corrected(built):
    """The shared module with both experts' losses set to TIS, restored afterwards."""
    model, _ = built
    saved = dict(model.losses)
    model.losses = {name: replace(s, rollout_correction="tis") for name, s in saved.items()}
    yield model
    model.losses = saved


def test_gate_measures_the_corrected_mismatch_and_stops_only_beyond_its_kl_limit(built, corrected):
    model, dm = built
    exp = _collect(model, dm)
    _inject(exp, LM_NOISE, DIT_NOISE)
    # An explicit limit does not apply to a corrected half-precision expert.
    gate = LogProbIdentityCheck(tolerance=1e-5, precision="bfloat16")
    gate.check(model, exp)
    llm = gate.corrections["llm"]
    assert 0 < llm["kl"] < 1e-2 and llm["ratio_max"] > 1 and llm["clipped_frac"] == 0.0
    assert gate.corrections["transformer"]["kl"] > 0
    # A recompute fault far beyond numerics (log-prob off by ~1 per token) still stops the run.
    big = _collect(model, dm)
    _inject(big, 1.0, 0.0)
    with pytest.raises(LogProbIdentityError, match="'llm' at step 0: the rollout/recompute mismatch KL"):
        LogProbIdentityCheck(precision="bfloat16").check(model, big)
    LogProbIdentityCheck(corrected_kl_tolerance=None, precision="bfloat16").check(model, big)  # None: never stop
    # A float32 expert keeps the hard gate with the correction on: the same small noise is a fault there.
    with pytest.raises(LogProbIdentityError, match="'llm' at step 0: max"):
        LogProbIdentityCheck().check(model, exp)


def test_uncorrected_half_precision_gate_stops_and_names_the_remedy(built):
    model, dm = built
    exp = _collect(model, dm)
    _inject(exp, LM_NOISE, 0.0)
    with pytest.raises(LogProbIdentityError, match=r"mean \|logp_recompute.*rollout_correction=tis"):
        LogProbIdentityCheck(precision="bfloat16").check(model, exp)
    with pytest.raises(LogProbIdentityError, match="'llm'") as err:
        LogProbIdentityCheck().check(model, exp)  # float32: a fault, so no hint at a correction
    assert "rollout_correction" not in str(err.value)


# ---------------------------------------------------------------------------------------------- fits
class InjectMismatch(pl.Callback):
    """Perturbs the experience's behavior log-probs after rollout, before the first training forward."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        _inject(batch, LM_NOISE, DIT_NOISE, seed=batch_idx)


def fit(tmp_path, gate: LogProbIdentityCheck, *overrides: str):
    flags = ("--trainer.enable_checkpointing=false", *FAST)
    return fit_with_callbacks(tmp_path, [InjectMismatch(), gate], *flags, *overrides)


@pytest.mark.slow
def test_bf16_run_with_the_correction_trains_and_anchors_every_epoch_at_the_first_recompute(tmp_path, monkeypatch):
    olds: dict[str, list[torch.Tensor]] = {"llm": [], "transformer": []}
    outs: dict[str, list] = {"llm": [], "transformer": []}

    def recording(name, fn):
        def wrapper(logp, old_logp, *args, **kwargs):
            olds[name].append(old_logp.detach().clone())
            out = fn(logp, old_logp, *args, **kwargs)
            outs[name].append(out)
            return out

        return wrapper

    monkeypatch.setattr(drivers, "token_policy_loss", recording("llm", drivers.token_policy_loss))
    monkeypatch.setattr(drivers, "flow_grpo_loss", recording("transformer", drivers.flow_grpo_loss))
    cli = fit(tmp_path, LogProbIdentityCheck(), "--trainer.max_steps=2", "--model.ppo_epochs=2", *BF16, *TIS)
    rows = read_metrics(cli)
    assert cli.trainer.global_step == 2 and len(series(rows, "reward/mean")) == 2
    # The gate saw the injected mismatch and logged the correction's statistics instead of stopping.
    assert min(series(rows, "c2/llm_mean_abs_diff")) > 1e-2, "above the bf16 limit that stops the uncorrected run"
    assert all(0 < kl < 1e-2 for kl in series(rows, "rollout_corr/llm_kl"))
    assert all(r > 1 for r in series(rows, "rollout_corr/llm_ratio_max"))
    assert all(kl > 0 for kl in series(rows, "rollout_corr/transformer_kl"))
    assert len(series(rows, "rollout_corr/transformer_clipped_frac")) == 2
    # Anchored at the recompute, the first update's ratio is exactly 1: nothing clips before a weight moves
    # (anchored at the perturbed behavior, the DiT's ratios would sit 5x outside its 1e-4 clip range). The
    # logged metrics average both epochs, so the first epoch's loss calls are read directly.
    for name, per_epoch in (("llm", 1), ("transformer", 2)):
        firsts = [out for step in range(2) for out in outs[name][2 * step * per_epoch : (2 * step + 1) * per_epoch]]
        assert {float(o.clip_frac) for o in firsts} == {0.0} and {float(o.ratio_mean) for o in firsts} == {1.0}
    assert len(series(rows, "transformer/updates")) == 2, "the logged metrics span both epochs"
    # Epoch 1 (after an update) reuses epoch 0's recompute as its anchor; it is not the behavior log-prob.
    for name, per_epoch in (("llm", 1), ("transformer", 2)):
        calls = olds[name]
        assert len(calls) == 2 * 2 * per_epoch, (name, len(calls))  # 2 RL steps x 2 epochs
        for step in range(2):
            first = calls[2 * step * per_epoch : (2 * step + 1) * per_epoch]
            second = calls[(2 * step + 1) * per_epoch : (2 * step + 2) * per_epoch]
            assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True)), name


@pytest.mark.slow
def test_bf16_run_without_the_correction_stops_at_c2(tmp_path):
    gate = LogProbIdentityCheck()
    with pytest.raises(LogProbIdentityError, match="expert 'llm' at step 0.*rollout_correction=tis"):
        fit(tmp_path, gate, "--trainer.max_steps=2", *BF16)
    # What the uncorrected first update would have done: most DiT ratios clipped before any weight moved.
    dit = gate.last["transformer"]
    assert dit["clip_frac_high"] + dit["clip_frac_low"] > 0.5


@pytest.mark.slow
def test_fp32_run_with_an_injected_mismatch_still_stops(tmp_path):
    with pytest.raises(LogProbIdentityError, match="expert 'llm' at step 0"):
        fit(tmp_path, LogProbIdentityCheck(), "--trainer.max_steps=1")


# ------------------------------------------------------------------------------------- scripts/gpu_check.py
def _gpu_check():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_reads_plans_and_metrics():
    gpu_check = _gpu_check()
    plan = {"phases": [{"name": "rollout", "peak_bytes": 3 * 2**30}, {"name": "update", "peak_gib": 5.5}], "n": 9}
    assert gpu_check.predicted_peak_gib(plan) == 5.5
    assert gpu_check.predicted_peak_gib({"weights_gib": 4.0}) is None
    rows = [
        {"parity/max_abs_diff": 1e-3},
        {"c2/llm_max_abs_diff": 0.02, "rollout_corr/llm_kl": 1e-5, "perf/step_time_s": 4.0, "perf/images": 8.0},
        {"c2/llm_max_abs_diff": 0.03, "rollout_corr/llm_kl": 2e-5, "perf/step_time_s": 2.0, "perf/images": 8.0},
        {"c2/llm_max_abs_diff": 0.01, "perf/step_time_s": 2.0, "perf/images": 8.0, "perf/peak_memory_gib": 7.0},
    ]
    s = gpu_check.summarize(rows)
    assert s["c2"]["llm"]["max_abs_diff"] == 0.03 and s["c2"]["llm"]["mismatch_kl"] == 2e-5
    assert "transformer" not in s["c2"] and s["parity_max_abs_diff"] == 1e-3
    assert s["step_time_s"] == [4.0, 2.0, 2.0] and s["images_per_s"] == 4.0, "throughput after the first step"
    assert s["peak_memory_gib"] == 7.0


@pytest.mark.integration
def test_gpu_check_smoke_runs_on_cpu(tmp_path):
    """``scripts/gpu_check.py --device cpu --steps 1`` on one family's test pipeline, through the real CLI."""
    out = tmp_path / "report.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--device", "cpu", "--steps", "1"]
    cmd += ["--families", "sd35", "--out", str(out), "--keep", str(tmp_path / "work")]
    proc = subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    sd35 = report["families"]["sd35"]
    assert report["ok"] and sd35["rc"] == 0 and "test pipeline" in sd35["source"]
    assert set(sd35["c2"]) == {"llm", "transformer"}
    assert sd35["c2"]["transformer"]["max_abs_diff"] == 0.0, "bf16 on CPU: the DiT recompute stays bitwise"
    assert 0 < sd35["c2"]["llm"]["max_abs_diff"] < 0.1 and sd35["c2"]["llm"]["mismatch_kl"] is not None
    assert sd35["parity_max_abs_diff"] is not None and len(sd35["step_time_s"]) == 1
    assert sd35["images_per_s"] > 0 and sd35["peak_memory_gib"] > 0
