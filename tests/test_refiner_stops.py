"""Where a refinement ends: every stop id of the checkpoint's ``generation_config`` ends the decode loop,
and an instruct reply is cut at the first end-of-turn marker on token ids, before decoding drops the
special tokens (Qwen2.5-Instruct stops on ``<|im_end|>`` and ``<|endoftext|>``; its tokenizer's EOS is
only one of them)."""

from __future__ import annotations

import pytest
import torch

from tests.chat_lm import make_qwen2_chat_lm
from unirl_pl.experts.chat import ChatFormat
from unirl_pl.experts.llm import CausalLMExpert
from unirl_pl.loops import ARDecode, RolloutConfig

MAX_NEW = 8


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_qwen2_chat_lm(tmp_path_factory.mktemp("qwen2_chat"))


def _expert(folder: str, chat: bool) -> CausalLMExpert:
    llm = CausalLMExpert(pretrained_path=folder, chat=ChatFormat() if chat else None)
    llm.build()
    return llm


def _ids(llm: CausalLMExpert, *tokens: str) -> list[int]:
    return [int(i) for i in llm.tokenizer.convert_tokens_to_ids(list(tokens))]


def _second_stop(llm: CausalLMExpert) -> int:
    """Make the tokenizer's EOS a word (as a base tokenizer's EOS would be) and list ``<|im_end|>`` only in
    the generation config, as Qwen2.5-Instruct's generation_config.json lists its stop ids."""
    im_end, word = _ids(llm, "<|im_end|>", "red")
    llm.tokenizer.eos_token = "red"
    llm.model.generation_config.eos_token_id = [word, im_end]
    return im_end


def _force(llm: CausalLMExpert, token: int, at_step: int) -> None:
    """Make the LM emit ``token`` at generated position ``at_step`` (the prefill forward is step 0's)."""
    calls = {"n": 0}

    def hook(module, args, output):
        calls["n"] += 1
        if calls["n"] == at_step + 1:
            output = output.clone()
            output[..., token] += 1e4
        return output

    llm.model.get_output_embeddings().register_forward_hook(hook)


def test_stop_ids_are_the_tokenizer_eos_and_every_generation_config_id(folder):
    llm = _expert(folder, chat=True)
    im_end = _second_stop(llm)
    assert llm.stop_token_ids == sorted({*_ids(llm, "red"), im_end})


@pytest.mark.parametrize("profile", ["serve", "rollout"])
def test_a_generation_config_stop_id_ends_the_refinement(folder, profile):
    llm = _expert(folder, chat=True)
    im_end = _second_stop(llm)
    _force(llm, im_end, at_step=2)
    loop = ARDecode(llm, RolloutConfig(max_new_tokens=MAX_NEW, temperature=1.0))
    texts, record = loop.sample(["a red circle"] * 2, [0, 1], [0, 0], profile, seed=0)
    # Every row drew <|im_end|> at step 2: the loop ended there instead of running to max_new_tokens.
    assert record.gen_mask.shape[1] == 3
    assert record.gen_mask.all(), "the stop token itself is an action the refiner took, so it is trained"
    assert (record.gen_ids[:, 2] == im_end).all()
    assert all("im_end" not in t for t in texts)


def test_an_instruct_reply_is_cut_at_a_turn_marker_that_is_not_a_stop_id(folder):
    llm = _expert(folder, chat=True)
    blue, circle, im_end, left, red = _ids(llm, "blue", "circle", "<|im_end|>", "left", "red")
    # A checkpoint that stops only on its tokenizer's EOS: the end-of-turn marker arrives as a token.
    llm.tokenizer.eos_token = "red"
    llm.model.generation_config.eos_token_id = red
    assert llm.stop_token_ids == [red]
    tokens = torch.tensor([[blue, circle, im_end, left], [blue, left, circle, circle]])
    live = torch.ones_like(tokens, dtype=torch.bool)
    live[1, 3] = False  # after the end: padding, never part of the reply
    assert llm.reply_texts(tokens, live) == ["blue circle", "blue left circle"]


def test_a_base_lm_continuation_is_cut_only_at_stop_ids(folder):
    llm = _expert(folder, chat=False)
    blue, im_start, left, im_end = _ids(llm, "blue", "<|im_start|>", "left", "<|im_end|>")
    assert llm.stop_token_ids == [im_end]
    tokens = torch.tensor([[blue, im_start, left, im_end, blue]])
    # No turns without a chat template: the marker is dropped as a special token, the text runs on to EOS.
    assert llm.reply_texts(tokens, torch.ones_like(tokens, dtype=torch.bool)) == ["blue left"]
