"""The one LoRA loader (:mod:`unirl_pl.lora`): an adapter that fills the model's adapter exactly loads in place;
one that lacks a LoRA tensor, carries a tensor the adapter has no place for, or holds nothing is refused with
the same message, whichever expert loads it."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path

import pytest
import torch
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file, save_file

from unirl_pl.experts import FlowTransformerExpert, TinyCausalLMExpert
from unirl_pl.lora import LORA_WEIGHTS_FILE, load_lora_file, load_lora_weights, read_lora_file

MISMATCH = "does not match this model's adapter"


def _dit(**kwargs) -> FlowTransformerExpert:
    expert = FlowTransformerExpert(sample_size=8, num_layers=1, **kwargs)
    expert.build()
    return expert


def _lora(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k}


def _saved(tmp_path: Path) -> tuple[FlowTransformerExpert, Path]:
    """A DiT whose LoRA B is nonzero, saved in the pipeline format; the path of its file."""
    expert = _dit()
    with torch.no_grad():
        for name, param in expert.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(3))
    expert.save_adapter(str(tmp_path / "adapter"))
    return expert, tmp_path / "adapter" / LORA_WEIGHTS_FILE


def test_a_matching_adapter_loads_in_place_from_the_folder_or_the_file(tmp_path):
    donor, file = _saved(tmp_path)
    for path in (file.parent, file):
        fresh = _dit()
        load_lora_file(fresh.model, path, "transformer")
        got, want = _lora(fresh.model), _lora(donor.model)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    # The prefix selects the component: the pipeline file's keys all start with "transformer.".
    assert read_lora_file(file, "transformer", "cpu").keys() == get_peft_model_state_dict(donor.model).keys()
    assert read_lora_file(file, "text_encoder", "cpu") == {}


def test_a_missing_lora_tensor_is_refused_with_its_name(tmp_path):
    _, file = _saved(tmp_path)
    weights = read_lora_file(file, "transformer", "cpu")
    dropped = sorted(weights)[0]
    del weights[dropped]
    fresh = _dit()
    with pytest.raises(ValueError, match=MISMATCH) as err:
        load_lora_weights(fresh.model, weights, "somewhere/adapter")
    # The message names the source and the missing key (peft inserts the adapter name into it).
    message = str(err.value)
    assert "'somewhere/adapter'" in message and f"{len(weights)} tensors" in message
    stem = dropped.rsplit(".", 1)[0]  # e.g. transformer_blocks.0.attn.to_k.lora_A
    assert f"missing ['{stem}.default.weight']" in message, message
    assert "unexpected []" in message


def test_an_unexpected_tensor_is_refused_with_its_name(tmp_path):
    _, file = _saved(tmp_path)
    weights = read_lora_file(file, "transformer", "cpu")
    weights["not_a_module.lora_A.weight"] = torch.zeros(8, 4)
    fresh = _dit()
    with pytest.raises(ValueError, match=MISMATCH) as err:
        load_lora_weights(fresh.model, weights, file)
    message = str(err.value)
    assert "missing []" in message and "unexpected ['not_a_module.lora_A" in message, message
    assert repr(str(file)) in message


def test_an_empty_adapter_is_refused(tmp_path):
    _, file = _saved(tmp_path)
    save_file({f"text_encoder.{k}": v for k, v in load_file(str(file)).items()}, str(tmp_path / "other.safetensors"))
    fresh = _dit()
    # No "transformer." key at all: nothing loads, which is an error, not a silent no-op.
    with pytest.raises(ValueError, match=rf"{MISMATCH}: 0 tensors"):
        load_lora_file(fresh.model, tmp_path / "other.safetensors", "transformer")


def test_every_expert_refuses_another_adapter_with_the_same_message(tmp_path):
    # An adapter on fewer target modules lacks LoRA tensors the expert's adapter has.
    _dit(lora_target_modules=["to_q"]).save_adapter(str(tmp_path / "dit"))
    with pytest.raises(ValueError, match=rf"{MISMATCH}: .* missing \['[^']*to_k"):
        _dit().load_adapter(str(tmp_path / "dit"))
    small = TinyCausalLMExpert(hidden_size=32, num_layers=1, lora_target_modules=["q_proj"])
    small.build()
    small.save_adapter(str(tmp_path / "llm"))
    full = TinyCausalLMExpert(hidden_size=32, num_layers=1)
    full.build()
    with pytest.raises(ValueError, match=rf"{MISMATCH}: .* missing \['[^']*k_proj"):
        full.load_adapter(str(tmp_path / "llm"))
