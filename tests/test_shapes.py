"""ShapesWorld: grammar round trips, paraphrase splits, verifier accuracy and faults, and the reward."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from unirl_pl.rewards import resolve_reward
from unirl_pl.rewards.shapes import ShapesGenEval, shapes_geneval
from unirl_pl.shapes import (
    CATEGORIES,
    COLORS,
    PALETTE,
    SHAPES,
    SHAPES_WORDS,
    ObjectSpec,
    SceneSpec,
    all_specs,
    canonical_of,
    caption,
    make_prompt_set,
    paraphrase,
    parse_caption,
    read_jsonl,
    render,
    render_batch,
    sample_scene,
    tokenize_words,
    verify,
    write_jsonl,
)
from unirl_pl.shapes import prompts as P
from unirl_pl.shapes.render import Placement, draw
from unirl_pl.shapes.scenes import requested_objects

OPPOSITE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}


def _scenes(n_per_category: int, seed: int) -> list[SceneSpec]:
    rng = np.random.default_rng(seed)
    return [sample_scene(rng, cat) for _ in range(n_per_category) for cat in CATEGORIES]


def _blur3(image: np.ndarray) -> np.ndarray:
    h, w = image.shape[:2]
    padded = np.pad(image, ((1, 1), (1, 1), (0, 0)), mode="edge")
    return sum(padded[i : i + h, j : j + w] for i in range(3) for j in range(3)) / 9.0


def _accuracy(specs: list[SceneSpec], images: np.ndarray) -> float:
    return float(np.mean([verify(s, img).strict for s, img in zip(specs, images, strict=True)]))


# ---------------------------------------------------------------- grammar


def test_caption_parse_round_trip_every_spec() -> None:
    specs = all_specs()
    assert {s.category for s in specs} == set(CATEGORIES)
    for spec in specs:
        text = caption(spec)
        assert parse_caption(text) == spec, text
        assert canonical_of(text) == text


@pytest.mark.parametrize(
    ("text", "category"),
    [
        ("a circle", "single_object"),
        ("a red circle", "colors"),
        ("three blue squares", "counting"),
        ("a circle and a square", "two_object"),
        ("a red circle and a green square", "color_attr"),
        ("a blue square left of a yellow triangle", "position"),
    ],
)
def test_caption_examples(text: str, category: str) -> None:
    spec = parse_caption(text)
    assert spec.category == category
    assert caption(spec) == text


@pytest.mark.parametrize(
    "text",
    [
        "",
        "a",
        "a red",
        "two red circle",
        "a red circles",
        "a red circle and",
        "a circle and a red square",
        "a circle and a circle",
        "a red circle and a red square",
        "a circle left of a square",
        "four red circles",
        "a red circle near a blue square",
        "a red circle left of a red circle",
    ],
)
def test_parse_caption_rejects_malformed(text: str) -> None:
    with pytest.raises(ValueError, match="cannot parse caption"):
        parse_caption(text)


def test_scene_spec_validates_category() -> None:
    with pytest.raises(ValueError, match="counting"):
        SceneSpec((ObjectSpec("red", "circle", 1),), None, "counting")
    with pytest.raises(ValueError, match="relation"):
        SceneSpec((ObjectSpec("red", "circle"), ObjectSpec("blue", "square")), None, "position")
    with pytest.raises(ValueError, match="unknown color"):
        ObjectSpec("orange", "circle")


def test_sample_scene_deterministic_and_covers_categories() -> None:
    rng_a, rng_b = np.random.default_rng(3), np.random.default_rng(3)
    assert [sample_scene(rng_a) for _ in range(50)] == [sample_scene(rng_b) for _ in range(50)]
    rng = np.random.default_rng(0)
    assert {sample_scene(rng).category for _ in range(300)} == set(CATEGORIES)


# ---------------------------------------------------------------- prompts


@pytest.mark.parametrize("split", ["train", "composition", "vocabulary", "canonical"])
def test_canonical_of_inverts_paraphrases(split: str) -> None:
    rows = make_prompt_set(600, seed=11, split=split)
    assert [r["category"] for r in rows[:6]] == list(CATEGORIES)
    for row in rows:
        assert canonical_of(row["prompt"]) == row["caption"], row
        assert parse_caption(row["caption"]).category == row["category"]


def test_canonical_of_names_unparseable_prompt() -> None:
    with pytest.raises(ValueError, match="a red elephant"):
        canonical_of("a red elephant")


def _heldout_phrases() -> set[tuple[str, ...]]:
    phrases: set[str] = set()
    for table in (P.COLOR_SYNONYMS, P.QUANTITY_SYNONYMS, P.RELATION_SYNONYMS):
        for _, heldout in table.values():
            phrases.update(heldout)
    for _, heldout in P.SHAPE_SYNONYMS.values():
        phrases.update(w for pair in heldout for w in pair)
    phrases.update(P.CONJUNCTIONS[1])
    for template in P.TEMPLATES[1]:
        phrases.update(part for part in template.split("{x}") if part.strip(" ,"))
    return {tuple(tokenize_words(p)) for p in phrases}


def _contains(words: list[str], phrase: tuple[str, ...]) -> bool:
    n = len(phrase)
    return any(tuple(words[i : i + n]) == phrase for i in range(len(words) - n + 1))


def test_heldout_phrasings_never_appear_in_train() -> None:
    heldout = _heldout_phrases()
    train_prompts = [tokenize_words(r["prompt"]) for r in make_prompt_set(1500, seed=5, split="train")]
    for words in train_prompts:
        assert not any(_contains(words, p) for p in heldout), " ".join(words)
    # Held-out templates are never used for train, and every held-out prompt uses one.
    templates = {tuple(tokenize_words(part)) for t in P.TEMPLATES[1] for part in t.split("{x}") if part.strip(" ,")}
    for row in make_prompt_set(300, seed=5, split="vocabulary"):
        assert any(_contains(tokenize_words(row["prompt"]), t) for t in templates), row


def test_composition_split_holds_out_compositions_not_words() -> None:
    train = make_prompt_set(2000, seed=5, split="train")
    composition = make_prompt_set(600, seed=5, split="composition")
    train_words = {w for r in train for w in tokenize_words(r["prompt"])}
    # Every word of a composition prompt occurs in train prompts; only the combination is new.
    assert {w for r in composition for w in tokenize_words(r["prompt"])} <= train_words
    heldout = _heldout_phrases()
    for row in composition:
        assert not any(_contains(tokenize_words(row["prompt"]), p) for p in heldout), row
    train_captions = {r["caption"] for r in train}
    for rows, held in ((train, False), (composition, True)):
        for row in rows:
            spec = parse_caption(row["caption"])
            if spec.category != "single_object":
                assert P.is_heldout_composition(spec) == held, row
    # Held-out compositions are scenes no train prompt asks for; single-object scenes are shared.
    new = {r["caption"] for r in composition if r["category"] != "single_object"}
    assert new and not new & train_captions
    # The composition templates are new: no train prompt is wrapped in one.
    for row in train:
        assert not any(
            row["prompt"].startswith(t.split("{x}")[0]) and row["prompt"].endswith(t.split("{x}")[1])
            for t in P.COMPOSITION_TEMPLATES
            if t.split("{x}")[0] and t.split("{x}")[1]
        ), row


def test_every_color_and_shape_stays_in_training_and_the_vocabulary_split_is_held_out_too() -> None:
    bindings = P.HELDOUT_BINDINGS
    assert {c for c, _ in bindings} == set(COLORS) and len(bindings) == len(COLORS)
    assert all(sum(s == shape for _, s in bindings) == 2 for shape in SHAPES)
    for row in make_prompt_set(300, seed=3, split="vocabulary"):
        spec = parse_caption(row["caption"])
        assert spec.category == "single_object" or P.is_heldout_composition(spec), row
    assert P.is_heldout_composition(parse_caption("a red triangle left of a blue circle"))
    assert not P.is_heldout_composition(parse_caption("a red circle left of a blue triangle"))
    assert P.is_heldout_composition(parse_caption("a triangle and a circle"))
    assert not P.is_heldout_composition(parse_caption("a square and a circle"))
    with pytest.raises(ValueError, match="split"):
        P.sample_split_scene(np.random.default_rng(0), "colors", "heldout")


def test_shipped_prompt_files_are_regenerated_exactly(tmp_path) -> None:
    shipped = Path(P.__file__).resolve().parents[1] / "assets" / "shapes"
    for path in P.write_prompt_files(tmp_path):
        assert path.read_text() == (shipped / path.name).read_text(), path.name


def test_words_are_covered_and_lowercase() -> None:
    assert all(re.fullmatch(r"[a-z]+|,", w) for w in SHAPES_WORDS)
    vocab = set(SHAPES_WORDS)
    for split in ("train", "composition", "vocabulary"):
        for row in make_prompt_set(600, seed=2, split=split):
            assert set(tokenize_words(row["prompt"])) <= vocab, row["prompt"]
            assert set(tokenize_words(row["caption"])) <= vocab


def test_prompt_set_deterministic_and_jsonl(tmp_path) -> None:
    rows = make_prompt_set(24, seed=9, split="vocabulary")
    assert rows == make_prompt_set(24, seed=9, split="vocabulary")
    assert rows != make_prompt_set(24, seed=10, split="vocabulary")
    path = tmp_path / "sub" / "prompts.jsonl"
    write_jsonl(rows, path)
    assert read_jsonl(path) == rows
    with pytest.raises(ValueError, match="split"):
        paraphrase(parse_caption("a circle"), np.random.default_rng(0), "test")


# ---------------------------------------------------------------- renderer and verifier


def test_slot_layout_centers_objects_in_distinct_cells_and_keeps_relations() -> None:
    from unirl_pl.shapes.render import layout

    rng = np.random.default_rng(0)
    cells = set()
    for _ in range(300):
        spec = sample_scene(rng)
        boxes = layout(spec, rng, slots=2)
        assert len({(b.x0, b.y0) for b in boxes}) == len(boxes), "one object per cell"
        for box in boxes:
            assert box.side == 12 and box.x0 % 16 == 2 and box.y0 % 16 == 2, box
            cells.add((box.x0 // 16, box.y0 // 16))
        image = render_batch([spec], seed=int(rng.integers(1000)), slots=2)[0]
        assert verify(spec, image).strict, spec
    assert cells == {(0, 0), (0, 1), (1, 0), (1, 1)}
    with pytest.raises(ValueError, match="do not fit"):
        layout(parse_caption("three red circles"), rng, slots=1)


def test_render_is_deterministic_crisp_and_black() -> None:
    specs = _scenes(4, seed=1)
    a = render_batch(specs, seed=7)
    assert a.shape == (len(specs), 32, 32, 3) and a.dtype == np.uint8
    assert np.array_equal(a, render_batch(specs, seed=7))
    # Image i depends only on (seed, i, spec), so a prefix renders identically.
    assert np.array_equal(render_batch(specs[:3], seed=7), a[:3])
    colors = {tuple(int(v) for v in px) for px in a.reshape(-1, 3)}
    assert colors <= {(0, 0, 0), *PALETTE.values()}, "no anti-aliasing: only palette colors and black"
    assert (0, 0, 0) in colors


@pytest.mark.slow
def test_verifier_accuracy_clean_noisy_blurred() -> None:
    specs = _scenes(200, seed=123)  # 1200 scenes, 200 per category
    images = render_batch(specs, seed=123).astype(np.float32) / 255.0
    clean = _accuracy(specs, images)
    rng = np.random.default_rng(0)
    noisy = _accuracy(specs, np.clip(images + rng.normal(0.0, 0.05, images.shape), 0.0, 1.0))
    blurred_images = np.stack([_blur3(img) for img in images])
    blurred = _accuracy(specs, blurred_images)
    both = _accuracy(specs, np.clip(blurred_images + rng.normal(0.0, 0.05, images.shape), 0.0, 1.0))
    print(f"verifier strict acc, {len(specs)} scenes: clean {clean:.4f} noisy {noisy:.4f} blur {blurred:.4f}")
    print(f"verifier strict acc, blur then noise: {both:.4f}")
    assert clean >= 0.99
    assert noisy >= 0.95
    assert blurred >= 0.95
    assert both >= 0.95


def _faults(spec: SceneSpec) -> dict[str, SceneSpec]:
    """Wrongly rendered variants of ``spec``: each is a valid scene that should fail ``spec``."""
    out: dict[str, SceneSpec] = {}
    first, rest = spec.objects[0], spec.objects[1:]

    def variant(name: str, obj: ObjectSpec, category: str | None = None, relation: str | None = spec.relation) -> None:
        try:
            out[name] = SceneSpec((obj, *rest), relation, category or spec.category)
        except ValueError:
            pass

    if first.color is not None:
        for color in COLORS:
            if color != first.color and "color" not in out:
                variant("color", dataclasses.replace(first, color=color))
    for shape in SHAPES:
        if shape != first.shape and "shape" not in out:
            variant("shape", dataclasses.replace(first, shape=shape))
    if spec.category == "counting":
        wrong = 3 if first.count == 2 else 2
        variant("count", dataclasses.replace(first, count=wrong))
        variant("count_one", dataclasses.replace(first, count=1), category="colors")
    if spec.relation is not None:
        out["position"] = dataclasses.replace(spec, relation=OPPOSITE[spec.relation])
    return out


def test_verifier_rejects_faults() -> None:
    rng = np.random.default_rng(4)
    seen: set[str] = set()
    for spec in _scenes(15, seed=99):
        for name, wrong in _faults(spec).items():
            verdict = verify(spec, render(wrong, rng))
            assert not verdict.strict and verdict.soft < 1.0, (name, caption(spec), caption(wrong), verdict)
            seen.add(name)
    assert seen == {"color", "shape", "count", "count_one", "position"}


def test_verifier_ignores_unmentioned_objects() -> None:
    rng = np.random.default_rng(0)
    for spec in _scenes(10, seed=8):
        if spec.category != "color_attr":
            continue
        image = render(spec, rng)
        # GenEval semantics: the second object is a distractor for a prompt naming only the first.
        only_first = SceneSpec((spec.objects[0],), None, "colors")
        assert verify(only_first, image).strict
    # Counting needs the exact number of the named kind only: other colors and shapes are ignored.
    image = draw(
        [
            Placement("red", "circle", 2, 2, 9),
            Placement("red", "circle", 20, 2, 9),
            Placement("blue", "circle", 2, 20, 9),
            Placement("red", "square", 20, 20, 9),
        ]
    )
    assert verify(parse_caption("two red circles"), image).strict
    assert not verify(parse_caption("three red circles"), image).strict


def test_penalize_extra_fails_a_scene_with_an_object_it_does_not_name() -> None:
    spec = parse_caption("a red circle")
    two = draw([Placement("red", "circle", 2, 2, 9), Placement("red", "circle", 20, 20, 9)])
    one = draw([Placement("red", "circle", 2, 2, 9)])
    # GenEval semantics (the default): a second copy is ignored, so asking for one cannot hurt.
    assert verify(spec, two).strict and "scene/no_extra" not in verify(spec, two).constraints
    extra = verify(spec, two, penalize_extra=True)
    assert not extra.strict and extra.constraints["scene/no_extra"] is False
    assert extra.soft == pytest.approx(3 / 4)  # color, shape and exists hold; no_extra does not
    assert verify(spec, one, penalize_extra=True).strict
    # Counting: exactly the named objects pass; one more of another kind fails only with the penalty.
    pair = [Placement("red", "circle", 2, 2, 9), Placement("red", "circle", 20, 2, 9)]
    assert verify(parse_caption("two red circles"), draw(pair), penalize_extra=True).strict
    crowded = draw([*pair, Placement("blue", "square", 2, 20, 9)])
    assert verify(parse_caption("two red circles"), crowded).strict
    assert not verify(parse_caption("two red circles"), crowded, penalize_extra=True).strict
    # Through the reward, as a recipe sets it: model.reward_args: {shapes_geneval: {penalize_extra: true}}.
    images = torch.from_numpy(np.stack([two, one])).permute(0, 3, 1, 2).float() / 255
    prompts = ["a red circle", "a red circle"]
    assert resolve_reward("shapes_geneval", {"penalize_extra": True})(prompts, prompts, images) == [0.75, 1.0]
    assert resolve_reward("shapes_geneval")(prompts, prompts, images) == [1.0, 1.0]
    strict_breakdown = ShapesGenEval(penalize_extra=True).breakdown(prompts, images)
    assert strict_breakdown["strict/overall"] == (0.5, 2)


def test_requested_objects_counts_the_shape_nouns_a_caption_asks_for() -> None:
    assert requested_objects("a circle") == 1
    assert requested_objects("a circle below a circle") == 2
    assert requested_objects("three red squares") == 3 and requested_objects("two circles") == 2
    assert requested_objects("a red circle and a blue square") == 2
    assert requested_objects("squares") == 2  # a plural without a count word asks for at least two
    # A user's synonyms are not canonical shape nouns: raw prompts ask for nothing countable.
    assert requested_objects("please draw two discs") == 0


def test_penalize_requested_extra_zeroes_a_rewrite_asking_for_more_than_the_user() -> None:
    one = draw([Placement("red", "circle", 2, 2, 9)])
    two = draw([Placement("red", "circle", 2, 2, 9), Placement("red", "circle", 20, 20, 9)])
    images = torch.from_numpy(np.stack([one, two, two, one])).permute(0, 3, 1, 2).float() / 255
    prompts = ["one crimson disc"] * 4
    refined = ["a red circle", "a red circle and a red circle", "a red circle", "one crimson disc"]
    plain = resolve_reward("shapes_geneval")(prompts, refined, images)
    assert plain == [1.0, 1.0, 1.0, 1.0]  # GenEval semantics: the doubled rewrite costs nothing
    guarded = resolve_reward("shapes_geneval", {"penalize_requested_extra": True})
    # Only the rewrite that asked for a second circle loses its reward; the DiT's stray copy (row 2, an
    # honest rewrite) and the unrefined prompt (row 3) keep theirs.
    assert guarded(prompts, refined, images) == [1.0, 0.0, 1.0, 1.0]
    assert ShapesGenEval("strict", penalize_requested_extra=True)(prompts, refined, images) == [1.0, 0.0, 1.0, 1.0]
    # Counting: asking for exactly the named count is not an extra.
    three, red = ["three red circles"], images[1:2]  # two red circles: soft 2/3, whatever the rewrite
    assert guarded(three, ["three red circles"], red) == resolve_reward("shapes_geneval")(three, three, red)
    assert guarded(three, ["three red circles"], red)[0] > 0
    assert guarded(three, ["three red circles and a circle"], red) == [0.0]
    # Validation's breakdown has no refined prompts: it stays the image check.
    guarded_term = ShapesGenEval(penalize_requested_extra=True)
    assert guarded_term.breakdown(prompts, images) == ShapesGenEval().breakdown(prompts, images)


def test_verifier_rejects_turned_triangle_and_black() -> None:
    spec = parse_caption("a red triangle")
    image = render(spec, np.random.default_rng(0))
    assert verify(spec, image).strict
    flipped = verify(spec, np.flipud(image))
    assert not flipped.constraints["red triangle/shape"]
    black = verify(spec, np.zeros((32, 32, 3), dtype=np.uint8))
    assert black.soft == 0.0 and not black.strict


# ---------------------------------------------------------------- reward


def _to_tensor(images: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255.0


@pytest.mark.parametrize("split", ["train", "composition", "vocabulary"])
def test_reward_scores_ground_truth_one(split: str) -> None:
    rows = make_prompt_set(60, seed=3, split=split)
    prompts = [r["prompt"] for r in rows]
    images = _to_tensor(render_batch([parse_caption(r["caption"]) for r in rows], seed=1))
    refined = ["a red circle"] * len(prompts)  # must be ignored: scoring uses the original prompt
    rewards = shapes_geneval(prompts, refined, images)
    assert len(rewards) == len(prompts) and all(isinstance(r, float) for r in rewards)
    assert rewards == [1.0] * len(prompts)
    assert ShapesGenEval("strict")(prompts, refined, images) == [1.0] * len(prompts)
    metrics = ShapesGenEval().per_category(prompts, images)
    assert set(metrics) == {f"{s}/{c}" for s in ("strict", "soft") for c in (*CATEGORIES, "overall")}
    assert all(v == 1.0 for v in metrics.values())


def test_reward_range_and_refusals() -> None:
    rows = make_prompt_set(30, seed=4, split="train")
    prompts = [r["prompt"] for r in rows]
    images = torch.rand(len(prompts), 3, 32, 32)
    images[::2] = 0.0
    for score in ("soft", "strict"):
        rewards = ShapesGenEval(score)(prompts, prompts, images)
        assert len(rewards) == len(prompts)
        assert all(0.0 <= r <= 1.0 for r in rewards)
        assert all(r == 0.0 for r in rewards[::2])
    with pytest.raises(ValueError, match="images for"):
        shapes_geneval(prompts, prompts, images[:-1])
    with pytest.raises(ValueError, match="refined prompts"):
        shapes_geneval(prompts, prompts[:-1], images)
    with pytest.raises(ValueError, match="score"):
        ShapesGenEval("mean")
    with pytest.raises(ValueError, match="elephant"):
        shapes_geneval(["a red elephant"], ["x"], torch.zeros(1, 3, 32, 32))
