"""The refiner's loss in chunks (``rollout.lm_micro_batch_size``) weighs each chunk by its share of the units.

:meth:`RefinerAlgorithm.loss` runs :meth:`chunk_loss` (a mean over the chunk's aggregation units) on a few
refinements at a time and sums the chunks weighted by their share of the batch's :meth:`units`: real tokens
for a token mean (TokenGRPO, DAPO), refinements with a real token for a mean over refinements (TokenGRPO's
``sequence_mean``, GSPO). Weighting by rows, or counting tokens for a mean over refinements, changes the loss
and its gradient as soon as the rows' lengths differ. The fast twin of tests/test_lm_micro_batch.py's slow
test: a tiny refiner built in memory, rows of very different lengths (one without a real token), advantages
of both signs and behavior log-probs that move the ratios into the clip.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.helpers import REFINER_ALGORITHMS
from unirl_pl.algorithms import LossInputs
from unirl_pl.experts import TinyCausalLMExpert
from unirl_pl.loops import ARDecode, RolloutConfig
from unirl_pl.method import ExpertLoss

PROMPTS = ["a red circle", "a blue square", "two green triangles", "a small red square"] * 2
# Real tokens per row: long rows first, then short ones and one without a real token, so that every chunking
# gives chunks whose shares of the tokens, of the refinements and of the rows all differ.
LENGTHS = [8, 8, 8, 1, 1, 0, 1, 2]
ALGORITHMS = REFINER_ALGORITHMS
# Each row's aggregation units: its real tokens for a token mean, 1 if it has one for a mean over refinements.
REFINEMENTS = [int(n > 0) for n in LENGTHS]
UNITS = {"token_grpo": LENGTHS, "dapo": LENGTHS, "sequence_mean": REFINEMENTS, "gspo": REFINEMENTS}


@pytest.fixture(scope="module")
def setup():
    """A tiny refiner whose adapter is not zero (the policy differs from its reference, so the KL term has a
    gradient), one draw of it cut to ``LENGTHS``, perturbed behavior log-probs and advantages."""
    llm = TinyCausalLMExpert(hidden_size=32, num_layers=1, intermediate_size=64, lora_rank=4)
    llm.build()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in llm.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    loop = ARDecode(llm, RolloutConfig(max_new_tokens=max(LENGTHS), temperature=1.0))
    _, record = loop.sample(PROMPTS, list(range(len(PROMPTS))), [0] * len(PROMPTS), "rollout", seed=0)
    assert record.gen_mask.shape[1] == max(LENGTHS)
    mask = torch.arange(max(LENGTHS))[None] < torch.tensor(LENGTHS)[:, None]
    old = record.old_logp + 0.3 * torch.randn(record.old_logp.shape, generator=gen)
    record = replace(record, gen_mask=mask, old_logp=torch.where(mask, old, torch.zeros_like(old)))
    advantages = torch.randn(len(PROMPTS), generator=gen)
    return llm, loop, record, advantages


def _loss_and_grads(setup, algorithm, settings, micro, anchor=None, record=None, advantages=None):
    llm, loop, whole_record, whole_advantages = setup
    record = whole_record if record is None else record
    advantages = whole_advantages if advantages is None else advantages
    params = [p for p in llm.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    loop = ARDecode(llm, replace(loop.config, lm_micro_batch_size=micro))
    inputs = LossInputs(loop, record, advantages, settings, llm.adapter_disabled, anchor)
    out = algorithm.loss(inputs, lambda term: term.backward())
    if not out.backpropagated:
        out.loss.backward()
    return out, torch.cat([p.grad.flatten() for p in params])


def _settings(correction: str) -> ExpertLoss:
    return ExpertLoss(clip_eps=0.2, beta=0.05, rollout_correction=correction, tis_cap=1.5)


@pytest.mark.parametrize("correction", ["off", "tis"])
@pytest.mark.parametrize("micro", [2, 3])
@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_the_chunked_loss_and_gradient_are_the_one_batch_ones(setup, name, micro, correction):
    algorithm, settings = ALGORITHMS[name], _settings(correction)
    whole, g_whole = _loss_and_grads(setup, algorithm, settings, None)
    assert g_whole.abs().max() > 0 and whole.kl > 0
    anchor = None
    if correction == "tis":  # a later PPO epoch's anchor: the first epoch's recompute, shifted
        anchor = whole.logp + 0.01
        whole, g_whole = _loss_and_grads(setup, algorithm, settings, None, anchor=anchor)
    chunked, g_chunked = _loss_and_grads(setup, algorithm, settings, micro, anchor=anchor)
    assert chunked.backpropagated and not whole.backpropagated
    torch.testing.assert_close(chunked.loss, whole.loss.detach(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(chunked.kl, whole.kl, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(g_chunked, g_whole, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(chunked.logp, whole.logp)


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_the_one_batch_loss_is_the_mean_over_its_units_of_the_single_row_losses(setup, name):
    """What a unit is: each row's own loss, weighted by its tokens for a token mean and equally (rows with a
    real token) for a mean over refinements, averages to the batch's loss."""
    _, _, record, advantages = setup
    algorithm, settings = ALGORITHMS[name], _settings("off")
    whole, _ = _loss_and_grads(setup, algorithm, settings, None)
    weights = torch.tensor(UNITS[name], dtype=torch.float64)
    total = torch.zeros((), dtype=torch.float64)
    for row in range(len(LENGTHS)):
        if weights[row] > 0:
            one = record.slice(row, row + 1)
            out, _ = _loss_and_grads(setup, algorithm, settings, None, record=one, advantages=advantages[row : row + 1])
            total += weights[row] * out.loss.detach().double()
    torch.testing.assert_close(total / weights.sum(), whole.loss.detach().double(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_the_units_count_tokens_for_a_token_mean_and_refinements_for_a_sequence_mean(setup, name):
    _, _, record, _ = setup
    units = ALGORITHMS[name].units(record)
    assert units.reshape(len(LENGTHS), -1).sum(1).tolist() == UNITS[name]
