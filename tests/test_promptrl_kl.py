"""PromptRL's KL of the SDE-step means (``ExpertLoss.kl_form: promptrl``), against its trainer's formula.

PromptRL (github.com/G-U-N/UniRL at commit 53c28c9) reads each step's sigma and next sigma off the scheduler's
sigma table by step index, takes ``sigma_max`` as the table's second entry, forms Flow-GRPO's ``std_dev_t`` and
step mean, and returns the step's full noise scale ``std_dev_t * sqrt(-dt)``
(unimodel/qwenklein/flux2_klein_pipeline.py:60-98); its trainer's KL divides the squared mean difference by
twice that scale squared (unirl/trainer/geneval_grpo_trainer.py:793). The reference below is that computation
written out in float64 from a hand-made shifted schedule, not a call of this package's functions; the Flow-GRPO
form (``std_dev_t`` without ``sqrt(-dt)``) must be ``-dt`` times it. Also: every Gaussian-step generator
algorithm computes it through ``drivers.step_kl``, and the refiner, CPS and DiffusionNFT refuse it.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from tests.helpers import REFINER_ALGORITHMS, TINY
from unirl_pl.algorithms import DiffusionNFT, FlowCPS, FlowGRPO, FlowGRPOFast, MixGRPO
from unirl_pl.algorithms.drivers import LossInputs, step_kl
from unirl_pl.cli import main
from unirl_pl.method import ExpertLoss
from unirl_pl.records import DiTRecord
from unirl_pl.sampling import flow_kl, flow_sde_step_with_logprob, promptrl_kl

NOISE = 0.8  # PromptRL's SDE noise scale (scripts/train/geneval_grpo_klein.sh:93)


def klein_like_sigmas(n: int = 20, mu: float = 1.15) -> torch.Tensor:
    """A float64 table of ``n + 1`` sigmas as a FLUX.2 pipeline builds one: ``linspace(1, 1 / n, n)``, time-shifted
    by ``exp(mu)`` (``e^mu / (e^mu + 1 / s - 1)``), then a terminal 0. Uneven steps, so ``dt`` differs per step."""
    base = [1.0 - i * (1.0 - 1.0 / n) / (n - 1) for i in range(n)]
    shifted = [math.exp(mu) / (math.exp(mu) + (1.0 / s - 1.0)) for s in base]
    return torch.tensor([*shifted, 0.0], dtype=torch.float64)


def reference_kl(sigmas: torch.Tensor, index: torch.Tensor, x, v, v_ref) -> tuple[torch.Tensor, torch.Tensor]:
    """PromptRL's per-sample KL and its step scale ``std_dev_t * sqrt(-dt)``, float64, each sample at its own step."""
    shape = (-1,) + (1,) * (x.ndim - 1)
    sigma = sigmas[index].reshape(shape)
    sigma_prev = sigmas[index + 1].reshape(shape)
    sigma_max = sigmas[1].item()
    dt = sigma_prev - sigma
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, torch.full_like(sigma, sigma_max), sigma))) * NOISE

    def step_mean(velocity):
        drift = velocity * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
        return x * (1 + std_dev_t**2 / (2 * sigma) * dt) + drift

    scale = std_dev_t * torch.sqrt(-1 * dt)
    kl = ((step_mean(v) - step_mean(v_ref)) ** 2 / (2 * scale**2)).mean(dim=tuple(range(1, x.ndim)))
    return kl, scale.reshape(-1)


def _inputs(seed: int = 0, index=(0, 1, 4, 9, 15)):
    g = torch.Generator().manual_seed(seed)
    index = torch.tensor(index)
    x = torch.randn(len(index), 4, 6, 6, generator=g, dtype=torch.float64)
    v = torch.randn(x.shape, generator=g, dtype=torch.float64)
    v_ref = v + 0.25 * torch.randn(x.shape, generator=g, dtype=torch.float64)
    return klein_like_sigmas(), index, x, v, v_ref


def _ours(sigmas, index, x, v, v_ref):
    """The package's step means (float32, per-sample sigmas) and its two KL forms."""
    s, s_next = sigmas[index], sigmas[index + 1]
    kwargs = {"sigma_max": float(sigmas[1]), "noise_level": NOISE, "prev_sample": x.float()}
    _, _, mean, std = flow_sde_step_with_logprob(x.float(), v.float(), s, s_next, **kwargs)
    _, _, ref_mean, ref_std = flow_sde_step_with_logprob(x.float(), v_ref.float(), s, s_next, **kwargs)
    assert torch.equal(std, ref_std)
    return promptrl_kl(mean, ref_mean, std, s, s_next), flow_kl(mean, ref_mean, std), std, s, s_next


def test_promptrl_kl_matches_promptrls_formula_in_float64():
    sigmas, index, x, v, v_ref = _inputs()
    assert sigmas[index[0]] == 1.0, "sample 0 takes the sigma_max branch"
    want, want_scale = reference_kl(sigmas, index, x, v, v_ref)
    got, _, std, s, s_next = _ours(sigmas, index, x, v, v_ref)
    # Our step's std is the scale before sqrt(-dt): times sqrt(-dt) it is PromptRL's returned 4th value.
    torch.testing.assert_close(std.reshape(-1).double() * torch.sqrt(s - s_next), want_scale, rtol=1e-6, atol=0)
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=0)
    # The check can see the faults it exists for: the scale without its sqrt, or no division by -dt at all.
    dt = (s_next - s).double()
    for wrong in (want * (-dt), want / (-dt)):  # std * (-dt) for std * sqrt(-dt); Flow-GRPO's form
        assert ((wrong - want).abs() / want).min() > 0.5


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_promptrl_form_is_flow_grpos_divided_by_minus_dt(seed):
    sigmas, index, x, v, v_ref = _inputs(seed, index=(0, 2, 5, 11, 19))
    promptrl, flow_grpo, _, s, s_next = _ours(sigmas, index, x, v, v_ref)
    torch.testing.assert_close((promptrl / flow_grpo).double(), 1 / (s - s_next), rtol=1e-6, atol=0)
    # and both are the reference: PromptRL's as written, Flow-GRPO's times -dt
    want, _ = reference_kl(sigmas, index, x, v, v_ref)
    torch.testing.assert_close(flow_grpo.double(), want * (s - s_next), rtol=2e-5, atol=0)


def test_promptrl_kl_takes_float_sigmas_and_is_zero_for_equal_means():
    mean = torch.randn(3, 2, 4, 4)
    std = torch.full((3, 1, 1, 1), 0.4)
    assert torch.equal(promptrl_kl(mean, mean, std, 0.6, 0.5), torch.zeros(3))
    got = promptrl_kl(mean, mean + 0.1, std, 0.6, 0.5)
    torch.testing.assert_close(got, torch.full((3,), 0.01 / (2 * 0.16 * 0.1)), rtol=1e-5, atol=0)


# ------------------------------------------------------------------ through the loss drivers


class _Loop:
    """A diffusion loop's ``train`` profile reduced to ``step_logprob``: the real SDE step on a record, with fixed
    per-(sample, step) velocities for the policy and, inside :meth:`reference`, for the reference."""

    def __init__(self, v: torch.Tensor, v_ref: torch.Tensor) -> None:
        self.v, self.v_ref, self.in_reference = v, v_ref, False

    def step_logprob(self, record: DiTRecord, step: int, chunk: tuple[int, int]):
        a, b = chunk
        s, s_next, sigma_max = record.step_sigmas(step, chunk)
        v = (self.v_ref if self.in_reference else self.v)[a:b, step]
        _, logp, mean, std = flow_sde_step_with_logprob(
            record.prev[a:b, step],
            v,
            s,
            s_next,
            sigma_max=sigma_max,
            noise_level=record.noise_level,
            prev_sample=record.sample[a:b, step],
        )
        return logp, mean, std

    @contextmanager
    def reference(self):
        self.in_reference = True
        try:
            yield
        finally:
            self.in_reference = False


def _record_and_loop(kind: str = "sde") -> tuple[DiTRecord, _Loop, torch.Tensor]:
    """3 samples x 3 recorded steps (steps 0, 1, 2 of the Klein-like table) in two micro-batches, and the float64
    reference KL of every (sample, step)."""
    g = torch.Generator().manual_seed(3)
    sigmas = klein_like_sigmas()
    n, steps, shape = 3, 3, (2, 4, 4)
    x = torch.randn(n, steps, *shape, generator=g, dtype=torch.float64)
    v = torch.randn(x.shape, generator=g, dtype=torch.float64)
    v_ref = v + 0.3 * torch.randn(x.shape, generator=g, dtype=torch.float64)
    want = torch.stack(
        [reference_kl(sigmas, torch.full((n,), j), x[:, j], v[:, j], v_ref[:, j])[0] for j in range(steps)], dim=1
    )
    loop = _Loop(v.float(), v_ref.float())
    record = DiTRecord(
        prev=x.float(),
        sample=torch.randn(x.shape, generator=g),
        sigma=sigmas[:steps].clone(),
        sigma_next=sigmas[1 : steps + 1].clone(),
        old_logp=torch.zeros(n, steps),
        cond={},
        sigma_max=float(sigmas[1]),
        noise_level=NOISE,
        chunks=[(0, 2), (2, 3)],
        version=0,
        kind=kind,
    )
    record.old_logp = loop_logp(loop, record)  # on-policy: ratio 1
    return record, loop, want


def loop_logp(loop: _Loop, record: DiTRecord) -> torch.Tensor:
    out = torch.empty_like(record.old_logp)
    for step, (a, b) in record.steps():
        out[a:b, step] = loop.step_logprob(record, step, (a, b))[0]
    return out


@pytest.mark.parametrize(
    "algorithm",
    [FlowGRPO(), FlowGRPO(guard=True), MixGRPO(), FlowGRPOFast()],
    ids=["flow_grpo", "grpo_guard", "mix_grpo", "flow_grpo_fast"],
)
def test_every_gaussian_step_algorithm_uses_the_kl_form_of_its_settings(algorithm):
    record, loop, want = _record_and_loop()
    sigma, sigma_next = record.sigma.double(), record.sigma_next.double()
    advantages = torch.tensor([1.0, -0.5, 0.25])
    for form, expected in (("promptrl", want), ("flow_grpo", want * (sigma - sigma_next))):
        settings = ExpertLoss(clip_eps=1e-4, beta=0.01, kl_form=form)
        algorithm.check_settings(settings)
        out = algorithm.loss(LossInputs(loop, record, advantages, settings, loop.reference))
        # The loss's KL is the mean over the (sample, step) pairs, as the policy term.
        torch.testing.assert_close(out.kl.double(), expected.mean(), rtol=2e-5, atol=0)
        torch.testing.assert_close(out.loss, out.pg_loss + 0.01 * out.kl, rtol=1e-6, atol=1e-9)


def test_step_kl_reads_the_records_sigmas_and_skips_the_reference_at_beta_0():
    record, loop, want = _record_and_loop()
    _, mean, std = loop.step_logprob(record, 1, (2, 3))
    got = step_kl(loop, record, 1, (2, 3), mean, std, 0.01, loop.reference, "promptrl")
    torch.testing.assert_close(got.double(), want[2:3, 1], rtol=2e-5, atol=0)
    assert step_kl(loop, record, 1, (2, 3), mean, std, 0.0, loop.reference, "promptrl") is None
    with pytest.raises(ValueError, match="kl_form"):
        step_kl(loop, record, 1, (2, 3), mean, std, 0.01, loop.reference, "k3")
    cps, _, _ = _record_and_loop(kind="cps")
    with pytest.raises(ValueError, match="full noise scale"):
        step_kl(loop, cps, 1, (2, 3), mean, std, 0.01, loop.reference, "promptrl")


# ------------------------------------------------------------------ who refuses it, and why


def _one_line_error(call: Any, match: str) -> str:
    with pytest.raises(ValueError, match=match) as err:
        call()
    message = str(err.value)
    assert "\n" not in message
    return message


def test_expert_loss_defaults_to_flow_grpo_and_refuses_unknown_forms():
    assert ExpertLoss().kl_form == "flow_grpo"
    _one_line_error(lambda: ExpertLoss(kl_form="k3"), "kl_form must be")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(REFINER_ALGORITHMS))
def test_the_refiner_refuses_a_non_default_kl_form_naming_its_key(name):
    algorithm = REFINER_ALGORITHMS[name]
    algorithm.check_settings(ExpertLoss())
    refused = ExpertLoss(kl_form="promptrl")
    message = _one_line_error(lambda: algorithm.check_settings(refused), "model.llm_loss.kl_form")
    assert "k3" in message


@pytest.mark.parametrize(
    ("algorithm", "match"),
    [
        (FlowCPS(noise_level=0.8), "FlowCPS: model.transformer_loss.kl_form='promptrl'"),
        (FlowGRPOFast(sde_type="cps"), "'cps' step's std is already its full noise scale"),
        (DiffusionNFT(), "DiffusionNFT's KL is the mean squared velocity distance"),
    ],
    ids=["cps", "flow_grpo_fast_cps", "diffusion_nft"],
)
def test_cps_and_diffusion_nft_refuse_promptrl_with_their_reason(algorithm, match):
    algorithm.check_settings(ExpertLoss(clip_eps=1e-4, beta=0.004))
    _one_line_error(lambda: algorithm.check_settings(ExpertLoss(clip_eps=1e-4, kl_form="promptrl")), match)


def test_a_recipe_with_kl_form_on_the_refiner_is_refused_when_the_recipe_is_read(capsys):
    """Refused as the module is built from the recipe, before any model loads: one line, no traceback."""
    quiet = ["--trainer.logger=false", "--trainer.callbacks=[]", "--trainer.enable_progress_bar=false"]
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--config", TINY, *quiet, "--model.llm_loss.kl_form=promptrl"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert stop.value.code == 2 and "Traceback" not in err and len(lines) == 1, err[-2000:]
    assert "model.llm_loss.kl_form='promptrl'" in lines[0]
    ok = main(["--config", TINY, *quiet, "--model.transformer_loss.kl_form=promptrl"], run=False)
    ok.model.configure_model()
    assert ok.model.loss_settings("transformer").kl_form == "promptrl"
