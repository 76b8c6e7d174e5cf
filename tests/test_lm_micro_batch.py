"""The refiner's loss in micro-batches (``rollout.lm_micro_batch_size``) is the one-batch loss.

Each chunk's loss is a mean over its aggregation units (tokens for a token mean, refinements for the
sequence-level losses) and is weighted by its share of the batch's units, then backpropagated before the
next chunk's forward. On the tiny recipe, with rows of different lengths, advantages of both signs and a
behavior log-prob that moves the ratios into the clip, the chunked gradient equals the one-batch gradient
for every refiner algorithm, with and without the rollout correction and the KL term.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.helpers import REFINER_ALGORITHMS, TINY
from unirl_pl.algorithms import LossInputs, TokenGRPO
from unirl_pl.cli import main
from unirl_pl.data import PromptBatch
from unirl_pl.method import ExpertLoss

QUIET = ["--trainer.logger=false", "--trainer.callbacks=[]", "--trainer.enable_progress_bar=false"]
ALGORITHMS = REFINER_ALGORITHMS


@pytest.fixture(scope="module")
def setup():
    cli = main(["--config", TINY, *QUIET, "--model.rollout.max_new_tokens=8"], run=False)
    model, dm = cli.model, cli.datamodule
    model.configure_model()
    prompts = ["a red circle", "a blue square", "two green triangles"]
    batch = PromptBatch(prompts, [3, 7, 9], seed=dm.seed, layout=dm.layout)
    exp = model.source.collect(batch, model.device)
    record = exp.records["ar_decode"]
    rows = record.input_ids.shape[0]
    assert rows >= 5, "enough refinements for uneven chunks"
    # Rows of different lengths (token-mean shares differ from row shares) and one row without a real token.
    mask = record.gen_mask.clone()
    mask[0, 2:] = False
    mask[1, 5:] = False
    mask[2, :] = False
    gen = torch.Generator().manual_seed(0)
    old = record.old_logp + 0.3 * torch.randn(record.old_logp.shape, generator=gen)
    record = replace(record, gen_mask=mask, old_logp=torch.where(mask, old, torch.zeros_like(old)))
    advantages = torch.randn(rows, generator=gen)
    return model, record, advantages


def _loss_and_grads(model, record, advantages, algorithm, settings, micro: int | None, anchor=None):
    loop = model.policy.loops["ar_decode"]
    expert = model.policy.experts["llm"]
    params = [p for p in expert.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    loop.config = replace(loop.config, lm_micro_batch_size=micro)
    events: list[str] = []

    def backward(term):
        events.append("backward")
        term.backward()

    handle = expert.register_forward_pre_hook(lambda *_: events.append("forward"))
    try:
        inputs = LossInputs(loop, record, advantages, settings, expert.adapter_disabled, anchor)
        out = algorithm.loss(inputs, backward)
    finally:
        handle.remove()
        loop.config = replace(loop.config, lm_micro_batch_size=None)
    if not out.backpropagated:
        out.loss.backward()
    grads = torch.cat([p.grad.flatten() for p in params])
    return out, grads, events


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ALGORITHMS))
@pytest.mark.parametrize("correction", ["off", "tis"])
def test_chunked_loss_has_the_one_batch_gradient(setup, name, correction):
    model, record, advantages = setup
    algorithm = ALGORITHMS[name]
    settings = ExpertLoss(clip_eps=0.2, beta=0.05, rollout_correction=correction, tis_cap=1.5)
    whole, g_whole, _ = _loss_and_grads(model, record, advantages, algorithm, settings, None)
    assert g_whole.abs().max() > 0
    # An anchor as the second PPO epoch sees it (the first epoch's recompute, here shifted).
    anchor = None if correction == "off" else whole.logp + 0.01
    chunked, g_chunked, _ = _loss_and_grads(model, record, advantages, algorithm, settings, 2, anchor=anchor)
    if anchor is not None:
        whole, g_whole, _ = _loss_and_grads(model, record, advantages, algorithm, settings, None, anchor=anchor)
    torch.testing.assert_close(g_chunked, g_whole, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(chunked.loss, whole.loss.detach(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(chunked.kl, whole.kl.detach(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(chunked.logp, whole.logp)
    assert chunked.ratio_min == whole.ratio_min and chunked.ratio_max == whole.ratio_max
    assert chunked.backpropagated and not whole.backpropagated


def test_each_chunk_is_backpropagated_before_the_next_forward(setup):
    model, record, advantages = setup
    settings = ExpertLoss(beta=0.0)
    rows = record.input_ids.shape[0]
    _, _, events = _loss_and_grads(model, record, advantages, TokenGRPO(), settings, 2)
    assert events == ["forward", "backward"] * ((rows + 1) // 2)


def test_the_gates_recompute_in_chunks_without_grad_equals_one_forward(setup):
    model, record, _ = setup
    loop = model.policy.loops["ar_decode"]
    with torch.no_grad():
        whole = loop.score(record)
        loop.config = replace(loop.config, lm_micro_batch_size=2)
        try:
            chunked = loop.score(record)
        finally:
            loop.config = replace(loop.config, lm_micro_batch_size=None)
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-6)


def test_lm_micro_batch_size_must_be_positive():
    from unirl_pl.loops import RolloutConfig

    with pytest.raises(ValueError, match="lm_micro_batch_size"):
        RolloutConfig(lm_micro_batch_size=0)
