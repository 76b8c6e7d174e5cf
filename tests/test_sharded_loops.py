"""Data-dependent loops under sharding: every rank runs the same number of sharded forwards.

The refiner's decode stops when its sequences end, and a batch of requests runs as many denoising
steps as its longest schedule. Under FSDP2 every forward all-gathers the sharded weights, so ranks
that disagree on a loop's trip count fall out of step (gloo aborts or hangs). These tests give the two
ranks different data on purpose, then run the main recipe with each overlay.
"""

from __future__ import annotations

import csv
import datetime
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers import JOINT, ROOT, run_cli_subprocess

pytestmark = pytest.mark.integration
MAX_NEW_TOKENS = 6


def _decode_worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # A short timeout turns a desynchronized collective into a failure instead of a hang.
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    try:
        from torch.distributed.device_mesh import init_device_mesh

        from unirl_pl.distributed import shard_experts
        from unirl_pl.experts import FlowTransformerExpert, TextEncoderExpert, TinyCausalLMExpert
        from unirl_pl.generators import ComponentGenerator
        from unirl_pl.loops import ARDecode, DiffusionDenoise, RolloutConfig

        llm, dit = TinyCausalLMExpert(), FlowTransformerExpert(in_channels=3)
        generator = ComponentGenerator(dit, TextEncoderExpert(), vae=None)
        llm.build()
        generator.build()
        mesh = init_device_mesh("cpu", (2,))
        shard_experts({"llm": llm, "transformer": dit}, ["llm", "transformer"], mesh, reshard_after_forward=True)
        eos = llm.eos_token_id
        forwards = []
        inner = llm.forward

        def forced(*args, **kwargs):
            out = inner(*args, **kwargs)
            # Rank 0 ends every sequence at its first token; rank 1 never ends one.
            out.logits[..., eos] = 1e4 if rank == 0 else -1e4
            forwards.append(1)
            return out

        llm.forward = forced
        config = RolloutConfig(max_new_tokens=MAX_NEW_TOKENS, num_steps=4)
        prompts = ["a red circle", "a blue square"]
        _, record = ARDecode(llm, config).sample(prompts, [rank, rank + 2], [0, 0], "rollout", seed=0)
        lengths = record.gen_mask.sum(1).tolist()
        # Per-request step counts: rank 0's requests finish after 2 steps, rank 1's run 4.
        cond = {"hidden": torch.zeros(2, 24, 32), "pooled": torch.zeros(2, 32)}
        counts = [2, 2] if rank == 0 else [4, 4]
        velocity_calls = []
        inner_velocity = dit.velocity

        def counted(*args, **kwargs):
            velocity_calls.append(1)
            return inner_velocity(*args, **kwargs)

        dit.velocity = counted
        DiffusionDenoise(generator, config).sample(cond, [rank, rank + 2], [0, 0], "serve", seed=0, num_steps=counts)
        Path(out_dir, f"rank{rank}.txt").write_text(f"{lengths} {len(forwards)} {len(velocity_calls)}")
        # Both ranks leave their collectives before either tears gloo down: a rank that destroys the
        # group while its peer still talks can abort ("terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_ranks_agree_on_decode_and_denoise_trip_counts(tmp_path):
    """One rank's sequences end at the first token, the other's run to max_new_tokens: both must finish."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_decode_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    r0 = (tmp_path / "rank0.txt").read_text().split("] ")
    r1 = (tmp_path / "rank1.txt").read_text().split("] ")
    assert r0[0] + "]" == "[1, 1]", r0  # ended at the first token
    assert r1[0] + "]" == f"[{MAX_NEW_TOKENS}, {MAX_NEW_TOKENS}]", r1
    # Same number of sharded forwards on both ranks: the prompt pass plus one per continued token, and
    # one velocity call per step of the longest schedule.
    assert r0[1] == r1[1] == f"{MAX_NEW_TOKENS} 4", (r0, r1)


def _fit_main(tmp_path: Path, overlay: str, *extra: str) -> list[dict[str, str]]:
    run_cli_subprocess(
        "fit",
        "--config",
        JOINT,
        "--config",
        str(ROOT / "recipes" / overlay),
        "--trainer.max_steps=2",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.enable_model_summary=false",
        f"--trainer.callbacks.dirpath={tmp_path / 'checkpoints'}",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        "--trainer.val_check_interval=2",
        # One small held-out batch (8 prompts, 4 a rank, one image each) shows validation runs sharded.
        "--trainer.limit_val_batches=1",
        "--data.val_batch_size=8",
        "--data.val_images_per_prompt=1",
        *extra,
    )
    (path,) = tmp_path.glob("joint/version_*/metrics.csv")
    with path.open() as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("overlay", ["fsdp.yaml", "ddp.yaml"])
def test_main_recipe_runs_under_each_overlay(tmp_path, overlay):
    """The main job (shipped experts, the refiner's real stop tokens, held-out validation) on 2 ranks."""
    rows = _fit_main(tmp_path, overlay)
    rewards = [r for r in rows if r.get("reward/mean")]
    assert len(rewards) == 2
    c2 = [float(r["c2/llm_max_abs_diff"]) for r in rows if r.get("c2/llm_max_abs_diff")]
    assert len(c2) == 2 and max(c2) <= 1e-5
    dit = [float(r["c2/transformer_max_abs_diff"]) for r in rows if r.get("c2/transformer_max_abs_diff")]
    assert dit == [0.0, 0.0]
    assert any(r.get("val/reward_mean") for r in rows), "validation did not run"
