"""The VLM refiner (``unirl_pl.experts.vlm``): tiny Qwen2.5-VL and Qwen3-VL folders load text-only, decode
with the C2 identity under left padding, and train only their language model."""

from __future__ import annotations

# The hub reads HF_HUB_OFFLINE at import time, so it is set before the imports below.
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageTextToText, DynamicCache

from tests.helpers import read_metrics, run_cli, series
from tests.vlm_lm import FAMILIES, VISION_TOKENS, make_vlm
from unirl_pl.experts import VLMRefinerExpert
from unirl_pl.experts.base import lora_layers
from unirl_pl.experts.chat import GENEVAL_INSTRUCTION, ChatFormat
from unirl_pl.experts.tokenizer import load_tokenizer
from unirl_pl.experts.vlm import text_positions, vision_tower
from unirl_pl.loops import ARDecode
from unirl_pl.loops.config import RolloutConfig

PROMPTS = ["red circle", "two blue squares on the left of a big green cube , with a small yellow star above"]
PROMPTRL_CHAT = ChatFormat(instruction=GENEVAL_INSTRUCTION, answer_tag="answer")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {family: make_vlm(family, tmp_path_factory.mktemp(family)) for family in FAMILIES}


def _expert(folder: str, **kwargs: Any) -> VLMRefinerExpert:
    expert = VLMRefinerExpert(pretrained_path=folder, chat=PROMPTRL_CHAT, **kwargs)
    expert.build()
    return expert


def _optimizer_params(expert: torch.nn.Module) -> set[int]:
    # As UniRLModule.configure_optimizers builds each trained expert's optimizer.
    params = [p for p in expert.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    return {id(p) for group in optimizer.param_groups for p in group["params"]}


# ---------------------------------------------------------------- fixture folders


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_fixture_folder_loads_offline_in_its_real_layout(folders: dict[str, str], family: str) -> None:
    folder = folders[family]
    assert json.loads((Path(folder) / "config.json").read_text())["model_type"] == family
    model = AutoModelForImageTextToText.from_pretrained(folder)
    assert type(model).__name__ == {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}.get(
        family, "Qwen3VLForConditionalGeneration"
    )
    rope = model.config.text_config.rope_parameters
    assert rope["mrope_section"] == [2, 3, 3] and sum(rope["mrope_section"]) * 2 == 16
    tok = load_tokenizer(folder)
    assert tok.chat_template is not None
    assert tok.convert_ids_to_tokens(tok.eos_token_id) == "<|im_end|>"
    for token in (*VISION_TOKENS, "<|im_start|>"):
        assert tok.convert_tokens_to_ids(token) != tok.unk_token_id, token
    assert model.config.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    # The image processor (PIL backend, no torchvision): a (2 * patch * merge)-pixel square is 4 merged tokens,
    # the count the processor would expand <|image_pad|> to.
    processor = AutoImageProcessor.from_pretrained(folder)
    side = 2 * processor.patch_size * processor.merge_size
    grid = processor(images=[Image.new("RGB", (side, side))], return_tensors="pt")["image_grid_thw"]
    assert int(grid.prod()) // processor.merge_size**2 == 4


# ---------------------------------------------------------------- decode and C2


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_decode_and_rescore_agree_with_left_padding(folders: dict[str, str], family: str) -> None:
    expert = _expert(folders[family])
    loop = ARDecode(expert, RolloutConfig(max_new_tokens=8, temperature=1.0))
    texts, record = loop.sample(PROMPTS, [0, 1], [0, 0], "rollout", seed=0)
    assert len(texts) == 2 and len(record.replies) == 2
    # The short prompt really is left-padded: the two rows' positions differ.
    assert int((record.attention_mask[:, : record.prompt_len] == 0).sum()) > 0
    with torch.no_grad():
        rescored = loop.score(record)
    assert bool(record.gen_mask.any())
    assert float((rescored - record.old_logp).abs().max()) <= 1e-5


@pytest.mark.slow
def test_stale_rope_deltas_do_not_move_text_positions(folders: dict[str, str]) -> None:
    # After an image call the model caches ``rope_deltas``; a text-only call that let the model compute its own
    # positions would add them during cached decode but not in the re-score. The expert always passes its own.
    expert = _expert(folders["qwen2_5_vl"])
    loop = ARDecode(expert, RolloutConfig(max_new_tokens=6, temperature=1.0))
    _, clean = loop.sample(PROMPTS, [0, 1], [0, 0], "rollout", seed=3)
    expert.model.get_base_model().model.rope_deltas = torch.tensor([[7], [7]])
    _, stale = loop.sample(PROMPTS, [0, 1], [0, 0], "rollout", seed=3)
    assert torch.equal(clean.input_ids, stale.input_ids)
    assert torch.allclose(clean.old_logp, stale.old_logp, atol=1e-6)
    with torch.no_grad():
        assert float((loop.score(stale) - stale.old_logp).abs().max()) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_cached_step_needs_the_prefill_count_of_positions(folders: dict[str, str], family: str) -> None:
    # RoPE sees relative positions, so a constant shift of a row is harmless; what breaks C2 is a cached decode
    # step whose position does not continue its row's prefill count. The model's own text positions (no
    # position ids) count the left padding of the short row there; the expert's step, as the decode loop
    # calls it, matches the teacher-forced forward.
    expert = _expert(folders[family])
    enc = expert.tokenize_requests(PROMPTS)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    nxt = torch.full((2, 1), expert.tokenizer.convert_tokens_to_ids("red"))
    full_ids, full_mask = torch.cat([ids, nxt], 1), torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    with torch.no_grad():
        forced = expert(input_ids=full_ids, attention_mask=full_mask).logits[:, -1]
        steps = []
        for own_positions in (False, True):
            cache = DynamicCache()
            expert(
                input_ids=ids,
                attention_mask=mask,
                position_ids=text_positions(mask),
                past_key_values=cache,
                use_cache=True,
            )
            if own_positions:
                out = expert.model(input_ids=nxt, attention_mask=full_mask, cache=cache, use_cache=True)
            else:
                pos = text_positions(mask)[:, -1:] + 1
                out = expert(
                    input_ids=nxt, attention_mask=full_mask, position_ids=pos, past_key_values=cache, use_cache=True
                )
            steps.append(torch.log_softmax(out.logits[:, -1], -1) - torch.log_softmax(forced, -1))
    ours, models_own = steps
    assert float(ours.abs().max()) <= 1e-5
    assert float(models_own[0].abs().max()) > 1e-3  # the left-padded row
    assert float(models_own[1].abs().max()) <= 1e-5  # the longest row has no padding


# ---------------------------------------------------------------- what trains


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_lora_on_the_language_model_only(folders: dict[str, str], family: str) -> None:
    # ``qkv`` is the vision tower's attention: listing it must still leave the tower without an adapter.
    expert = _expert(folders[family], lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "qkv"])
    names = [name for name, module in expert.model.named_modules() if module in set(lora_layers(expert.model))]
    assert names and all(".language_model." in name for name in names), names
    assert {name.rsplit(".", 1)[-1] for name in names} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    trainable = [name for name, p in expert.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name and ".language_model." in name for name in trainable)


@pytest.mark.slow
@pytest.mark.parametrize("finetune", ["lora", "full"])
@pytest.mark.parametrize("family", FAMILIES)
def test_vision_tower_frozen_and_in_no_optimizer(folders: dict[str, str], family: str, finetune: str) -> None:
    expert = _expert(folders[family], finetune=finetune)
    expert.train()
    tower = vision_tower(expert.model)
    assert tower is not None and not tower.training
    tower_params = list(tower.parameters())
    assert tower_params and not any(p.requires_grad for p in tower_params)
    in_optimizer = _optimizer_params(expert)
    assert in_optimizer and not ({id(p) for p in tower_params} & in_optimizer)
    if finetune == "full":
        base = expert.model
        lm = base.model.language_model
        # The language model (and the tied lm_head) trains in float32; the reference copy does not train.
        assert all(p.requires_grad and p.dtype == torch.float32 for p in lm.parameters())
        assert base.lm_head.weight.requires_grad
        reference = expert.reference_model
        assert not any(p.requires_grad for p in reference.parameters())
        assert not ({id(p) for p in reference.parameters()} & in_optimizer)


@pytest.mark.slow
def test_full_finetune_reference_is_the_initial_weights(folders: dict[str, str]) -> None:
    expert = _expert(folders["qwen2_5_vl"], finetune="full")
    enc = expert.tokenize_requests(PROMPTS)
    with torch.no_grad():
        before = expert(**enc).logits
        expert.model.model.language_model.norm.weight.add_(0.5)  # an "update" of the policy
        after = expert(**enc).logits
        with expert.adapter_disabled():
            reference = expert(**enc).logits
    assert not torch.allclose(before, after)
    assert torch.equal(before, reference)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="finetune"):
        VLMRefinerExpert(pretrained_path="unused", finetune="partial")
    with pytest.raises(ValueError, match="load_image_processor"):
        VLMRefinerExpert(pretrained_path="unused", load_image_processor="yes")  # type: ignore[arg-type]


@pytest.mark.slow
def test_image_processor_is_optional(folders: dict[str, str]) -> None:
    assert _expert(folders["qwen3_vl"]).image_processor is None
    processor = _expert(folders["qwen3_vl"], load_image_processor=True).image_processor
    assert processor is not None and processor.patch_size == 16


# ---------------------------------------------------------------- a real fit


class ReplyProbe:
    """A reward that appends the replies it is given to a JSON-lines file (and scores 0): the fit may import
    this module under another name than pytest did, so the file, not a class attribute, carries them back."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, prompts: list[str], refined_prompts: list[str], images: Any, replies: Any = None) -> list[float]:
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(replies) + "\n")
        return [0.0] * len(prompts)


@pytest.mark.slow
def test_tiny_fit_with_the_vlm_refiner_hands_replies_to_rewards(tmp_path: Path, folders: dict[str, str]) -> None:
    probe = tmp_path / "replies.jsonl"
    probe.touch()  # the recipe check wants a named path to exist
    llm = {
        "class_path": "unirl_pl.experts.VLMRefinerExpert",
        "init_args": {
            "pretrained_path": folders["qwen2_5_vl"],
            "chat": {"instruction": GENEVAL_INSTRUCTION, "answer_tag": "answer"},
        },
    }
    cli = run_cli(
        tmp_path,
        "--trainer.max_steps=2",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.val_check_interval=2",
        f"--model.llm={json.dumps(llm)}",
        '--model.rewards={"promptrl_format": 0.5, "tests.test_vlm_refiner.ReplyProbe": 0.1, "brightness": 0.5}',
        f'--model.reward_args={{"tests.test_vlm_refiner.ReplyProbe": {{"path": "{probe}"}}}}',
        "--model.rollout.max_new_tokens=6",
    )
    assert cli.trainer.global_step == 2
    rows = read_metrics(cli)
    c2 = series(rows, "c2/llm_max_abs_diff")
    assert c2 and max(c2) <= 1e-5
    assert series(rows, "reward/promptrl_format")
    # 4 prompts x 4 samples a step, the first sample of each prompt unrefined (num_skip_refinement: 1).
    seen = [json.loads(line) for line in probe.read_text().splitlines()]
    assert len(seen) == 3  # one call a step, then the validation after step 2
    for replies in seen[:2]:
        assert len(replies) == 16
        assert [r is None for r in replies] == [i % 4 == 0 for i in range(16)]
        assert all(isinstance(r, str) for i, r in enumerate(replies) if i % 4)
    # Validation refines every prompt greedily and hands those replies over too.
    assert seen[2] and all(isinstance(r, str) for r in seen[2])
