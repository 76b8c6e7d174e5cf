"""Prompt metadata from the prompt file to the reward: a JSONL row's other fields (GenEval's ``tag`` and
``include``) are kept with their prompt through shuffling, rank sharding and evaluation padding; the weighted
reward hands each image its prompt's row, only to terms that declare a ``metadata`` parameter (overlapped remote
terms included); the ``http`` reward sends it as ``"metadata"``; the reference server checks it (400 for a bad
list while a concurrent good request is answered), batches it, passes it only to a reward that declares it and
keeps one failing request from failing its batch-mates; and (slow) a tiny fit with images_per_refinement 2
delivers every image its own prompt's row, in training and in validation."""

from __future__ import annotations

import importlib
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.geneval_server import FakeGenEval, constraint_count, metadata_score
from tests.helpers import ROOT, run_cli
from tests.served_rewards import read_calls
from tests.test_rewards_server import _exchange, _post_bytes, _refused, _request, _together
from unirl_pl.data import PromptDataModule, _FixedPrompts, _PromptStream, load_prompt_records, load_prompts
from unirl_pl.layout import GroupLayout
from unirl_pl.rewards import Brightness, HTTPReward, WeightedSum
from unirl_pl.rewards.http import encode_images
from unirl_pl.rewards.metadata import WithMetadata, accepts_metadata
from unirl_pl.rewards.overlap import decode_while_scoring
from unirl_pl.rewards.server import RewardServer, serve

HERE = "tests.test_prompt_metadata"
EXAMPLE = ROOT / "recipes" / "prompts" / "geneval_example.jsonl"
FAST = {"timeout_s": 10.0, "max_retries": 0}


def _images(n: int, seed: int = 0, size: int = 8) -> torch.Tensor:
    # Exact multiples of 1/255: the PNG round trip loses nothing, so scores compare exactly.
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, size, size), generator=g).float() / 255


def include_count(meta: dict[str, Any] | None) -> float:
    """What IncludeCount scores a sample: its row's object count, -1 without a row."""
    return -1.0 if meta is None else float(len(meta.get("include", [])))


class IncludeCount:
    """A reward that declares ``metadata``: each sample's ``include`` count, after checking the row is its
    prompt's (``row["prompt"] == prompt``). Every call's (prompts, metadata) is kept in ``CALLS``."""

    CALLS: list[tuple[list[str], list[Any] | None]] = []

    def __call__(
        self,
        prompts: list[str],
        refined_prompts: list[str],
        images: torch.Tensor,
        metadata: list[dict[str, Any] | None] | None = None,
    ) -> list[float]:
        IncludeCount.CALLS.append((list(prompts), None if metadata is None else list(metadata)))
        if metadata is None:
            return [-2.0] * len(prompts)
        for prompt, meta in zip(prompts, metadata, strict=True):
            assert meta is None or meta["prompt"] == prompt, (prompt, meta)
        return [include_count(meta) for meta in metadata]


def _recorded() -> list[tuple[list[str], list[Any] | None]]:
    """IncludeCount's calls as kept by the module a dotted reward path imports (pytest may import this file
    under another name, with a class of its own)."""
    return importlib.import_module(HERE).IncludeCount.CALLS


def no_metadata(prompts: list[str], refined_prompts: list[str], images: torch.Tensor) -> list[float]:
    """A reward that never asked for metadata: called with a ``metadata`` keyword it would raise TypeError."""
    return [0.5] * len(prompts)


def _rows(n: int) -> list[dict[str, Any]]:
    return [{"prompt": f"p{i}", "include": [{"class": "cat", "count": 1}] * (i % 3 + 1), "i": i} for i in range(n)]


# ------------------------------------------------------------------ prompt files and batches


def test_jsonl_rows_keep_their_other_fields_and_txt_is_unchanged(tmp_path: Path):
    jsonl = tmp_path / "p.jsonl"
    rows = [{"prompt": " a cat ", "tag": "single_object"}, {"prompt": "a dog"}, {"tag": "counting", "prompt": "two"}]
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    prompts, metadata = load_prompt_records(str(jsonl))
    assert prompts == ["a cat", "a dog", "two"] == load_prompts(str(jsonl))
    assert metadata == [rows[0], None, rows[2]], "the whole row when it says more than its prompt, else None"
    plain = tmp_path / "p.jsonl"
    plain.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    assert load_prompt_records(str(plain)) == (["a", "b"], None), "a prompts-only JSONL has no metadata"
    txt = tmp_path / "p.txt"
    txt.write_text("a red circle\n\n  two cats \n")
    assert load_prompt_records(str(txt)) == (["a red circle", "two cats"], None)
    assert load_prompt_records(["x", "y"]) == (["x", "y"], None)
    assert load_prompt_records(None)[1] is None


def test_the_shipped_geneval_example_is_genevals_format():
    prompts, metadata = load_prompt_records(str(EXAMPLE))
    assert len(prompts) == 12 and metadata is not None
    tags = {meta["tag"] for meta in metadata}
    assert tags == {"single_object", "two_object", "counting", "colors", "position", "color_attr"}
    for prompt, meta in zip(prompts, metadata, strict=True):
        assert meta["prompt"] == prompt and meta["include"], meta
        assert all(isinstance(o["class"], str) and o["count"] >= 1 for o in meta["include"])
        if meta["tag"] == "position":
            assert meta["include"][1]["position"][1] == 0 and "position" not in meta["include"][0]
        if meta["tag"] in ("colors", "color_attr"):
            assert all("color" in o for o in meta["include"])
    assert len({metadata_score(m) for m in metadata}) > 3, "the fake server scores the tags apart"
    assert constraint_count(metadata[4]) == 3  # three apples: the object, its count, the exclude


def test_the_fake_geneval_scorer_refuses_a_row_that_is_not_its_prompt_s():
    prompts, metadata = load_prompt_records(str(EXAMPLE))
    fake = FakeGenEval(str(EXAMPLE))
    images = torch.zeros(3, 3, 4, 4)
    assert fake(prompts[:3], prompts[:3], images, metadata=metadata[:3]) == [metadata_score(m) for m in metadata[:3]]
    with pytest.raises(ValueError, match="2 of 3 samples without their prompt's GenEval row"):
        fake(prompts[:3], prompts[:3], images, metadata=[metadata[0], metadata[2], None])
    assert len(fake.seen) == 6 and len(fake.mismatches) == 2


def test_training_batches_keep_metadata_with_its_prompt_across_epochs_and_ranks():
    rows = _rows(10)
    prompts, metadata = [r["prompt"] for r in rows], list(rows)
    layout = GroupLayout()
    single = iter(_PromptStream(prompts, 4, 3, 0, 1, 0, layout, metadata))
    ranks = [iter(_PromptStream(prompts, 4, 3, r, 2, 0, layout, metadata)) for r in range(2)]
    orders = set()
    for _ in range(8):  # 32 draws of 10 prompts: several reshuffled epochs
        whole = next(single)
        assert whole.metadata is not None
        assert [m["prompt"] for m in whole.metadata] == whole.prompts
        shards = [next(r) for r in ranks]
        assert [p for s in shards for p in s.prompts] == whole.prompts, "the ranks split the one-process batch"
        assert [m for s in shards for m in s.metadata] == whole.metadata
        orders.add(tuple(whole.prompts))
    assert len(orders) > 1
    assert next(iter(_PromptStream(prompts, 4, 3, 0, 1, 0, layout))).metadata is None


def test_evaluation_shards_keep_metadata_with_padding_and_copies(tmp_path: Path):
    rows = _rows(5)
    jsonl = tmp_path / "val.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for rank in range(2):
        shard = _FixedPrompts([r["prompt"] for r in rows], 2, rank, 2, 0, rows)
        for i in range(len(shard)):
            batch = shard[i]
            assert [m["prompt"] for m in batch.metadata] == batch.prompts  # padding repeats a prompt and its row
    dm = PromptDataModule(prompts=str(jsonl), val_prompts=str(jsonl), val_images_per_prompt=2, val_batch_size=4)
    batches = list(dm.val_dataloader())
    assert sum(b.real for b in batches) == 10
    for batch in batches:
        assert [m["prompt"] for m in batch.metadata] == batch.prompts
    first = next(iter(dm.train_dataloader()))
    assert [m["prompt"] for m in first.metadata] == first.prompts
    assert next(iter(PromptDataModule().train_dataloader())).metadata is None


# ------------------------------------------------------------------ the weighted reward


def test_metadata_goes_only_to_terms_that_declare_it_each_image_its_own():
    _recorded().clear()
    reward = WeightedSum({f"{HERE}.IncludeCount": 1.0, f"{HERE}.no_metadata": 1.0, "brightness": 0.0})
    assert [reward.wants_metadata(n) for n in reward.terms] == [True, False, False]
    assert accepts_metadata(reward) and accepts_metadata(HTTPReward("http://127.0.0.1:1/"))
    assert not accepts_metadata(Brightness()) and not accepts_metadata(lambda p, r, i, **kw: [])
    rows = _rows(3)
    metadata = [rows[0], rows[0], rows[1], None, rows[2], rows[2]]
    prompts = [m["prompt"] if m else "bare" for m in metadata]
    _, parts = reward(prompts, prompts, _images(6), metadata=metadata)
    assert parts[f"{HERE}.IncludeCount"].tolist() == [include_count(m) for m in metadata]
    assert parts[f"{HERE}.IncludeCount"].tolist() == [1, 1, 2, -1, 3, 3]
    _, parts = reward(prompts, prompts, _images(6))  # no metadata: called as before
    assert parts[f"{HERE}.IncludeCount"].tolist() == [-2.0] * 6
    # Videos scored frame by frame: every frame with its video's row.
    _, parts = reward(["p1", "p2"], ["p1", "p2"], torch.rand(2, 3, 3, 4, 4), metadata=[rows[1], rows[2]])
    assert parts[f"{HERE}.IncludeCount"].tolist() == [2.0, 3.0]
    assert _recorded()[-1][1] == [rows[1]] * 3 + [rows[2]] * 3
    with pytest.raises(ValueError, match="2 metadata items for 6 samples"):
        reward(prompts, prompts, _images(6), metadata=metadata[:2])
    # A term replaced after construction is read again.
    reward.terms[f"{HERE}.IncludeCount"] = no_metadata
    reward(prompts, prompts, _images(6), metadata=metadata)
    # Bound metadata (validation's path): the same values, the reward's other attributes as they are.
    bound = WithMetadata(WeightedSum({f"{HERE}.IncludeCount": 1.0}), metadata)
    total, _ = bound(prompts, prompts, _images(6))
    assert total.tolist() == [1, 1, 2, -1, 3, 3] and list(bound.terms) == [f"{HERE}.IncludeCount"]


def test_overlapped_remote_terms_get_each_chunk_s_metadata():
    _recorded().clear()
    reward = WeightedSum({f"{HERE}.IncludeCount": 1.0})
    rows = _rows(5)
    metadata = [rows[i] for i in (0, 0, 1, 1, 2, 3, 4)]
    prompts = [m["prompt"] for m in metadata]
    scorer = {"m": lambda *args, **kw: reward.score_term(f"{HERE}.IncludeCount", *args, **kw)}
    images, pending = decode_while_scoring(lambda x: x, _images(7), 3, scorer, prompts, prompts, metadata=metadata)
    assert images.shape[0] == 7
    assert pending["m"]().tolist() == [include_count(m) for m in metadata]
    assert sorted(len(p) for p, _ in _recorded()) == [1, 3, 3], "chunks of 3, each with its own slice"


# ------------------------------------------------------------------ the http reward and the server


SEEN = "tests.served_rewards.SeenMetadata"  # Brightness that declares metadata and logs what each call got


@pytest.fixture(scope="module")
def seen(tmp_path_factory) -> Iterator[tuple[RewardServer, Path]]:
    """A SeenMetadata server batching for 0.3 s, and its log (emptied by each test that reads it)."""
    log = tmp_path_factory.mktemp("seen") / "calls.jsonl"
    log.touch()
    server = serve(SEEN, reward_args={"log": str(log)}, batch_wait_s=0.3, read_timeout_s=5.0)
    yield server, log
    server.close()


def _seen_calls(log: Path) -> list[tuple[int, list[Any] | None]]:
    return [(call["n"], call["metadata"]) for call in read_calls(log)]


def test_the_http_reward_sends_each_batch_s_metadata(seen):
    server, log = seen
    log.write_text("")
    images, rows = _images(5), _rows(5)
    metadata = [rows[0], None, rows[2], rows[3], rows[4]]
    client = HTTPReward(server.url, batch_size=2, **FAST)
    assert client(["a"] * 5, ["b"] * 5, images, metadata=metadata) == pytest.approx(
        Brightness()(["a"] * 5, ["b"] * 5, images), abs=1e-6
    )
    calls = _seen_calls(log)
    assert [m for _, got in calls for m in got] == metadata and [n for n, _ in calls] == [2, 2, 1]
    client(["a"] * 2, ["b"] * 2, images[:2])
    assert _seen_calls(log)[-1] == (2, None), "no metadata: the request is as before"
    with pytest.raises(ValueError, match=r"metadata\[1\] must be a JSON object"):
        client(["a"] * 2, ["b"] * 2, images[:2], metadata=[rows[0], "bench"])
    # Through the weighted reward, from the registry.
    total, _ = WeightedSum({"http": 1.0}, {"http": {"url": server.url, **FAST}})(
        ["a"] * 2, ["b"] * 2, images[:2], metadata=rows[:2]
    )
    assert _seen_calls(log)[-1] == (2, rows[:2]) and total.tolist() == pytest.approx(
        Brightness()([""] * 2, [""] * 2, images[:2])
    )


def _body(n: int, metadata: Any, extra: str = "") -> bytes:
    """A raw POST of ``n`` images with ``"metadata": metadata``."""
    request = json.loads(_request(encode_images(_images(n, seed=3, size=16))))
    request["metadata"] = metadata
    return _post_bytes(json.dumps(request).encode(), extra)


# A good request on its own connection: the server closes it after answering, so _exchange reads to the end.
CLOSE = "Connection: close\r\n"


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        ({"tag": "counting"}, "'metadata' must be a list of one JSON object (or null) per sample, got dict"),
        ([{"tag": "counting"}], "'metadata' has 1 items for 2 samples"),
        ([{"tag": "counting"}, "bench"], "metadata[1] must be a JSON object or null, got str"),
        ([None, 3], "metadata[1] must be a JSON object or null, got int"),
        ([None, [{"class": "cat"}]], "metadata[1] must be a JSON object or null, got list"),
    ],
)
def test_the_server_refuses_bad_metadata_while_a_good_request_is_answered(seen, metadata: Any, expected: str):
    server, _ = seen
    body, _ = _refused(server.url, _body(2, metadata), 400, expected)
    assert body["error"].startswith("bad request: ")


def test_the_server_takes_null_metadata_and_passes_it_to_a_reward_that_declares_it(seen):
    server, log = seen
    for metadata, passed in [(None, None), ([None, {"tag": "colors"}], [None, {"tag": "colors"}])]:
        status, _, body, _ = _exchange(server.url, _body(2, metadata, CLOSE))
        assert status == 200 and len(body["scores"]) == 2
        assert _seen_calls(log)[-1] == (2, passed)


@pytest.mark.slow  # a server of its own
def test_the_server_passes_no_metadata_to_a_reward_that_does_not_declare_it():
    plain = serve("brightness")  # declares no metadata: scored as before, the field ignored
    try:
        status, _, body, _ = _exchange(plain.url, _body(2, [{"tag": "colors"}, None], CLOSE))
    finally:
        plain.close()
    assert status == 200 and len(body["scores"]) == 2


def test_batched_requests_with_and_without_metadata_are_scored_in_one_call(seen):
    server, log = seen
    rows = _rows(2)

    def send() -> dict[int, list[float]]:
        results: dict[int, list[float]] = {}

        def call(i: int) -> None:
            results[i] = HTTPReward(server.url, **FAST)(
                ["a"] * 2, ["b"] * 2, _images(2, seed=i), metadata=[None, rows[1]] if i else None
            )

        threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        return results

    results, calls = _together(send, log, lambda call: call["n"] == 4)
    assert len(results) == 2 and [call["n"] for call in calls] == [4], calls
    assert sorted(calls[0]["metadata"], key=lambda m: m is not None) == [None, None, None, rows[1]]


def test_a_request_whose_metadata_breaks_the_reward_does_not_fail_its_batch_mates(seen):
    server, log = seen

    def send() -> dict[str, Any]:
        return _refused(server.url, _body(1, [{"fail": True}]), 500, "RuntimeError: poisoned metadata")[0]

    body, calls = _together(send, log, lambda call: call["n"] == 3)
    assert f"reward '{SEEN}'" in body["error"]
    sizes = [call["n"] for call in calls]
    assert sizes[0] == 3 and sorted(sizes[1:]) == [1, 2], calls  # together, then each alone


# ------------------------------------------------------------------ a fit: every image gets its prompt's row


@pytest.mark.slow
def test_a_fit_gives_every_image_its_prompt_s_row(tmp_path: Path):
    """Tiny recipe, 2 prompts a step, 4 texts x 2 images each: the reward checks every image's row is its
    original prompt's (IncludeCount asserts it), in the rollout and in validation."""
    rows = _rows(6)
    rows[5] = {"prompt": rows[5]["prompt"]}  # a row with nothing but its prompt: None, beside the others
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _recorded().clear()
    run_cli(
        tmp_path,
        f"--data.prompts={jsonl}",
        f"--data.val_prompts={jsonl}",
        "--data.prompts_per_step=2",
        "--data.images_per_refinement=2",
        "--data.val_batch_size=3",
        "--trainer.max_steps=2",
        "--trainer.limit_val_batches=2",
        "--trainer.val_check_interval=2",
        f"--model.rewards={{{HERE}.IncludeCount: 1.0, contains_word: 0.5}}",
        "--model.reward_args={contains_word: {word: red}}",
    )
    by_prompt = {r["prompt"]: (r if len(r) > 1 else None) for r in rows}
    sizes = []
    for prompts, metadata in _recorded():
        assert metadata is not None
        assert metadata == [by_prompt[p] for p in prompts]
        sizes.append(len(prompts))
    # Two training steps of 2 prompts x 4 texts x 2 images; validation (sanity check and step 2) 6 prompts each.
    assert sizes.count(16) == 2 and sum(s for s in sizes if s != 16) == 2 * 6, sizes
