"""The reference server serving registered rewards: concurrent requests batched into one reward call,
served PickScore equal to PickScore in process, and (integration) a 2-step fit on the tiny SD3 pipeline
whose rewards through the server equal the in-process ones."""

from __future__ import annotations

import importlib
import threading
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from tests.helpers import ROOT
from tests.pipelines import make_sd3_pipeline
from tests.test_rewards_clip import PROMPTS, _config, _save_processor
from unirl_pl.cli import main
from unirl_pl.rewards import Brightness, HTTPReward
from unirl_pl.rewards.clip_models import PickScore
from unirl_pl.rewards.server import RequestBatcher, serve
from unirl_pl.rewards.server import main as server_main

FAST = {"timeout_s": 10.0, "max_retries": 1, "backoff_s": 0.01}
HERE = "tests.test_rewards_server"


def _images(n: int, seed: int = 0, size: int = 32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, size, size), generator=g).float() / 255


def test_concurrent_requests_are_scored_in_one_call_and_split_back():
    server = serve("brightness", max_batch_size=64, batch_wait_s=0.5)
    try:
        client = HTTPReward(server.url, **FAST)
        results: dict[int, list[float]] = {}
        batches = {i: _images(2, seed=i, size=8) for i in range(4)}

        def call(i: int) -> None:
            results[i] = client([f"p{i}"] * 2, [f"r{i}"] * 2, batches[i])

        threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=20)
        for i in range(4):
            assert results[i] == pytest.approx(Brightness()([""] * 2, [""] * 2, batches[i]), abs=1e-6)
        calls = server.batcher.calls  # samples per reward call
        assert sum(calls) == 8 and len(calls) < 4, calls
    finally:
        server.close()


def test_the_batcher_keeps_image_sizes_apart_and_respects_the_batch_limit():
    sizes: list[tuple[int, int]] = []

    def reward(prompts, refined, images):
        sizes.append((len(prompts), images.shape[-1]))
        return images.mean(dim=(1, 2, 3)).tolist()

    batcher = RequestBatcher(reward, "r", max_size=4, wait_s=0.3)
    try:
        jobs = [(3, 8), (1, 8), (2, 16), (2, 8)]
        out: dict[int, tuple] = {}
        threads = []
        for i, (n, size) in enumerate(jobs):
            t = threading.Thread(
                target=lambda i=i, n=n, s=size: out.__setitem__(
                    i, batcher.score(["p"] * n, ["r"] * n, _images(n, i, s))
                )
            )
            threads.append(t)
            t.start()
            t.join(timeout=0.05)  # arrive in order, within one batch window
        for t in threads:
            t.join(timeout=10)
        assert all(out[i][1] is None and len(out[i][0]) == n for i, (n, _) in enumerate(jobs))
        assert all(n <= 4 for n, _ in sizes) and sum(n for n, _ in sizes) == 8
        assert all(len({s}) == 1 for _, s in sizes)
        assert (3 + 1, 8) in sizes, "the first two requests (same size, 4 samples) were scored together"
    finally:
        batcher.close()


def test_a_failing_reward_fails_every_request_of_its_batch():
    def broken(prompts, refined, images):
        raise RuntimeError("out of memory")

    batcher = RequestBatcher(broken, "broken", wait_s=0.0)
    try:
        scores, error = batcher.score(["p"], ["r"], _images(1, size=8))
        assert scores is None and "reward 'broken' failed: RuntimeError: out of memory" in error
    finally:
        batcher.close()


def test_the_command_line_refuses_bad_reward_args(capsys):
    with pytest.raises(SystemExit):
        server_main(["--reward", "brightness", "--reward-args", "{channel: 0"])
    assert "--reward-args is not JSON" in capsys.readouterr().err


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("clip")
    torch.manual_seed(0)
    from transformers import CLIPModel

    CLIPModel(_config()).save_pretrained(path)
    _save_processor(path)
    return str(path)


def test_served_pickscore_equals_pickscore_in_process(clip_dir):
    args = {"pretrained_path": clip_dir, "processor_path": clip_dir}
    images = torch.rand(5, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    local = PickScore(**args)(PROMPTS, PROMPTS, images)
    server = serve("pickscore", reward_args=args)
    try:
        served = HTTPReward(server.url, batch_size=5, **FAST)(PROMPTS, PROMPTS, images)
    finally:
        server.close()
    assert max(abs(a - b) for a, b in zip(served, local, strict=True)) <= 1e-6


# ------------------------------------------------------------------ acceptance: a 2-step fit through the server
class RecordRewards(pl.Callback):
    """Every training step's per-sample rewards (the experience is the batch at train-batch start)."""

    taken: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        RecordRewards.taken.append(batch.rewards.detach().cpu().clone())


def _fit(tmp_path: Path, pipeline: Path, rewards: str, reward_args: str, name: str) -> list[torch.Tensor]:
    shared = importlib.import_module(HERE)  # the module the CLI imports the callback from
    shared.RecordRewards.taken = []
    main(
        [
            "fit",
            "--config",
            str(ROOT / "recipes" / "sd35.yaml"),
            f"--model.pipeline_path={pipeline}",
            "--model.llm=null",
            "--model.mode=generator_only",
            "--trainer.accelerator=cpu",
            "--trainer.devices=1",
            "--model.generator.init_args.dtype=float32",
            "--model.generator.init_args.height=32",
            "--model.generator.init_args.width=32",
            "--model.generator.init_args.max_sequence_length=16",
            "--data.prompts_per_step=2",
            "--data.samples_per_prompt=2",
            "--model.rollout.num_steps=4",
            "--model.generator_algorithm.init_args.sde_window=[0,2]",
            "--trainer.max_steps=2",
            "--trainer.limit_val_batches=0",
            "--trainer.enable_checkpointing=false",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            f"--trainer.callbacks=[{HERE}.RecordRewards]",
            f"--trainer.logger.init_args.save_dir={tmp_path}",
            f"--trainer.logger.init_args.name={name}",
            f"--trainer.default_root_dir={tmp_path}",
            f"--model.rewards={rewards}",
            f"--model.reward_args={reward_args}",
        ]
    )
    return list(shared.RecordRewards.taken)


@pytest.mark.integration
def test_a_two_step_fit_gets_the_same_rewards_from_the_server_as_in_process(tmp_path, clip_dir):
    pipeline = make_sd3_pipeline(tmp_path / "pipeline")
    # Both sides run the CLIP towers on 2 images at a time (the client's request size), so the float32
    # sums are the same and the rewards can be compared bitwise.
    args = f'{{"pretrained_path": "{clip_dir}", "processor_path": "{clip_dir}", "batch_size": 2}}'
    local = _fit(tmp_path, pipeline, "{pickscore: 1.0}", f"{{pickscore: {args}}}", "local")
    reward_args = {"pretrained_path": clip_dir, "processor_path": clip_dir, "batch_size": 2}
    server = serve("pickscore", reward_args=reward_args)
    try:
        # batch_size 2 < 4 images a step: the first request is in flight while the second half decodes.
        http = f'{{http: {{url: "{server.url}", batch_size: 2, timeout_s: 30}}}}'
        served = _fit(tmp_path, pipeline, "{http: 1.0}", http, "served")
        assert sum(server.batcher.calls) == 2 * 4, "every image of both steps went through the server"
    finally:
        server.close()
    assert len(local) == len(served) == 2
    for a, b in zip(local, served, strict=True):
        assert a.shape == (4,) and torch.isfinite(a).all()
        assert torch.equal(a, b), (a - b).abs().max()
