"""AdapterOff: one expert's adapter zeroed after the checkpoint loads, the other's kept; refused in fit."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import TINY
from unirl_pl.callbacks import AdapterOff
from unirl_pl.cli import main


def _lora_b(expert: torch.nn.Module) -> list[torch.Tensor]:
    return [p for n, p in expert.named_parameters() if "lora_B" in n]


@pytest.fixture(scope="module")
def built():
    cli = main(["--config", TINY, "--trainer.logger=false"], run=False)
    cli.model.configure_model()
    return cli.model


@pytest.fixture
def trained(built):
    """The tiny recipe's model with every LoRA B non-zero, as after training (refilled for each test)."""
    with torch.no_grad():
        for expert in built.experts().values():
            for p in _lora_b(expert):
                p.fill_(0.01)
    return built


def test_switch_off_zeroes_only_the_named_experts_adapter(trained):
    zeroed = AdapterOff(["transformer"]).switch_off(trained)
    dit, llm = _lora_b(trained.experts()["transformer"]), _lora_b(trained.experts()["llm"])
    assert zeroed == len(dit) > 0
    assert all(torch.count_nonzero(p) == 0 for p in dit)
    assert all(torch.all(p == 0.01) for p in llm), "the refiner keeps what it learned"


def test_validation_start_switches_off_and_misuse_is_refused(trained):
    AdapterOff(["llm"]).on_validation_start(None, trained)
    assert all(torch.count_nonzero(p) == 0 for p in _lora_b(trained.experts()["llm"]))
    with pytest.raises(ValueError, match="no expert"):
        AdapterOff(["refiner"]).switch_off(trained)
    with pytest.raises(ValueError, match="not for fit"):
        AdapterOff(["llm"]).setup(None, trained, "fit")
    with pytest.raises(ValueError, match="at least one"):
        AdapterOff([])
