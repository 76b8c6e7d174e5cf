"""Every algorithm overlay fits the tiny recipe with its gates green, and the stateful one resumes exactly.

Per overlay: 2 steps with the C2 identity (its own: log-probs, or DiffusionNFT's old-policy velocity),
interleave parity at fit start and at step 1, and the version ledger; the adapters move. DiffusionNFT keeps
an old policy (an EMA of the adapter) across steps: N steps == N/2 + resume + N/2 bit for bit only if the
checkpoint carries it.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import ROOT, read_metrics, run_cli, series

pytestmark = pytest.mark.integration

OVERLAYS = ROOT / "recipes" / "algorithms"
# 4 denoising steps; each algorithm keeps its own window (the tiny recipe's [0, 3) for Flow-GRPO, CPS, Guard).
FAST = ("--trainer.limit_val_batches=0", "--model.rollout.num_steps=4")
GATES = (
    "--trainer.callbacks=[unirl_pl.callbacks.LogProbIdentityCheck, unirl_pl.callbacks.WeightVersionLedger, "
    "unirl_pl.callbacks.InterleaveParityCheck]",
    "--trainer.callbacks.every_n_steps=1",
    "--trainer.callbacks.num_requests=2",
)


@pytest.mark.parametrize(
    "name", ["flow_grpo_fast", "mix_grpo", "mix_grpo_flash", "cps", "grpo_guard", "diffusion_nft", "dapo", "gspo"]
)
def test_overlay_fits_with_gates_green(tmp_path, name):
    cli = run_cli(
        tmp_path,
        "--config",
        str(OVERLAYS / f"{name}.yaml"),
        "--trainer.max_steps=2",
        "--trainer.enable_checkpointing=false",
        *FAST,
        *GATES,
        name=name,
    )
    rows = read_metrics(cli)
    assert series(rows, "c2/transformer_max_abs_diff") == [0.0, 0.0], "the generator's identity holds bit for bit"
    assert max(series(rows, "c2/llm_max_abs_diff")) <= 1e-5
    assert len(series(rows, "parity/max_abs_diff")) == 2, "parity at fit start and at step 1"
    per_step = {n: cli.model.losses[n].mini_batches for n in ("transformer", "llm")}  # the overlay's updates
    assert series(rows, "version/transformer")[-1] == 2.0 * per_step["transformer"]
    assert series(rows, "version/llm")[-1] == 2.0 * per_step["llm"]
    for key in ("transformer/loss", "llm/loss", "transformer/grad_norm", "llm/grad_norm"):
        values = series(rows, key)
        assert len(values) == 2 and all(torch.isfinite(torch.tensor(values))), key
    assert max(series(rows, "transformer/grad_norm")) > 0 and max(series(rows, "llm/grad_norm")) > 0
    if name == "dapo":  # dynamic sampling: how many of the step's groups the refiner trained on
        assert all(1 <= g <= cli.datamodule.prompts_per_step for g in series(rows, "llm/train_groups"))


def test_diffusion_nft_resume_is_bit_exact(tmp_path, capsys):
    overlay = ("--config", str(OVERLAYS / "diffusion_nft.yaml"))
    # A fast-moving old policy, so that losing it on resume would show.
    ema = ("--model.generator_algorithm.init_args.ema_rate=0.3",)
    ckpts = tmp_path / "ckpts"
    callbacks = (
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        f"--trainer.callbacks.dirpath={ckpts}",
        "--trainer.callbacks.every_n_train_steps=1",
        "--trainer.callbacks.save_top_k=-1",
    )
    full = run_cli(tmp_path, *overlay, *ema, "--trainer.max_steps=3", *FAST, *callbacks, name="full")
    ckpt = ckpts / "epoch=0-step=2.ckpt"
    saved = torch.load(ckpt, weights_only=True)["unirl_algorithms"]["generator_algorithm"]
    assert saved["class"] == "unirl_pl.algorithms.diffusion_nft.DiffusionNFT" and saved["state"]["old"]
    resumed = run_cli(tmp_path, *overlay, *ema, "--trainer.max_steps=3", *FAST, f"--ckpt_path={ckpt}", name="resumed")
    for a, b in zip(full.model.generator_algorithm.old, resumed.model.generator_algorithm.old, strict=True):
        assert torch.equal(a, b)
    want = {k: v for k, v in full.model.named_parameters() if v.requires_grad}
    got = {k: v for k, v in resumed.model.named_parameters() if v.requires_grad}
    assert all(torch.equal(want[k], got[k]) for k in want)
    last = [r for r in read_metrics(full) if "transformer/loss" in r][-1]
    again = [r for r in read_metrics(resumed) if "transformer/loss" in r][-1]
    assert last["transformer/loss"] == again["transformer/loss"]
    # Resuming with another algorithm is refused, naming both, in one line.
    with pytest.raises(SystemExit) as stop:
        run_cli(tmp_path, "--trainer.max_steps=3", *FAST, f"--ckpt_path={ckpt}", name="other")
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in err and "resume with the same algorithm" in err, err[-2000:]
