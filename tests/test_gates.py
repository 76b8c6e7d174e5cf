"""The correctness gates, proven by fault injection: each one passes on the default recipe and fires on
the fault it exists to catch. Also seeded determinism and batch invariance, with a negative control.

Most tests share one module built from ``recipes/tiny.yaml`` and call the gates' ``check`` directly;
one fit-level test per gate runs them as Lightning callbacks, and each gate refuses at ``setup()`` a
module that lacks what it reads. Fault patches and weight perturbations are undone after each test,
so the shared module stays clean.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch

import unirl_pl.loops.ar_decode as ar_decode_module
import unirl_pl.loops.diffusion_denoise as diffusion_denoise_module
from tests.helpers import ROOT, TINY, fit_with_callbacks, read_metrics, series
from unirl_pl.callbacks import InterleaveParityCheck, LogProbIdentityCheck, WeightVersionLedger
from unirl_pl.callbacks.c2 import PRECISION_TOLERANCES, LogProbIdentityError
from unirl_pl.callbacks.parity import InterleaveParityError, ParityReport
from unirl_pl.cli import main
from unirl_pl.data import PromptBatch
from unirl_pl.experts import CausalLMExpert
from unirl_pl.generators import ComponentGenerator
from unirl_pl.loops import ARDecode, DiffusionDenoise
from unirl_pl.method.experience import ExperienceSource
from unirl_pl.records import Experience

# "<pad>" is the tokenizer's pad token: inside a prompt it becomes the pad id with attention mask 1.
PROMPTS = ["a red circle", "a blue <pad> square"]
REQUEST_IDS = [3, 7]
QUIET = ["--trainer.logger=false", "--trainer.callbacks=[]", "--trainer.enable_progress_bar=false"]


def build(*overrides: str):
    """The default recipe's module and data module, experts built, without a trainer run."""
    cli = main(["--config", TINY, *QUIET, *overrides], run=False)
    cli.model.configure_model()
    return cli.model, cli.datamodule


def collect(model, dm, prompts=PROMPTS, request_ids=REQUEST_IDS) -> Experience:
    """One training step's rollout of ``prompts`` with the data module's seed and group layout."""
    batch = PromptBatch(list(prompts), list(request_ids), seed=dm.seed, layout=dm.layout)
    return model.source.collect(batch, model.device)


def fingerprint(exp: Experience) -> str:
    """SHA-256 of everything a rollout produces: tokens, log-probs, latents, images, rewards, texts."""
    h = hashlib.sha256()
    assert exp.lm is not None and exp.records["diffusion_denoise"] is not None
    for t in (
        exp.lm.input_ids,
        exp.lm.old_logp,
        exp.records["diffusion_denoise"].prev,
        exp.records["diffusion_denoise"].sample,
        exp.records["diffusion_denoise"].old_logp,
        exp.images,
        exp.rewards,
        exp.advantages["ar_decode"],
        exp.advantages["diffusion_denoise"],
    ):
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    h.update("\x00".join(exp.refined).encode())
    return h.hexdigest()


def fresh_fingerprint() -> str:
    """Build the default recipe from scratch and fingerprint one rollout (run in a child process)."""
    return fingerprint(collect(*build()))


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())


@pytest.fixture(scope="module")
def built():
    return build()


@pytest.fixture(scope="module")
def clean_exp(built):
    return collect(*built)


@pytest.fixture
def restore_weights(built):
    """Snapshot every trainable weight and put it back after the test."""
    model, _ = built
    saved = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    yield model
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in saved:
                p.copy_(saved[n])


def perturb_lora(model: pl.LightningModule, expert: str, amount: float = 1e-2) -> None:
    """Move one LoRA B matrix of ``expert`` (B starts at zero, so the adapter then changes the policy)."""
    with torch.no_grad():
        name, param = next((n, p) for n, p in model.experts()[expert].named_parameters() if "lora_B" in n)
        param.add_(amount)


def shared_rng_generators(monkeypatch) -> None:
    """Fault: every request draws from one module-global stream instead of its own.

    The DiT's noise comes from one shared generator; the LM's counter-based keys come from a global
    counter that advances with every draw, so a request's tokens depend on what ran before it.
    """
    shared = torch.Generator().manual_seed(1234)
    monkeypatch.setattr(
        diffusion_denoise_module, "sample_generators", lambda seed, ids, idx, stream: [shared] * len(ids)
    )
    counter = iter(range(1 << 30))
    monkeypatch.setattr(
        ar_decode_module,
        "sample_keys",
        lambda seed, ids, idx, stream, device="cpu": torch.tensor([next(counter) for _ in ids], device=device),
    )


def position_seeded_generators(monkeypatch) -> None:
    """Fault: a sample's randomness is keyed by its position in the batch, not by its request."""

    def by_position(seed, request_ids, sample_indices, stream):
        return [torch.Generator().manual_seed(i) for i in range(len(request_ids))]

    monkeypatch.setattr(diffusion_denoise_module, "sample_generators", by_position)
    monkeypatch.setattr(
        ar_decode_module, "sample_keys", lambda seed, ids, idx, stream, device="cpu": torch.arange(len(ids))
    )


def with_config(loop, **changes):
    """A new loop of the same kind over the same model, with some sampling settings changed."""
    if isinstance(loop, ARDecode):
        return ARDecode(loop.llm, replace(loop.config, **changes))
    return type(loop)(loop.generator, replace(loop.config, **changes), loop.algorithm)


# ---------------------------------------------------------------------------------------------- C2


def test_c2_passes_on_the_default_recipe_exactly_for_the_dit(built, clean_exp):
    model, _ = built
    stats = LogProbIdentityCheck().check(model, clean_exp)
    llm, dit = stats["llm"], stats["transformer"]
    # The LM recompute is another path (KV-cache decode vs one teacher-forced forward): close, not bitwise.
    assert llm["max_abs_diff"] <= 1e-5 and abs(llm["ratio_mean"] - 1) <= 1e-5
    assert llm["clip_frac_high"] == llm["clip_frac_low"] == 0.0
    # The DiT recompute is the same function on the same micro-batches: bitwise, ratio exactly 1.
    assert dit["max_abs_diff"] == 0.0 and dit["frac_bitwise_equal"] == 1.0
    assert dit["ratio_min"] == dit["ratio_max"] == 1.0 and dit["clip_frac_high"] == dit["clip_frac_low"] == 0.0


def test_c2_fires_when_decode_masks_a_prompt_token_equal_to_the_pad_id(built, monkeypatch):
    """generate() builds its mask from ``input_ids != pad``; the recompute uses the tokenizer's mask."""
    model, dm = built
    original = CausalLMExpert.forward
    prompt_pads: dict[str, torch.Tensor] = {}

    def decode_masks_pad_ids(self, input_ids, attention_mask, position_ids=None, past_key_values=None, use_cache=False):
        if use_cache:  # only the KV-cache decode; the teacher-forced recompute never uses the cache
            if input_ids.shape[1] > 1:
                prompt_pads["ids"] = input_ids == self.pad_token_id
            pads = prompt_pads["ids"]
            attention_mask = attention_mask.clone()
            attention_mask[:, : pads.shape[1]] = attention_mask[:, : pads.shape[1]].masked_fill(pads, 0)
        return original(self, input_ids, attention_mask, position_ids, past_key_values, use_cache)

    monkeypatch.setattr(CausalLMExpert, "forward", decode_masks_pad_ids)
    exp = collect(model, dm)
    with pytest.raises(LogProbIdentityError, match=r"expert 'llm' at step 0.*blue <pad> square") as err:
        LogProbIdentityCheck().check(model, exp)
    assert "'transformer'" not in str(err.value)


@pytest.mark.parametrize("sampling", [{"temperature": 0.7}, {"top_k": 8}], ids=["temperature", "top_k"])
def test_c2_fires_when_the_recompute_ignores_temperature_or_top_k(built, monkeypatch, sampling):
    model, dm = built
    # The module and its experience source hold the same loop object: change its settings in place.
    assert model.source.ar_decode is model.ar_decode
    monkeypatch.setattr(model.ar_decode, "config", replace(model.ar_decode.config, **sampling))
    exp = collect(model, dm)
    assert exp.lm is not None
    assert (exp.lm.temperature, exp.lm.top_k) == (sampling.get("temperature", 1.0), sampling.get("top_k"))
    LogProbIdentityCheck().check(model, exp)  # control: the recompute applies the record's settings
    original = ARDecode.score
    monkeypatch.setattr(ARDecode, "score", lambda self, rec: original(self, replace(rec, temperature=1.0, top_k=None)))
    with pytest.raises(LogProbIdentityError, match="expert 'llm'"):
        LogProbIdentityCheck().check(model, exp)


# The DiT's log-prob is a mean over every latent element, so a mismatch mostly averages out: this
# perturbation moves it by ~2e-6, under any float tolerance. Only the bitwise tier sees it.
@pytest.mark.parametrize(("expert", "why"), [("llm", r"max \|logp_recompute"), ("transformer", "expected bitwise")])
def test_c2_fires_when_weights_change_between_rollout_and_recompute(clean_exp, restore_weights, expert, why):
    model = restore_weights
    perturb_lora(model, expert)
    with pytest.raises(LogProbIdentityError, match=f"expert '{expert}' at step 0: {why}"):
        LogProbIdentityCheck().check(model, clean_exp)


def test_c2_exact_tier_catches_a_change_far_below_the_tolerance(clean_exp, restore_weights):
    model = restore_weights
    perturb_lora(model, "transformer", amount=1e-6)
    stats = LogProbIdentityCheck(exact=()).check(model, clean_exp)  # inside 1e-5: passes without the exact tier
    assert 0 < stats["transformer"]["max_abs_diff"] <= 1e-5
    with pytest.raises(LogProbIdentityError, match="expected bitwise equality"):
        LogProbIdentityCheck().check(model, clean_exp)


def test_c2_fires_on_a_sigma_shifted_by_one_step_in_the_recompute(built, clean_exp, monkeypatch):
    model, _ = built
    original = DiffusionDenoise.step_logprob

    def shifted(self, record, step, chunk):
        sigmas, (start, end) = self.sigmas(self.config.num_steps), self.algorithm.window(self.config)
        off_by_one = replace(record, sigma=sigmas[start + 1 : end + 1], sigma_next=sigmas[start + 2 : end + 2])
        return original(self, off_by_one, step, chunk)

    monkeypatch.setattr(DiffusionDenoise, "step_logprob", shifted)
    with pytest.raises(LogProbIdentityError, match=r"expert 'transformer' at step 0.*SDE step"):
        LogProbIdentityCheck().check(model, clean_exp)


def test_c2_precision_presets_and_warn_action(built, clean_exp, restore_weights):
    model = restore_weights
    assert LogProbIdentityCheck().tolerances(model, "llm") == PRECISION_TOLERANCES["float32"]
    half = LogProbIdentityCheck(precision="bfloat16").tolerances(model, "llm")
    assert (half.max_abs, half.mean_abs, half.k3, half.action) == (None, 1e-2, 1e-3, "raise")
    assert LogProbIdentityCheck(precision="bfloat16", tolerance=0.5).tolerances(model, "llm").max_abs == 0.5
    perturb_lora(model, "llm")
    with pytest.warns(UserWarning, match="C2 log-prob identity failed for expert 'llm'"):
        LogProbIdentityCheck(action="warn").check(model, clean_exp)
    with pytest.raises(ValueError, match="precision"):
        LogProbIdentityCheck(precision="fp8")


# ------------------------------------------------------------------------------------------ parity


def test_parity_passes_on_the_default_recipe(built):
    model, _ = built
    gate = InterleaveParityCheck(every_n_steps=1)
    assert gate.probe_step_counts(model.diffusion_denoise.config) == [8, 4, 8, 4], "the probe mixes step counts"
    report = gate.check(model)
    assert not report.failures
    assert set(report.diffs) == {"llm", "transformer", "images"}
    assert report.max_abs_diff <= 1e-4


def test_parity_fires_on_a_module_global_rng_shared_by_requests(built, monkeypatch):
    model, _ = built
    shared_rng_generators(monkeypatch)
    with pytest.raises(InterleaveParityError, match=r"at step 0.*llm/rollout request 0: tokens differ"):
        InterleaveParityCheck(num_requests=2, profiles=("rollout",)).check(model)


def test_parity_fires_on_noise_that_depends_on_batch_position(built, monkeypatch):
    model, _ = built
    position_seeded_generators(monkeypatch)
    # Serve decodes greedily, so only the DiT's initial noise carries the fault there.
    with pytest.raises(InterleaveParityError, match=r"transformer/serve request 1 \(4 steps\) latents") as err:
        InterleaveParityCheck(num_requests=2, profiles=("serve",)).check(model)
    assert "request 0" not in str(err.value), "position 0 is seeded alike both ways"


def test_parity_fails_when_both_sides_are_empty(built, monkeypatch):
    model, _ = built
    report = ParityReport()
    report.tokens("llm", torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    report.values("dit", "transformer", torch.zeros(0), torch.zeros(0), 1e-5)
    assert report.failures == ["llm: both sides are empty", "dit: both sides are empty"]
    monkeypatch.setattr(model, "ar_decode", None)
    monkeypatch.setattr(DiffusionDenoise, "sample", lambda self, cond, *a, **k: (cond["hidden"][:, :0, :0], None))
    monkeypatch.setattr(ComponentGenerator, "decode", lambda self, latents: latents)
    with pytest.raises(InterleaveParityError, match="both sides are empty"):
        InterleaveParityCheck(num_requests=2, profiles=("serve",)).check(model)


def test_parity_divergence_names_where_and_how_much(built, monkeypatch):
    model, _ = built
    original = DiffusionDenoise.sample

    def off_when_alone(self, cond, request_ids, *args, **kwargs):
        latents, record = original(self, cond, request_ids, *args, **kwargs)
        return (latents + 1e-3 if len(request_ids) == 1 else latents), record

    monkeypatch.setattr(DiffusionDenoise, "sample", off_when_alone)
    where = r"transformer/serve request 0 \(8 steps\) latents: \|batched - serial\| = [0-9.]+e-0[34] at element"
    with pytest.raises(InterleaveParityError, match=where):
        InterleaveParityCheck(num_requests=2, profiles=("serve",)).check(model)


# ------------------------------------------------------- per-request step counts in the loop


@torch.no_grad()
def test_denoise_with_per_request_step_counts(built):
    model, _ = built
    loop = model.diffusion_denoise
    cond = model.generator.encode(["a red circle"] * 3)
    ids, idx = [5] * 3, [0, 1, 2]
    default, rec = loop.sample(cond, ids, idx, "rollout", seed=0)
    same, rec_same = loop.sample(cond, ids, idx, "rollout", seed=0, num_steps=[8, 8, 8])
    assert torch.equal(default, same) and torch.equal(rec.old_logp, rec_same.old_logp) and rec_same.sigma.ndim == 1

    mixed, rec_mixed = loop.sample(cond, ids, idx, "rollout", seed=0, num_steps=[8, 4, 6])
    assert rec_mixed.sigma.shape == (3, 3) and rec_mixed.sigma_max.shape == (3,)
    # Each sample follows its own schedule: it equals a run configured with its step count outright.
    one = {k: v[1:2] for k, v in cond.items()}
    four, rec_four = with_config(loop, num_steps=4).sample(one, [5], [1], "rollout", seed=0)
    assert max_abs_diff(mixed[1:2], four) <= 1e-5 and max_abs_diff(rec_mixed.old_logp[1:2], rec_four.old_logp) <= 1e-5
    assert torch.equal(rec_mixed.sigma[1], rec_four.sigma) and float(rec_mixed.sigma_max[1]) == rec_four.sigma_max
    # The per-sample record re-scores bit for bit: the C2 identity holds for mixed schedules too.
    assert torch.equal(loop.score(rec_mixed), rec_mixed.old_logp)
    with pytest.raises(ValueError, match="needs >= 3 steps"):
        loop.sample(cond, ids, idx, "rollout", seed=0, num_steps=[8, 2, 8])
    with pytest.raises(ValueError, match="num_steps has 2 entries for 3 requests"):
        loop.sample(cond, ids, idx, "serve", seed=0, num_steps=[8, 2])


def test_shared_start_noise_shares_the_start_of_a_request_only(built):
    model, _ = built
    loop = model.diffusion_denoise
    cond = model.generator.encode(["a red circle"] * 4)
    ids, idx = [5, 5, 5, 9], [0, 1, 2, 0]
    shared_loop = with_config(loop, shared_start_noise=True)
    own, _ = loop.sample(cond, ids, idx, "serve", seed=0)
    shared, _ = shared_loop.sample(cond, ids, idx, "serve", seed=0)
    # Same text and start: the deterministic serve path gives one image for the whole request...
    assert torch.equal(shared[1], shared[0]) and torch.equal(shared[2], shared[0])
    # ...while each sample's own start (the default) gives different ones.
    assert max_abs_diff(own[1], own[0]) > 1e-2
    # Sample 0 of every request, hence the serve and validation path, does not depend on the setting;
    # another request keeps its own start.
    assert torch.equal(shared[0], own[0]) and torch.equal(shared[3], own[3])
    assert max_abs_diff(shared[3], shared[0]) > 1e-2
    # The SDE steps keep drawing each sample's own noise: rollouts of one request still differ, by
    # exactly the noise of the default setting after the start.
    _, rec = shared_loop.sample(cond, ids, idx, "rollout", seed=0)
    _, rec_own = loop.sample(cond, ids, idx, "rollout", seed=0)
    assert torch.equal(rec.prev[1, 0], rec.prev[0, 0]) and max_abs_diff(rec.sample[1, 0], rec.sample[0, 0]) > 1e-3
    assert torch.equal(rec.sample[0], rec_own.sample[0])

    def first_step_noise(record):
        _, mean, std = loop.step_logprob(record, 0, (0, 4))
        return (record.sample[:, 0] - mean) / std

    assert max_abs_diff(first_step_noise(rec), first_step_noise(rec_own)) < 1e-3
    assert torch.equal(shared_loop.score(rec), rec.old_logp)


# ----------------------------------------------------------------------------- seeded determinism


# Fresh builds, not the shared module: the text-feature cache encodes its misses together, so cached
# features depend (to ~4e-7) on what was encoded before; a fresh module has no history.
@pytest.fixture(scope="module")
def fresh_fp() -> str:
    return fresh_fingerprint()


@pytest.mark.slow
def test_same_seed_gives_a_bit_identical_rollout_twice_in_one_process(fresh_fp):
    assert fresh_fingerprint() == fresh_fp
    # Power: the fingerprint does see a different seed.
    model, dm = build()
    assert fingerprint(collect(model, dm, request_ids=[4, 7])) != fresh_fp


@pytest.mark.integration
def test_same_seed_gives_a_bit_identical_rollout_in_a_fresh_process(fresh_fp):
    code = "from tests.test_gates import fresh_fingerprint; print(fresh_fingerprint())"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == fresh_fp


def _split_like_two_ranks(model, dm):
    """One process with 4 prompts vs two 'ranks' with 2 prompts each (same global request ids)."""
    prompts, ids = ["a red circle", "a blue square", "a green triangle", "an orange triangle"], [10, 11, 12, 13]
    whole = collect(model, dm, prompts, ids)
    parts = [collect(model, dm, prompts[:2], ids[:2]), collect(model, dm, prompts[2:], ids[2:])]
    return whole, parts


def _rank_split_diffs(whole: Experience, parts: list[Experience]) -> dict[str, float]:
    cat = torch.cat
    assert whole.lm is not None and whole.records["diffusion_denoise"] is not None
    lm = [p.lm for p in parts]
    dit = [p.records["diffusion_denoise"] for p in parts]
    return {
        "refined_equal": float(whole.refined == parts[0].refined + parts[1].refined),
        "initial_noise": max_abs_diff(whole.records["diffusion_denoise"].prev[:, 0], cat([d.prev[:, 0] for d in dit])),
        "lm_logp": max_abs_diff(whole.lm.old_logp.sum(1), cat([r.old_logp.sum(1) for r in lm])),
        "dit_logp": max_abs_diff(whole.records["diffusion_denoise"].old_logp, cat([d.old_logp for d in dit])),
        "images": max_abs_diff(whole.images, cat([p.images for p in parts])),
        "rewards": max_abs_diff(whole.rewards, cat([p.rewards for p in parts])),
    }


def test_a_sample_does_not_depend_on_batch_size_position_or_rank_count(built):
    model, dm = built
    diffs = _rank_split_diffs(*_split_like_two_ranks(model, dm))
    assert diffs["refined_equal"] == 1.0 and diffs["initial_noise"] == 0.0, diffs
    # Everything downstream of the noise goes through batch-variant kernels: equal to rounding.
    assert max(diffs["lm_logp"], diffs["dit_logp"], diffs["images"], diffs["rewards"]) <= 1e-4, diffs


def test_batch_position_dependent_noise_is_detected_by_the_rank_split_comparison(built, monkeypatch):
    model, dm = built
    position_seeded_generators(monkeypatch)
    diffs = _rank_split_diffs(*_split_like_two_ranks(model, dm))
    assert diffs["refined_equal"] == 0.0 and diffs["initial_noise"] > 0.1, diffs


@torch.no_grad()
def test_batch_invariance_with_a_negative_control(built):
    """Alone vs inside a batch: a wide float32 linear layer differs (so the comparison can fail), while a
    rollout with one image per DiT forward is bitwise identical wherever the sample sits."""
    g = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(1024, 1024)
    x = torch.randn(8, 1024, generator=g)
    with torch.no_grad():
        control = max_abs_diff(linear(x)[3], linear(x[3:4])[0])
    assert control > 0.0, "negative control: batched float32 GEMM on CPU should not be bitwise equal to one row"

    model, _ = built
    loop = with_config(model.diffusion_denoise, micro_batch_size=1)
    cond = model.generator.encode(["a red circle"] * 5)
    batched, rec_b = loop.sample(cond, [20, 21, 22, 23, 24], [0, 1, 2, 3, 4], "rollout", seed=0)
    alone, rec_a = loop.sample({k: v[3:4] for k, v in cond.items()}, [23], [3], "rollout", seed=0)
    assert max_abs_diff(batched[3], alone[0]) == 0.0
    assert max_abs_diff(rec_b.old_logp[3], rec_a.old_logp[0]) == 0.0


# ------------------------------------------------------------------------------------ protocols

# What each gate reads from the module (unirl_pl/callbacks/protocol.py), checked in its setup().
GATE_NEEDS = {
    LogProbIdentityCheck: ["experts", "loss_settings", "recompute_logprobs", "trained"],
    InterleaveParityCheck: ["ar_decode", "diffusion_denoise", "generator"],
    WeightVersionLedger: ["ledger", "trained"],
}
PROTOCOLS = {LogProbIdentityCheck: "RecomputingModule", InterleaveParityCheck: "SamplingModule"}


def _refusal(gate: pl.Callback, module) -> str:
    with pytest.raises(TypeError) as err:
        gate.setup(None, module, "fit")
    return str(err.value)


def _check_setup_refuses_what_lacks_the_protocol(gate_cls: type, built) -> None:
    needs = GATE_NEEDS[gate_cls]
    protocol = PROTOCOLS.get(gate_cls, "VersionedModule")
    gate = gate_cls()
    # Nothing offered: every name is listed, with the gate, the protocol and the refused module's type.
    for bare in (SimpleNamespace(), pl.LightningModule()):
        msg = _refusal(gate, bare)
        offers = f"{gate_cls.__name__} needs a module that offers {', '.join(needs)} ({protocol}); "
        assert msg == offers + f"{type(bare).__name__} does not", msg
    # One name missing: only that name is listed.
    for missing in needs:
        partial = SimpleNamespace(**{n: None for n in needs if n != missing})
        msg = _refusal(gate, partial)
        assert f"offers {missing} ({protocol})" in msg, (missing, msg)
    # Control: the trainer's module offers everything and is accepted.
    model, _ = built
    assert gate.setup(None, model, "fit") is None


def test_c2_setup_refuses_a_module_without_the_recompute_protocol(built):
    _check_setup_refuses_what_lacks_the_protocol(LogProbIdentityCheck, built)


def test_parity_setup_refuses_a_module_without_the_sampling_protocol(built):
    _check_setup_refuses_what_lacks_the_protocol(InterleaveParityCheck, built)


def test_ledger_setup_refuses_a_module_without_the_versioned_protocol(built):
    _check_setup_refuses_what_lacks_the_protocol(WeightVersionLedger, built)


# ------------------------------------------------------------------------------------- fit level


class PerturbLoRA(pl.Callback):
    """Fault: changes an adapter weight after rollout and before the C2 gate's recompute."""

    def __init__(self, expert: str) -> None:
        self.expert = expert

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        perturb_lora(pl_module, self.expert)


def fit(tmp_path, callbacks: list[pl.Callback], *overrides: str):
    """Fit the default recipe for the given callbacks (first in line) and return the CLI object."""
    flags = ("--trainer.enable_checkpointing=false", "--trainer.limit_val_batches=0")
    return fit_with_callbacks(tmp_path, callbacks, *flags, *overrides)


@pytest.mark.slow
def test_fit_gates_pass_on_the_default_recipe(tmp_path):
    gates = [LogProbIdentityCheck(), InterleaveParityCheck(every_n_steps=1, num_requests=2), WeightVersionLedger()]
    cli = fit(tmp_path, gates, "--trainer.max_steps=2")
    rows = read_metrics(cli)
    assert max(series(rows, "c2/llm_max_abs_diff")) <= 1e-5
    assert set(series(rows, "c2/transformer_max_abs_diff")) == {0.0}
    assert all(abs(r - 1) <= 1e-5 for r in series(rows, "c2/llm_ratio_mean") + series(rows, "transformer/ratio_mean"))
    assert set(series(rows, "c2/llm_clip_frac_high") + series(rows, "c2/llm_clip_frac_low")) == {0.0}
    parity = series(rows, "parity/max_abs_diff")
    assert len(parity) == 2 and max(parity) <= 1e-4, "parity runs at fit start and at step 1"


@pytest.mark.slow
def test_fit_c2_fires_when_a_weight_changes_before_the_recompute(tmp_path):
    with pytest.raises(LogProbIdentityError, match="expert 'llm' at step 0"):
        fit(tmp_path, [PerturbLoRA("llm"), LogProbIdentityCheck()], "--trainer.max_steps=1")


@pytest.mark.slow
def test_fit_parity_fires_at_fit_start_before_any_rollout(tmp_path, monkeypatch):
    shared_rng_generators(monkeypatch)

    def no_rollout(*args, **kwargs):
        raise AssertionError("a rollout ran before the parity gate")

    monkeypatch.setattr(ExperienceSource, "collect", no_rollout)
    with pytest.raises(InterleaveParityError, match="at step 0"):
        fit(tmp_path, [InterleaveParityCheck(num_requests=2, profiles=("rollout",))], "--trainer.max_steps=1")
