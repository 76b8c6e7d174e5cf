"""The real-task reward recipes: the OCR prompts shipped with the repo are the generator's output, the main
SD3.5 recipe trains on PickScore, and (integration) each recipe runs the CPU override block its header
documents on tiny folders (sd35.yaml's with the JPEG reward for PickScore); the GenEval recipe's against a fake
GenEval server on loopback that checks every image arrives with its prompt's row."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import torch
import yaml
from transformers import CLIPModel

from tests.chat_lm import make_qwen2_chat_lm
from tests.geneval_server import FakeGenEval, metadata_score, read_record
from tests.helpers import ROOT, read_metrics, series
from tests.pipelines import make_sd3_pipeline
from tests.test_rewards_clip import _config, _save_processor
from unirl_pl.cli import main
from unirl_pl.data import load_prompts
from unirl_pl.rewards.ocr import quoted_text
from unirl_pl.rewards.ocr_prompts import TEMPLATES, make_prompts, split_texts
from unirl_pl.rewards.server import serve


@pytest.mark.parametrize("split, count", [("train", 1024), ("val", 64)])
def test_shipped_ocr_prompts_are_the_generators_output(split, count):
    shipped = load_prompts(str(ROOT / "recipes" / "prompts" / f"ocr_{split}.txt"))
    assert shipped == make_prompts(split, count), "regenerate with python -m unirl_pl.rewards.ocr_prompts"
    texts = set(split_texts(split))
    assert all(quoted_text(p) in texts for p in shipped), "each prompt quotes one text of its split"


def test_ocr_splits_hold_out_their_texts_and_cover_every_template():
    assert not set(split_texts("train")) & set(split_texts("val"))
    prompts = make_prompts("val", len(split_texts("val")) * len(TEMPLATES))
    assert len(set(prompts)) == len(prompts), "every (template, text) pair once before any repeats"
    assert make_prompts("train", 5, seed=1) != make_prompts("train", 5, seed=0)


def cpu_block(recipe: Path, paths: dict[str, str]) -> list[str]:
    """The override arguments a recipe's header documents for a CPU run, with the tiny folders' paths."""
    lines = recipe.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# On CPU"))
    args: list[str] = []
    for line in lines[start + 1 :]:
        if not line.startswith("#   "):
            if args:
                break
            continue
        text = line[1:]
        for placeholder, path in paths.items():
            text = text.replace(placeholder, path)
        args += shlex.split(text)
    return args


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    CLIPModel(_config()).save_pretrained(root / "clip")
    _save_processor(root / "clip")
    return {
        "/tmp/tiny-sd3": str(make_sd3_pipeline(root / "sd3")),
        "/tmp/tiny-qwen": str(make_qwen2_chat_lm(root / "qwen")),
        "/tmp/tiny-clip": str(root / "clip"),
    }


def fit_cpu_block(recipe: Path, args: list[str], tmp_path: Path):
    """``fit`` of ``recipe`` with its CPU block's arguments, writing under ``tmp_path``; the CLI object."""
    outputs = [
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        f"--trainer.default_root_dir={tmp_path}",
        f"--trainer.callbacks.dirpath={tmp_path}/ckpt",
        "--trainer.enable_model_summary=false",
    ]
    return main(["fit", "--config", str(recipe), *args, *outputs])


def test_sd35_trains_on_pickscore_in_float32_and_its_cpu_block_on_jpeg():
    """The main SD3.5 recipe's reward is PickScore in process, as sd35_pickscore.yaml scores it (float32, the
    original prompt, / 26), and the plan counts its ViT-H/14 on the GPU; the CPU block swaps in the JPEG reward
    (PickScore's weights are 4 GB), dropping the PickScore arguments the reward set would refuse."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from unirl_pl.plan.recipe import parsed_recipe, step_recipe
    from unirl_pl.plan.rewards import planned_rewards

    recipe = ROOT / "recipes" / "sd35.yaml"
    model = yaml.safe_load(recipe.read_text())["model"]["init_args"]
    published = yaml.safe_load((ROOT / "recipes" / "sd35_pickscore.yaml").read_text())["model"]["init_args"]
    assert model["rewards"] == {"pickscore": 1.0} and model["reward_args"] == published["reward_args"]
    assert model["reward_args"]["pickscore"]["dtype"] == "float32"
    (term,) = planned_rewards(step_recipe(parsed_recipe(["--config", str(recipe)])).rewards, FakeTensorMode())
    assert term.name == "pickscore" and term.on_device
    assert abs(term.weight_bytes - 4 * term.parameters) <= 0.01 * term.weight_bytes  # float32 (bf16: half)
    args = cpu_block(recipe, {})
    assert "--model.rewards={jpeg_incompressibility: 1.0}" in args and "--model.reward_args=null" in args


@pytest.mark.integration
@pytest.mark.parametrize(
    "name, term",
    [("sd35_ocr", "ocr"), ("sd35_pickscore", "pickscore"), ("sd35", "jpeg_incompressibility")],
)
def test_recipe_runs_its_documented_cpu_block(tmp_path, tiny, name, term):
    if term == "ocr":
        pytest.importorskip("rapidocr_onnxruntime")
    recipe = ROOT / "recipes" / f"{name}.yaml"
    args = cpu_block(recipe, tiny)
    assert "--trainer.accelerator=cpu" in args and "--trainer.max_steps=2" in args
    cli = fit_cpu_block(recipe, args, tmp_path)
    rows = read_metrics(cli)
    assert len(series(rows, f"reward/{term}")) == 2 and len(series(rows, f"reward/{term}_std")) == 2
    assert cli.model.ledger["transformer"] == 2 * 2, "2 steps, 2 updates per rollout (as Flow-GRPO)"


@pytest.mark.integration
def test_geneval_recipe_sends_every_image_its_prompt_s_geneval_row(tmp_path, tiny):
    """The documented CPU block against the fake GenEval server (the reference server serving FakeGenEval): a
    sample without its prompt's row fails the request, and so the fit; every sample of both steps and of the
    sanity check's validation batch arrives with its own row, in requests of the block's 2 images."""
    recipe = ROOT / "recipes" / "sd35_geneval.yaml"
    prompts = ROOT / "recipes" / "prompts" / "geneval_example.jsonl"
    record = tmp_path / "geneval.jsonl"
    fake = FakeGenEval(str(prompts))  # its rows; the served one, built in the server's worker, writes the record
    server = serve(
        f"{FakeGenEval.__module__}.FakeGenEval", reward_args={"prompt_file": str(prompts), "record": str(record)}
    )
    try:
        # The server's address for the header's, and the example file wherever the tests run from.
        paths = {**tiny, "http://127.0.0.1:18085/": server.url, "recipes/prompts/": f"{ROOT}/recipes/prompts/"}
        args = cpu_block(recipe, paths)
        assert "--trainer.accelerator=cpu" in args and "--trainer.max_steps=2" in args
        assert f"--data.prompts={prompts}" in args and any(server.url in a for a in args)
        cli = fit_cpu_block(recipe, args, tmp_path)
    finally:
        server.close()
    seen, mismatches = read_record(record)
    assert not mismatches, mismatches[:3]
    # 2 steps x 2 prompts x 2 texts x 1 image, and the sanity check's validation batch of 2 prompts.
    assert len(seen) == 2 * 2 * 2 + 2, len(seen)
    assert all(meta == fake.rows[prompt] for prompt, meta in seen)
    rows = read_metrics(cli)
    scores = series(rows, "reward/http")
    assert len(scores) == 2 and len(series(rows, "reward/refiner_format")) == 2
    low, high = min(map(metadata_score, fake.rows.values())), max(map(metadata_score, fake.rows.values()))
    assert all(low <= score <= high + 0.01 for score in scores), scores
    assert cli.model.ledger["transformer"] == 2 * 2, "2 steps, 2 updates per rollout (as Flow-GRPO)"
