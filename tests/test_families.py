"""The family recipes end to end on tiny pipeline folders: two RL steps through the CLI with the gates on,
then ``predict``; plus the instruct refiner's chat template and reply fallback in the decode loop.

The pipeline folders are built with the same diffusers / transformers classes a real checkpoint
instantiates and saved in the real layout; the trainer loads them through ``--model.pipeline_path``
exactly as it loads SD3.5 Medium, FLUX.1 or Wan2.1.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.chat_lm import make_qwen2_chat_lm
from tests.helpers import ROOT, read_metrics, series
from tests.pipelines import make_flux_pipeline, make_sd3_pipeline, make_wan_pipeline
from unirl_pl.cli import main
from unirl_pl.experts import CausalLMExpert
from unirl_pl.experts.chat import ChatFormat
from unirl_pl.loops import ARDecode, RolloutConfig

# sd35's header swaps its PickScore (4 GB of weights) for the JPEG reward on CPU; the others train on it already.
JPEG = ["--model.rewards={jpeg_incompressibility: 1.0}", "--model.reward_args=null"]
FAMILIES = {
    "sd35": (
        make_sd3_pipeline,
        ["--model.generator.init_args.height=32", "--model.generator.init_args.width=32", *JPEG],
    ),
    "flux": (make_flux_pipeline, ["--model.generator.init_args.height=32", "--model.generator.init_args.width=32"]),
    "wan_t2v": (
        make_wan_pipeline,
        [
            "--model.generator.init_args.height=16",
            "--model.generator.init_args.width=16",
            "--model.generator.init_args.num_frames=5",
        ],
    ),
}


@pytest.fixture(scope="module")
def refiner(tmp_path_factory) -> str:
    return make_qwen2_chat_lm(tmp_path_factory.mktemp("qwen"))


def _cpu(tmp_path: Path, family: str, pipeline: Path, refiner: str) -> list[str]:
    """The CPU overrides each family recipe documents in its header, plus this test's output folders."""
    return [
        f"--model.pipeline_path={pipeline}",
        f"--model.llm.init_args.pretrained_path={refiner}",
        "--trainer.accelerator=cpu",
        "--trainer.devices=1",
        "--model.generator.init_args.dtype=float32",
        "--model.llm.init_args.dtype=float32",
        "--model.generator.init_args.max_sequence_length=16",
        "--data.prompts_per_step=2",
        "--data.samples_per_prompt=2",
        "--model.rollout.num_steps=4",
        "--model.generator_algorithm.init_args.sde_window=[0,2]",
        "--model.rollout.max_new_tokens=12",
        "--data.val_batch_size=2",
        *FAMILIES[family][1],
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.enable_model_summary=false",
    ]


@pytest.mark.integration
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_recipe_trains_two_steps_with_gates_green_and_predicts(tmp_path, refiner, family):
    pipeline = FAMILIES[family][0](tmp_path / "pipeline")
    recipe = str(ROOT / "recipes" / f"{family}.yaml")
    cpu = _cpu(tmp_path, family, pipeline, refiner)
    cli = main(
        ["fit", "--config", recipe, *cpu, "--trainer.max_steps=2", f"--trainer.callbacks.dirpath={tmp_path}/ckpt"]
    )
    rows = read_metrics(cli)
    assert len(series(rows, "reward/mean")) == 2
    assert max(series(rows, "c2/llm_max_abs_diff")) <= 1e-5
    assert series(rows, "c2/transformer_max_abs_diff") == [0.0, 0.0], "the DiT recompute is bitwise"
    assert series(rows, "c2/transformer_frac_bitwise_equal") == [1.0, 1.0]
    assert series(rows, "parity/max_abs_diff"), "interleave parity ran"
    assert series(rows, "llm/fallback_frac"), "the instruct refiner logs its fallback rate"
    # One version per optimizer step: the family recipes update the DiT twice per rollout (as Flow-GRPO).
    updates = {name: cli.model.losses[name].mini_batches for name in ("transformer", "llm")}
    assert updates["transformer"] == 2, "the recipe's two updates per rollout"
    assert cli.model.ledger["transformer"] == 2 * updates["transformer"]
    assert cli.model.ledger["llm"] == 2 * updates["llm"]
    schedule = json.loads((Path(cli.trainer.log_dir) / "schedule.json").read_text())
    assert schedule["sigmas"] == cli.model.generator.schedule(4).sigmas.tolist(), "the pipeline's own schedule"
    assert schedule["sde_steps"] == [0, 1] and "Scheduler(" in schedule["source"]

    out = tmp_path / "predict"
    main(
        [
            "predict",
            "--config",
            recipe,
            *_cpu(tmp_path, family, pipeline, refiner),
            "--trainer.callbacks=[unirl_pl.callbacks.ImageWriter]",
            f"--trainer.callbacks.output_dir={out}",
            "--trainer.limit_predict_batches=1",
        ]
    )
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    suffix = ".webp" if family == "wan_t2v" else ".png"
    assert rows and all(r["file"].endswith(suffix) and (out / r["file"]).is_file() for r in rows)
    assert list(out.glob("grid_*.png")), "a captioned grid per batch"
    if family == "wan_t2v":
        from PIL import Image

        with Image.open(out / rows[0]["file"]) as clip:
            assert clip.n_frames == 5, "an animated WebP holds every frame"


# ------------------------------------------------------------------ the instruct refiner in the decode loop
@pytest.fixture(scope="module")
def chat_llm(refiner) -> CausalLMExpert:
    llm = CausalLMExpert(pretrained_path=refiner, chat=ChatFormat(max_refined_chars=200))
    llm.build()
    return llm


def test_recorded_tokens_are_exactly_the_generated_ones(chat_llm):
    """The template and instruction are context: the record scores only what the LM generated."""
    loop = ARDecode(chat_llm, RolloutConfig(max_new_tokens=6))
    prompts = ["a red circle", "two blue squares"]
    _, record = loop.sample(prompts, [0, 1], [0, 0], "rollout", seed=0)
    context = chat_llm.tokenize_requests(prompts)
    assert record.prompt_len == context["input_ids"].shape[1]
    assert torch.equal(record.input_ids[:, : record.prompt_len], context["input_ids"])
    instruction_tokens = context["attention_mask"].sum(1) - torch.tensor(
        [len(chat_llm.tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts]
    )
    assert bool((instruction_tokens > 10).all()), "the chat template and instruction are in the context"
    assert record.old_logp.shape == record.gen_mask.shape == (2, record.gen_ids.shape[1])
    assert record.gen_ids.shape[1] <= 6
    # Scoring the record reproduces the behavior log-probs on generated tokens and nothing else.
    rescored = loop.score(record)
    assert (rescored - record.old_logp).abs().max() <= 1e-5
    assert bool((rescored[~record.gen_mask] == 0).all())


def test_an_empty_reply_falls_back_to_the_user_prompt(chat_llm, monkeypatch):
    inner = chat_llm.forward
    eos = chat_llm.eos_token_id

    def ends_at_once(*args, **kwargs):
        out = inner(*args, **kwargs)
        out.logits[..., eos] = 1e4  # the reply ends before it says anything
        return out

    monkeypatch.setattr(chat_llm, "forward", ends_at_once)
    texts, record = ARDecode(chat_llm, RolloutConfig(max_new_tokens=6)).sample(
        ["a green triangle"], [0], [0], "rollout", seed=0
    )
    assert texts == ["a green triangle"] and record.fell_back == [True]
    assert record.gen_mask.sum() == 1, "only the end token was generated and recorded"
