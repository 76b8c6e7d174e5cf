"""The ShapesWorld-Edit reward, its validation breakdown, and the shipped editing prompt files it reads rows of."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from unirl_pl.ablate.metrics import metric_order
from unirl_pl.data import PromptDataModule
from unirl_pl.evaluation import validation_keys, validation_scores
from unirl_pl.manifest import ASSETS
from unirl_pl.rewards import REGISTRY, Reward, RewardTerm, ShapesEdit, WeightedSum, resolve_reward
from unirl_pl.rewards.metadata import WithMetadata
from unirl_pl.rewards.shapes_edit import edits_of
from unirl_pl.shapes import (
    EDIT_KINDS,
    edit_of,
    is_heldout_edit,
    make_edit_set,
    parse_instruction,
    render_source,
    render_target,
    verify_edit,
    write_edit_files,
)
from unirl_pl.shapes.render import SLOT_MARGIN
from unirl_pl.shapes.scenes import CATEGORIES

SHIPPED = ASSETS / "shapes_edit"
HOW = r"python -m unirl_pl\.shapes\.edit_files"
# Two rows of every kind (round-robin), in both splits and both placements: the reward must not depend on any.
ROWS = [
    *make_edit_set(10, seed=3, split="train"),
    *make_edit_set(10, seed=4, split="heldout", slots=2),
]


def _tensor(images: list[np.ndarray]) -> torch.Tensor:
    """uint8 HWC renders as the float (N, 3, H, W) batch in [0, 1] a generator hands a reward."""
    return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 255.0


def _targets(rows: list[dict[str, Any]]) -> torch.Tensor:
    return _tensor([render_target(edit_of(row)) for row in rows])


def _sources(rows: list[dict[str, Any]]) -> torch.Tensor:
    return _tensor([render_source(edit_of(row)) for row in rows])


def _mixed(rows: list[dict[str, Any]], edited: Callable[[int], bool]) -> torch.Tensor:
    """Row ``i``'s target where ``edited(i)``, else its source (the unedited image)."""
    return _tensor([(render_target if edited(i) else render_source)(edit_of(row)) for i, row in enumerate(rows)])


def _prompts(rows: list[dict[str, Any]]) -> list[str]:
    return [row["prompt"] for row in rows]


# ------------------------------------------------------------------ the reward
def test_targets_score_one_sources_zero_strict_and_soft_is_the_verifiers_fraction() -> None:
    prompts, targets, sources = _prompts(ROWS), _targets(ROWS), _sources(ROWS)
    strict, soft = ShapesEdit("strict"), ShapesEdit()
    assert {row["kind"] for row in ROWS} == set(EDIT_KINDS)
    for reward in (strict, soft):
        values = reward(prompts, prompts, targets, metadata=ROWS)
        assert values.dtype == torch.float32 and values.shape == (len(ROWS),)
        assert values.tolist() == [1.0] * len(ROWS), reward.score
    assert strict(prompts, prompts, sources, metadata=ROWS).tolist() == [0.0] * len(ROWS)
    # The source keeps every untouched object, so soft credits those and only those: strictly between 0 and 1.
    expected = [verify_edit(edit_of(row), render_source(edit_of(row))).soft for row in ROWS]
    got = soft(prompts, prompts, sources, metadata=ROWS)
    assert torch.allclose(got, torch.tensor(expected)) and all(0 < v < 1 for v in expected)
    with pytest.raises(ValueError, match="score must be one of"):
        ShapesEdit("fraction")


def test_each_image_is_scored_against_its_own_row() -> None:
    prompts = _prompts(ROWS)
    # Alternate targets and sources: a reward that read one row for all, or rows out of order, would not give this.
    mixed = _mixed(ROWS, lambda i: i % 2 == 0)
    assert ShapesEdit("strict")(prompts, prompts, mixed, metadata=ROWS).tolist() == [1.0, 0.0] * (len(ROWS) // 2)
    # Another row's target is not this row's edit.
    shifted = ROWS[1:] + ROWS[:1]
    assert ShapesEdit("strict")(prompts, prompts, _targets(shifted), metadata=ROWS).sum() == 0
    # The prompt text plays no part: the row's placements say what the edit is.
    assert ShapesEdit("strict")(["x"] * len(ROWS), ["y"] * len(ROWS), _targets(ROWS), metadata=ROWS).min() == 1


def test_rows_are_rebuilt_once_whatever_their_field_order_or_other_fields() -> None:
    row = ROWS[0]
    reordered = {key: row[key] for key in reversed(row)} | {"prompt": "another phrasing", "image": "x.png"}
    first, again = edits_of([row, reordered], 2)
    assert first is again and first == edit_of(row)


def test_missing_metadata_is_refused_naming_the_reward_and_the_file_it_needs() -> None:
    prompts, images = _prompts(ROWS[:2]), _targets(ROWS[:2])
    reward = ShapesEdit()
    with pytest.raises(ValueError, match=rf"reward 'shapes_edit' needs .*metadata.*{HOW}"):
        reward(prompts, prompts, images)
    with pytest.raises(ValueError, match=rf"reward 'shapes_edit': sample 1 has no metadata row.*{HOW}"):
        reward(prompts, prompts, images, metadata=[ROWS[0], None])
    bare = {"prompt": ROWS[1]["prompt"], "image": "sources/train_001.png"}
    with pytest.raises(ValueError, match=rf"sample 1's metadata row lacks kind, source_placements.*{HOW}"):
        reward(prompts, prompts, images, metadata=[ROWS[0], bare])
    with pytest.raises(ValueError, match="1 metadata rows for 2 samples"):
        reward(prompts, prompts, images, metadata=ROWS[:1])
    with pytest.raises(ValueError, match=rf"needs .*metadata.*{HOW}"):
        reward.breakdown(prompts, images)
    # A run whose prompt file has no rows: the weighted sum calls the term without metadata, and it says why.
    with pytest.raises(ValueError, match=HOW):
        WeightedSum({"shapes_edit": 1.0})(prompts, prompts, images)


def test_registered_by_name_like_shapes_geneval() -> None:
    assert REGISTRY["shapes_edit"].__name__ == "ShapesEdit" and ShapesEdit.name == "shapes_edit"
    assert resolve_reward("shapes_edit", {"score": "strict"}).score == "strict"
    prompts, images = _prompts(ROWS), _sources(ROWS)
    total, parts = WeightedSum({"shapes_edit": 2.0}, {"shapes_edit": {"score": "strict"}})(
        prompts, prompts, images, metadata=ROWS
    )
    assert total.tolist() == [0.0] * len(ROWS) and set(parts) == {"shapes_edit"}
    total, _ = WeightedSum({"shapes_edit": 2.0})(prompts, prompts, _targets(ROWS), metadata=ROWS)
    assert total.tolist() == [2.0] * len(ROWS)


# ------------------------------------------------------------------ breakdown and validation
def test_breakdown_per_kind_means_and_counts() -> None:
    keys = ShapesEdit.breakdown_keys
    assert keys[:2] == ("strict/recolor", "soft/recolor") and keys[-2:] == ("strict/overall", "soft/overall")
    assert [k.split("/")[1] for k in keys[::2]] == [*EDIT_KINDS, "overall"]
    # Per kind, one row edited right (its target) and one not (its source): strict 0.5 over 4 of each kind.
    images = _mixed(ROWS, lambda i: i % 4 < 2)
    found = ShapesEdit().breakdown(_prompts(ROWS), images, metadata=ROWS)
    assert set(found) == set(keys)
    for kind in EDIT_KINDS:
        assert found[f"strict/{kind}"] == (0.5, 4), kind
        assert 0.5 < found[f"soft/{kind}"][0] < 1 and found[f"soft/{kind}"][1] == 4, kind
    assert found["strict/overall"] == (0.5, len(ROWS))
    only = [row for row in ROWS if row["kind"] == "move"]
    assert set(ShapesEdit().breakdown(_prompts(only), _targets(only), metadata=only)) == {
        "strict/move",
        "soft/move",
        "strict/overall",
        "soft/overall",
    }


class _TextOnlyBreakdown(Reward):
    """A term whose breakdown knows nothing of metadata (as ShapesGenEval's): it must be called as before."""

    name = "plain"
    breakdown_keys = ("strict/overall",)

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def __call__(self, prompts: list[str], refined_prompts: list[str], images: torch.Tensor) -> list[float]:
        return [0.0] * len(prompts)

    def breakdown(self, prompts: list[str], images: torch.Tensor) -> dict[str, tuple[float, int]]:
        self.calls.append((prompts, images))
        return {"strict/overall": (0.0, len(prompts))}


def test_validation_passes_the_batch_metadata_to_a_breakdown_that_declares_it() -> None:
    plain = _TextOnlyBreakdown()
    reward = WeightedSum([RewardTerm(ShapesEdit("strict")), RewardTerm(plain, weight=0.0)])
    assert {f"shapes_edit/{key}" for key in ShapesEdit.breakdown_keys} <= set(validation_keys(reward))
    prompts = _prompts(ROWS)
    images = _mixed(ROWS, lambda i: i % 3 != 0)
    scores, total = validation_scores(WithMetadata(reward, ROWS), prompts, prompts, images)  # type: ignore[arg-type]
    assert set(scores) <= set(validation_keys(reward))
    arrays = images.permute(0, 2, 3, 1).numpy()
    verdicts = [verify_edit(edit_of(row), image) for row, image in zip(ROWS, arrays, strict=True)]
    for kind in EDIT_KINDS:
        strict = [v.strict for v, row in zip(verdicts, ROWS, strict=True) if row["kind"] == kind]
        assert 0 < np.mean(strict) < 1, "a mean of 0 or 1 would hide a mix-up of rows"
        assert scores[f"shapes_edit/strict/{kind}"] == (float(np.mean(strict)), len(strict)), kind
    assert scores["shapes_edit/strict/overall"][0] == pytest.approx(float(total.mean()))
    assert len(plain.calls) == 1 and plain.calls[0][0] == prompts, "a text-only breakdown gets (prompts, images)"
    # No metadata bound (a run on a text prompt file): the edit reward says what it needs, not a TypeError.
    with pytest.raises(ValueError, match=HOW):
        validation_scores(WithMetadata(reward, None), prompts, prompts, images)  # type: ignore[arg-type]


def test_metric_order_puts_overall_then_the_edit_kinds_after_the_shapesworld_terms_order() -> None:
    edit = [
        f"shapes_edit/{s}/{k}"
        for k in ("move", "overall", "add", "remove", "reshape", "recolor")
        for s in ("soft", "strict")
    ]
    scene = [f"shapes_geneval/{s}/{c}" for c in ("position", "overall", "counting") for s in ("soft", "strict")]
    ordered = metric_order(list(reversed(edit + scene)))
    assert ordered[:6] == [
        f"shapes_edit/{s}/{k}" for k in ("overall", "recolor", "reshape") for s in ("strict", "soft")
    ]
    assert ordered[6:12] == [f"shapes_edit/{s}/{k}" for k in ("add", "remove", "move") for s in ("strict", "soft")]
    assert ordered[12:] == [
        f"shapes_geneval/{s}/{c}" for c in ("overall", "counting", "position") for s in ("strict", "soft")
    ]
    assert not set(EDIT_KINDS) & set(CATEGORIES), "one rank serves both vocabularies only while they are disjoint"


# ------------------------------------------------------------------ the written files
@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("shapes_edit")
    assert write_edit_files(out) == {"edits_train.jsonl": 200, "edits_heldout.jsonl": 100}
    return out


def _read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_row_names_its_rendered_source(written: Path) -> None:
    for name, split in (("edits_train.jsonl", "train"), ("edits_heldout.jsonl", "heldout")):
        for i, row in enumerate(_read(written / name)):
            assert list(row)[:2] == ["prompt", "image"] and row["image"] == f"sources/{split}_{i:03d}.png"
            with Image.open(written / row["image"]) as image:
                assert image.format == "PNG" and image.mode == "RGB" and image.size == (32, 32)
                assert not image.info, "no ancillary chunk: the bytes are the pixels'"
                pixels = np.asarray(image)
            edit = edit_of(row)
            assert np.array_equal(pixels, render_source(edit)), row["image"]
            assert edit.composition == (row["kind"], row["color"], row["value"])
            assert parse_instruction(row["prompt"]) == (row["kind"], row["instruction"])
            # slots=2: every object in a cell of the 2x2 grid.
            assert all({p.x0, p.y0} <= {SLOT_MARGIN, 16 + SLOT_MARGIN} for p in (*edit.source, *edit.target))


def test_splits_hold_the_compositions_they_say_balanced_over_kinds(written: Path) -> None:
    train, heldout = _read(written / "edits_train.jsonl"), _read(written / "edits_heldout.jsonl")
    assert not any(is_heldout_edit(r["kind"], r["color"], r["value"]) for r in train)
    assert all(is_heldout_edit(r["kind"], r["color"], r["value"]) for r in heldout)
    assert Counter(r["kind"] for r in train) == dict.fromkeys(EDIT_KINDS, 40)
    assert Counter(r["kind"] for r in heldout) == dict.fromkeys(EDIT_KINDS, 20)
    # Held-out compositions in train words (seed + 1), not in held-out words.
    strip = [{k: v for k, v in r.items() if k != "image"} for r in heldout]
    assert strip == make_edit_set(100, 1, "heldout", phrasing="train", slots=2)
    assert [r["prompt"] for r in strip] != [r["prompt"] for r in make_edit_set(100, 1, "heldout", slots=2)]
    assert [{k: v for k, v in r.items() if k != "image"} for r in train] == make_edit_set(200, 0, "train", slots=2)


def test_the_shipped_files_are_what_the_writer_gives_byte_for_byte(written: Path) -> None:
    files = sorted(p.relative_to(written).as_posix() for p in written.rglob("*") if p.is_file())
    # The folder also holds the edit experts (transformer/, text_encoder/, refiner/, fingerprints.json): the
    # writer's files are the prompt files and every file under sources/.
    ours = [*SHIPPED.glob("*.jsonl"), *(SHIPPED / "sources").rglob("*")]
    shipped = sorted(p.relative_to(SHIPPED).as_posix() for p in ours if p.is_file())
    assert files == shipped and len(files) == 302
    changed = [name for name in files if (written / name).read_bytes() != (SHIPPED / name).read_bytes()]
    assert not changed, f"regenerate: python -m unirl_pl.shapes.edit_files {SHIPPED} (then the manifest): {changed}"


def test_a_smaller_rewrite_drops_its_stale_sources_only(tmp_path: Path) -> None:
    write_edit_files(tmp_path, n_train=4, n_heldout=3)
    (tmp_path / "sources" / "notes.txt").write_text("mine")
    first = (tmp_path / "edits_train.jsonl").read_bytes()
    assert write_edit_files(tmp_path, n_train=2, n_heldout=1) == {"edits_train.jsonl": 2, "edits_heldout.jsonl": 1}
    names = sorted(p.name for p in (tmp_path / "sources").iterdir())
    assert names == ["heldout_000.png", "notes.txt", "train_000.png", "train_001.png"]
    assert first.startswith((tmp_path / "edits_train.jsonl").read_bytes()), "the same seed, the same first rows"


def test_the_shipped_files_load_as_an_editing_run_and_score_through_their_metadata() -> None:
    dm = PromptDataModule(prompts=str(SHIPPED / "edits_train.jsonl"), val_prompts=str(SHIPPED / "edits_heldout.jsonl"))
    assert dm.edits and dm.train_sources is not None and dm.val_sources is not None
    assert len(dm.train_prompts) == len(dm.train_sources) == 200 and len(dm.val_sources) == 100
    assert dm.train_metadata == _read(SHIPPED / "edits_train.jsonl"), "the whole row is each sample's metadata"
    batch = dm.val_dataloader().dataset[0]
    assert batch.metadata == _read(SHIPPED / "edits_heldout.jsonl")[: len(batch.prompts)]
    sources = torch.stack([s.pixels for s in batch.sources])
    for source, row in zip(batch.sources, batch.metadata, strict=True):
        assert source.path.endswith(row["image"])
    strict = ShapesEdit("strict")
    assert strict(batch.prompts, batch.prompts, sources, metadata=batch.metadata).sum() == 0
    targets = _targets(batch.metadata)
    assert strict(batch.prompts, batch.prompts, targets, metadata=batch.metadata).min() == 1
