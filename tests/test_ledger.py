"""The weight-version ledger gate and the on-policy staleness check, each fired by its fault."""

from types import SimpleNamespace

import pytest
import torch

from unirl_pl.callbacks.ledger import VersionMismatchError, WeightVersionLedger
from unirl_pl.versioning import VersionLedger, check_staleness


def _module(trained=("llm", "transformer")):
    logged = {}
    ledger = VersionLedger(["llm", "transformer", "text_encoder", "vae"])
    module = SimpleNamespace(ledger=ledger, trained=list(trained), device=torch.device("cpu"))
    module.log_dict = lambda metrics, **kw: logged.update(metrics)
    return module, logged


def _trainer(world_size=1, gathered=None):
    strategy = SimpleNamespace(all_gather=lambda t: gathered if gathered is not None else t[None])
    return SimpleNamespace(world_size=world_size, strategy=strategy)


def test_ledger_passes_a_clean_step():
    module, _ = _module()
    module.ledger.bump("llm")
    module.ledger.bump("transformer")
    WeightVersionLedger().on_train_batch_end(_trainer(), module, None, None, 0)


def test_ledger_fires_when_ranks_disagree():
    module, _ = _module()
    module.ledger.bump("llm")
    other_rank = torch.tensor([[1, 0, 0, 0], [2, 0, 0, 0]])  # rank 1 stepped the LM twice
    with pytest.raises(VersionMismatchError, match="ranks disagree"):
        WeightVersionLedger().on_train_batch_end(_trainer(2, other_rank), module, None, None, 0)


def test_ledger_fires_when_a_frozen_component_moves():
    module, _ = _module(trained=("llm",))
    module.ledger.bump("transformer")
    with pytest.raises(VersionMismatchError, match="frozen component 'transformer'"):
        WeightVersionLedger().on_train_batch_end(_trainer(), module, None, None, 0)


def test_training_on_a_stale_record_is_an_error_or_logged():
    ledger = VersionLedger(["llm", "transformer"])
    ledger.bump("llm")
    records = {"ar_decode": SimpleNamespace(version=0), "diffusion_denoise": SimpleNamespace(version=0)}
    owners = {"ar_decode": "llm", "diffusion_denoise": "transformer"}
    with pytest.raises(RuntimeError, match="off-policy batch: the llm record was produced by version 0"):
        check_staleness(records, owners, ledger, "error")
    assert check_staleness(records, owners, ledger, "log") == {"llm": 1.0, "transformer": 0.0}
