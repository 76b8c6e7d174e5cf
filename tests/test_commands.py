"""One command line: ``python -m unirl_pl --help`` lists every subcommand; the tools run through it; no notices."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from tests.helpers import ROOT, subprocess_env
from unirl_pl.commands import TOOLS, overview, run_before_lightning, subcommands

EVERY = ("fit", "validate", "predict", "ablate", "bench", "export", "plan", "rewards", "serve-reward")


@pytest.mark.integration
def test_help_lists_every_subcommand_fast():
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "unirl_pl", "--help"],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    usage, listed = (
        proc.stdout.splitlines()[0],
        [line.split()[0] for line in proc.stdout.splitlines() if line[:2] == "  "],
    )
    assert usage == f"usage: python -m unirl_pl {{{','.join(EVERY)}}} ..."
    assert tuple(listed) == EVERY
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert not imported & {"torch", "lightning", "transformers"}, "the overview loads no framework"
    assert "torchvision" not in proc.stderr.replace("import time", "")


def test_every_subcommand_is_in_the_overview():
    assert tuple(subcommands()) == EVERY
    text = overview()
    assert all(f"\n  {name} " in text for name in EVERY)


# `plan` is left out: importing it takes seconds, and tests/test_plan.py runs it through the command.
@pytest.mark.parametrize("tool", sorted(set(TOOLS) - {"plan"}))
def test_each_tool_runs_through_the_command(tool, capsys):
    with pytest.raises(SystemExit) as stop:  # argparse's --help exits 0 after printing the tool's usage
        run_before_lightning([tool, "--help"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.startswith("usage: ")


def test_lightning_subcommands_are_left_to_lightning():
    assert run_before_lightning(["fit", "--config", "x.yaml"]) is None
    assert run_before_lightning([]) is None


def test_a_tools_return_value_becomes_its_exit_status(monkeypatch):
    import unirl_pl.export

    monkeypatch.setattr(unirl_pl.export, "main", lambda argv: {"llm": "paths"})
    assert run_before_lightning(["export"]) == 0
    monkeypatch.setattr(unirl_pl.export, "main", lambda argv: 3)
    assert run_before_lightning(["export"]) == 3


def test_transformers_torchvision_notice_is_dropped_and_others_pass():
    logger = logging.getLogger("transformers.utils.import_utils")

    def record(message: str) -> logging.LogRecord:
        return logger.makeRecord(logger.name, logging.WARNING, __file__, 1, message, None, None)

    notice = (
        "`CLIPImageProcessor` requires torchvision (not installed); falling back to `CLIPImageProcessorPil` for "
        "backward compatibility."
    )
    assert not logger.filter(record(notice))
    assert logger.filter(record("something else went wrong"))


def test_library_warnings_about_what_we_do_on_purpose_are_dropped_and_others_pass():
    import warnings

    from unirl_pl.cli import quiet_library_warnings

    dropped = [
        ("`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec)`", FutureWarning),
        ("Found 230 module(s) in eval mode at the start of training.", UserWarning),
    ]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_library_warnings()
        for message, category in dropped:
            warnings.warn(message, category, stacklevel=1)
        warnings.warn("something else is deprecated", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["something else is deprecated"]
