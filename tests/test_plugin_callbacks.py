"""The plugin folder ``callbacks/``: the example check, built the ways ``callbacks/README.md`` shows.

The README's recipe block and its command line are parsed by the real CLI (``run=False``: built, not
fitted; ``tests/test_components.py`` fits with it), and the check's hook is run on hand-made batches.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from callbacks.reward_range import RewardRangeCheck
from tests.helpers import ROOT, TINY
from unirl_pl.cli import main

README = ROOT / "callbacks" / "README.md"


def _build(tmp_path: Path, *args: str):
    base = ["--config", TINY, "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}"]
    return main([*base, *args], run=False)


def _checks(cli) -> list[RewardRangeCheck]:
    # By name: the CLI imports `callbacks.reward_range` itself, the same module object as this file's import.
    return [c for c in cli.trainer.callbacks if type(c).__name__ == "RewardRangeCheck"]


def test_the_readme_recipe_block_builds_the_check(tmp_path):
    block = re.search(r"```yaml\n(.*?)```", README.read_text(), re.S)
    assert block, "callbacks/README.md lost its recipe example"
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text(block.group(1))
    cli = _build(tmp_path, "--config", str(overlay))
    (check,) = _checks(cli)
    assert isinstance(check, RewardRangeCheck) and (check.low, check.high) == (0.0, 1.0)
    # As the README says: an overlay's callbacks list replaces the recipe's (tiny.yaml has a progress bar).
    assert not any(type(c).__name__ == "RLProgressBar" for c in cli.trainer.callbacks)


def test_the_readme_command_line_adds_the_check_to_the_recipes(tmp_path):
    command = re.search(r"```bash\n(.*?)```", README.read_text(), re.S).group(1)
    args = [a for a in command.replace("\\\n", " ").split() if a.startswith("--trainer.callbacks")]
    assert args == [
        "--trainer.callbacks+=callbacks.reward_range.RewardRangeCheck",
        "--trainer.callbacks.low=0.0",
        "--trainer.callbacks.high=1.0",
    ]
    cli = _build(tmp_path, *args[:1], "--trainer.callbacks.low=-1", "--trainer.callbacks.high=2")
    (check,) = _checks(cli)
    assert (check.low, check.high) == (-1.0, 2.0)
    assert any(type(c).__name__ == "RLProgressBar" for c in cli.trainer.callbacks), "the recipe's are kept"


def _batch(*rewards: float, dropped: int = 0) -> SimpleNamespace:
    values = torch.tensor(rewards)
    return SimpleNamespace(rewards=values, prompts=[f"p{i}" for i in range(len(values))], dropped=dropped)


def test_the_check_stops_at_a_reward_outside_its_range():
    check = RewardRangeCheck(low=0.0, high=1.0)
    check.on_train_batch_start(None, None, _batch(0.0, 0.5, 1.0), 0)
    with pytest.raises(ValueError, match=r"reward 1\.5 of sample 1 \(prompt 'p1'\) is outside \[0\.0, 1\.0\]"):
        check.on_train_batch_start(None, None, _batch(0.2, 1.5), 1)
    with pytest.raises(ValueError, match="sample 0"):
        check.on_train_batch_start(None, None, _batch(-0.1), 2)
    assert check.checked == 1


def test_the_check_leaves_dropped_samples_and_other_batches_alone():
    check = RewardRangeCheck(low=0.0, high=1.0)
    # model.nonfinite_rewards=drop: the module set the dropped sample's total to NaN on purpose.
    check.on_train_batch_start(None, None, _batch(0.5, float("nan"), dropped=1), 0)
    check.on_train_batch_start(None, None, SimpleNamespace(prompts=["p"]), 1)  # no rewards: not an RL batch
    assert check.checked == 1
    with pytest.raises(ValueError, match="low"):
        RewardRangeCheck(low=1.0, high=0.0)
