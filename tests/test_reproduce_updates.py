"""Each reference-following overlay and recipe runs its reference's updates per rollout: the "updates per rollout"
row of its docs/reproduce.md section states ``<expert>_loss.mini_batches``, ``mini_batch_split`` and
``drop_zero_advantage``, and ``fit --print_config`` (the overlay on the main recipe) resolves to exactly those."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.helpers import printed_config
from tests.test_reproduce_doc import DOC, ROOT, section_for, table_rows

# What must have the row: every published overlay, the overlays that name their reference's update count, and the
# family recipes that follow Flow-GRPO's and Flow-Factory's trainers.
OVERLAYS = [
    "recipes/algorithms/flow_grpo_published.yaml",
    "recipes/algorithms/flow_grpo_fast_published.yaml",
    "recipes/algorithms/diffusion_nft_published.yaml",
    "recipes/algorithms/dapo_published.yaml",
    "recipes/algorithms/gspo_published.yaml",
    "recipes/algorithms/grpo_guard.yaml",
    "recipes/algorithms/mix_grpo.yaml",
    "recipes/algorithms/mix_grpo_flash.yaml",
    "recipes/overlays/promptrl.yaml",
]
RECIPES = [
    "recipes/sd35.yaml",
    "recipes/sd35_ocr.yaml",
    "recipes/sd35_pickscore.yaml",
    "recipes/sd35_geneval.yaml",
    "recipes/flux.yaml",
    "recipes/wan_t2v.yaml",
    "recipes/wan22_t2v.yaml",
    "recipes/wan22_ti2v.yaml",
    "recipes/zimage.yaml",
    "recipes/zimage_turbo.yaml",
    "recipes/qwenimage.yaml",
    "recipes/qwenimage_edit_plus.yaml",
    "recipes/promptrl_klein.yaml",
    "recipes/promptrl_flux.yaml",
    "recipes/promptrl_kontext.yaml",
]
# A section that lists only what differs from another recipe's takes that one's row ("Everything not listed is as").
AS = {"recipes/promptrl_flux.yaml": "recipes/promptrl_klein.yaml"}
SETTING = re.compile(
    r"`(llm|transformer)_loss\.mini_batches: (\d+)`, `mini_batch_split: (\w+)`(?:, `drop_zero_advantage: (\w+)`)?"
)


def stated(rel: str) -> list[tuple[str, int, str, bool]]:
    """(expert, mini_batches, split, drop) of each expert the section's "updates per rollout" row states ours for."""
    lines = section_for(DOC.read_text(), AS.get(rel, rel))
    assert lines is not None, f"docs/reproduce.md has no section for {rel}"
    rows = [row for row in table_rows(lines) if row.lstrip("| ").startswith("updates per rollout")]
    assert len(rows) == 1, f"{rel}: expected one 'updates per rollout' row, found {len(rows)}"
    found = SETTING.findall(rows[0].split("|")[2])
    assert found, f"{rel}: the row's 'ours' column must name `<expert>_loss.mini_batches: N`, `mini_batch_split: X`"
    return [(expert, int(count), split, drop == "true") for expert, count, split, drop in found]


def resolved(args: list[str]) -> dict[str, Any]:
    return printed_config(*args)["model"]["init_args"]


@pytest.mark.slow
@pytest.mark.parametrize("rel", OVERLAYS + RECIPES)
def test_print_config_resolves_the_updates_per_rollout_its_row_states(rel: str) -> None:
    config = ["--config", str(ROOT / "recipes" / "joint.yaml")] if rel in OVERLAYS else []
    model = resolved([*config, "--config", str(ROOT / rel)])
    for expert, count, split, drop in stated(rel):
        loss = model[f"{expert}_loss"]
        got = (loss["mini_batches"], loss["mini_batch_split"], loss["drop_zero_advantage"])
        assert got == (count, split, drop), (rel, expert)


def test_the_row_pattern_reads_a_row() -> None:
    row = "| updates per rollout | 2 (`transformer_loss.mini_batches: 2`, `mini_batch_split: sample`) | 2 | x | — |"
    assert SETTING.search(row).groups() == ("transformer", "2", "sample", None)
    assert SETTING.search("`llm_loss.mini_batches: 16`, `mini_batch_split: group`, `drop_zero_advantage: true`")
    assert SETTING.search("`mini_batches: 2`") is None
    both = "1 each (`llm_loss.mini_batches: 1`, `mini_batch_split: group`; `transformer_loss.mini_batches: 1`, "
    both += "`mini_batch_split: sample`)"
    assert SETTING.findall(both) == [("llm", "1", "group", ""), ("transformer", "1", "sample", "")]
