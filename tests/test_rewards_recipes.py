"""The real-task reward recipes: the OCR prompts shipped with the repo are the generator's output, and
(integration) each recipe runs the CPU override block its header documents on tiny folders."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import torch
from transformers import CLIPModel

from tests.chat_lm import make_qwen2_chat_lm
from tests.helpers import ROOT, read_metrics, series
from tests.pipelines import make_sd3_pipeline
from tests.test_rewards_clip import _config, _save_processor
from unirl_pl.cli import main
from unirl_pl.data import load_prompts
from unirl_pl.rewards.ocr import quoted_text
from unirl_pl.rewards.ocr_prompts import TEMPLATES, make_prompts, split_texts


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


@pytest.mark.integration
@pytest.mark.parametrize("name, term", [("sd35_ocr", "ocr"), ("sd35_pickscore", "pickscore")])
def test_recipe_runs_its_documented_cpu_block(tmp_path, tiny, name, term):
    if term == "ocr":
        pytest.importorskip("rapidocr_onnxruntime")
    recipe = ROOT / "recipes" / f"{name}.yaml"
    args = cpu_block(recipe, tiny)
    assert "--trainer.accelerator=cpu" in args and "--trainer.max_steps=2" in args
    cli = main(
        [
            "fit",
            "--config",
            str(recipe),
            *args,
            f"--trainer.logger.init_args.save_dir={tmp_path}",
            f"--trainer.default_root_dir={tmp_path}",
            f"--trainer.callbacks.dirpath={tmp_path}/ckpt",
            "--trainer.enable_model_summary=false",
        ]
    )
    rows = read_metrics(cli)
    assert len(series(rows, f"reward/{term}")) == 2 and len(series(rows, f"reward/{term}_std")) == 2
    assert cli.model.ledger["transformer"] == 2 * 2, "2 steps, 2 updates per rollout (as Flow-GRPO)"
