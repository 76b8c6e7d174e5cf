"""Top-k sampling with refinements that end early: a finished row's pad token lies outside the top-k.

After a row's stop token the loop keeps feeding it the pad token while other rows decode; under
``rollout.top_k`` the pad token's log-prob is -inf whenever it is not among the k most likely. The record
and the recompute must zero those positions with a where (``-inf * 0`` is NaN): a NaN behavior log-prob
makes the refiner's loss NaN and the step is skipped, silently, since the C2 gate masks with a where too.
The token losses must keep a padded position's -inf out of the loss and out of its gradient as well.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.helpers import REFINER_ALGORITHMS
from unirl_pl.algorithms import LossInputs
from unirl_pl.experts import TinyCausalLMExpert
from unirl_pl.loops import ARDecode, RolloutConfig
from unirl_pl.loops.ar_decode import positions, process_logits
from unirl_pl.losses import token_policy_loss
from unirl_pl.method import ExpertLoss

TOP_K = 3
PROMPTS = ["a red circle", "a blue square", "two green triangles", "a small red square"] * 2
SEED = 1  # a draw whose refinements end at different steps (checked below)
ALGORITHMS = REFINER_ALGORITHMS


@pytest.fixture(scope="module")
def sampled():
    """A tiny refiner whose EOS is likely (so rows end early) and whose pad token is never in the top-k,
    and one ``rollout`` draw of it with ``top_k`` set."""
    llm = TinyCausalLMExpert(hidden_size=32, num_layers=1, intermediate_size=64, lora_rank=4)
    llm.build()
    eos, pad = llm.eos_token_id, llm.pad_token_id

    def hook(module, args, output):
        # Position-independent, so the teacher-forced recompute sees the logits rollout sampled from.
        output = output.clone()
        output[..., eos] += 1.5
        output[..., pad] -= 1e4
        return output

    llm.model.get_output_embeddings().register_forward_hook(hook)
    loop = ARDecode(llm, RolloutConfig(max_new_tokens=8, temperature=1.0, top_k=TOP_K))
    _, record = loop.sample(PROMPTS, list(range(len(PROMPTS))), [0] * len(PROMPTS), "rollout", seed=SEED)
    return llm, loop, record


def _raw_logp(llm, record) -> torch.Tensor:
    """The recorded tokens' log-probs under the sampling distribution, unmasked (-inf where outside the top-k)."""
    with torch.no_grad():
        mask = record.attention_mask
        out = llm(input_ids=record.input_ids, attention_mask=mask, position_ids=positions(mask))
        logits = process_logits(out.logits[:, record.prompt_len - 1 : -1], record.temperature, record.top_k)
        return torch.log_softmax(logits, -1).gather(-1, record.gen_ids[..., None])[..., 0]


def test_rows_end_early_and_their_pad_tokens_fall_outside_the_top_k(sampled):
    """The setting of this file: some rows end before others and their padded positions are -inf."""
    llm, _, record = sampled
    lengths = record.gen_mask.sum(1)
    assert record.top_k == TOP_K
    assert lengths.min() < record.gen_mask.shape[1] and lengths.max() == record.gen_mask.shape[1], lengths
    assert len(set(lengths.tolist())) >= 3, lengths
    raw = _raw_logp(llm, record)
    assert raw[~record.gen_mask].eq(float("-inf")).all()
    assert raw[record.gen_mask].isfinite().all()


def test_the_recorded_behavior_log_probs_are_finite_and_zero_on_padding(sampled):
    _, _, record = sampled
    assert record.old_logp.isfinite().all(), record.old_logp
    assert (record.old_logp[~record.gen_mask] == 0).all()
    assert (record.old_logp[record.gen_mask] < 0).all()


@pytest.mark.parametrize("micro", [None, 3])
def test_the_recompute_equals_the_record_on_real_tokens(sampled, micro):
    llm, loop, record = sampled
    loop = ARDecode(llm, replace(loop.config, lm_micro_batch_size=micro))
    with torch.no_grad():
        recomputed = loop.score(record)
    assert recomputed.isfinite().all()
    assert (recomputed[~record.gen_mask] == 0).all()
    torch.testing.assert_close(recomputed[record.gen_mask], record.old_logp[record.gen_mask], rtol=0, atol=1e-5)
    # What the C2 gate compares is finite everywhere, not only where it looks.
    assert (recomputed - record.old_logp).isfinite().all()


@pytest.mark.parametrize("correction", ["off", "tis"])
@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_the_refiner_loss_and_its_gradient_are_finite(sampled, name, correction):
    llm, loop, record = sampled
    params = [p for p in llm.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    advantages = torch.linspace(-1.0, 1.0, record.input_ids.shape[0])
    settings = ExpertLoss(clip_eps=0.2, beta=0.05, rollout_correction=correction)
    out = ALGORITHMS[name].loss(LossInputs(loop, record, advantages, settings, llm.adapter_disabled))
    assert out.loss.isfinite(), out
    assert out.kl.isfinite() and out.ratio_mean.isfinite()
    out.loss.backward()
    grads = torch.cat([p.grad.flatten() for p in params])
    assert grads.isfinite().all()
    assert grads.abs().max() > 0


def _padded_inputs():
    """Token-loss inputs whose padded positions hold -inf (log-probs of pad tokens outside the top-k)."""
    gen = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]], dtype=torch.bool)
    base = -torch.rand(3, 5, generator=gen) - 0.1
    inf = torch.full_like(base, float("-inf"))
    logp = torch.where(mask, base + 0.05 * torch.randn(3, 5, generator=gen), inf)
    old = torch.where(mask, base, inf)
    ref = torch.where(mask, base - 0.1, inf)
    weights = torch.where(mask, torch.full_like(base, 1.2), torch.zeros_like(base))
    return mask, logp, old, ref, weights, torch.tensor([1.0, -0.5, 0.7])


LOSSES = {
    "token_mean": lambda *a, **k: token_policy_loss(*a, **k),
    "clip_higher": lambda *a, **k: token_policy_loss(*a, eps_high=0.28, **k),
    "sequence_mean": lambda *a, **k: token_policy_loss(*a, aggregation="sequence_mean", **k),
    "sequence_ratio": lambda *a, **k: token_policy_loss(
        *a, eps_low=0.05, eps_high=0.05, aggregation="sequence_ratio", **k
    ),
}


@pytest.mark.parametrize("name", list(LOSSES))
def test_the_token_losses_keep_a_padded_minus_inf_out_of_loss_and_gradient(name):
    loss_fn = LOSSES[name]
    mask, logp, old, ref, weights, adv = _padded_inputs()
    leaf = logp.clone().requires_grad_(True)
    out = loss_fn(leaf, old, adv, mask, ref_logp=ref, beta=0.1, is_weights=weights)
    assert out.loss.isfinite() and out.kl.isfinite(), out
    out.loss.backward()
    assert leaf.grad.isfinite().all(), leaf.grad
    assert (leaf.grad[~mask] == 0).all()
    # The same loss as with zeros on the padded positions: what they hold does not matter.
    zero = torch.zeros_like(logp)
    clean = [torch.where(mask, x, zero) for x in (logp, old, ref)]
    ones = torch.where(mask, weights, torch.ones_like(weights))
    leaf0 = clean[0].clone().requires_grad_(True)
    out0 = loss_fn(leaf0, clean[1], adv, mask, ref_logp=clean[2], beta=0.1, is_weights=ones)
    out0.loss.backward()
    torch.testing.assert_close(out.loss, out0.loss)
    torch.testing.assert_close(leaf.grad, leaf0.grad)
