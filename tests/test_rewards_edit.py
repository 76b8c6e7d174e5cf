"""Editing rewards: the ``sources`` keyword (each sample's source image) from the weighted reward to the terms that
declare it; CLIP directional similarity against CLIPModel's own forward on a tiny CLIP; the EditReward-style judge
against a fake OpenAI-compatible server (both images arrive, labelled, in both orders or a coin's; deadline,
garbled replies, no token to another host); the ``http`` reward and the reference server carrying the source
images (a hostile request refused while another is scored right); PromptRL's edit format reward against the
reference trainer's code."""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable, Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import CLIPImageProcessor, CLIPModel

from tests.helpers import QuietHandler, close_servers, serve_loopback
from tests.pipelines import clip_tokenizer
from tests.served_rewards import read_calls
from tests.test_rewards_clip import save_tiny_clip
from tests.test_rewards_server import _exchange, _pil, _png_header, _post_bytes
from unirl_pl.rewards import (
    REGISTRY,
    CLIPDirectional,
    EditJudge,
    HTTPReward,
    PromptRLEditFormat,
    PromptRLFormat,
    RewardServerError,
    RewardTerm,
    WeightedSum,
    resolve_reward,
)
from unirl_pl.rewards.http import decode_images, encode_images, encode_sources
from unirl_pl.rewards.metadata import WithMetadata, accepts_sources
from unirl_pl.rewards.overlap import decode_while_scoring
from unirl_pl.rewards.server import RewardServer, serve
from unirl_pl.rewards.sources import check_sources, source_digest, unique_sources

FAST = {"timeout_s": 2.0, "max_retries": 1, "backoff_s": 0.01}


def _images(n: int, seed: int = 0, size: int = 32, width: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, size, width or size), generator=g).float() / 255


# ------------------------------------------------------------------ the sources keyword


class _Probe:
    """Declares ``sources``: each sample's source mean (-1 without one); keeps what every call got."""

    def __init__(self) -> None:
        self.calls: list[Any] = []

    def __call__(
        self, prompts: list[str], refined: list[str], images: torch.Tensor, sources: Any = None
    ) -> list[float]:
        self.calls.append(sources)
        return [-1.0 if s is None else float(s.mean()) for s in sources or [None] * len(prompts)]


def _plain(prompts: list[str], refined: list[str], images: torch.Tensor) -> list[float]:
    return [1.0] * len(prompts)


def _catch_all(prompts: list[str], refined: list[str], images: torch.Tensor, **kwargs: Any) -> list[float]:
    assert "sources" not in kwargs, "a **kwargs catch-all did not ask for sources"
    return [1.0] * len(prompts)


def test_sources_go_only_to_terms_that_declare_them_each_sample_its_own():
    probe = _Probe()
    reward = WeightedSum(
        [RewardTerm(fn, name=n) for n, fn in (("probe", probe), ("plain", _plain), ("all", _catch_all))]
    )  # type: ignore[arg-type]
    assert accepts_sources(reward) and accepts_sources(probe) and accepts_sources(HTTPReward("http://127.0.0.1:1/"))
    assert not accepts_sources(_plain) and not accepts_sources(_catch_all) and not accepts_sources(PromptRLFormat())
    assert [reward.wants_sources(n) for n in reward.terms] == [True, False, False]
    sources = [torch.full((3, 5, 7), 0.25), None, torch.full((3, 9, 4), 0.75)]  # each its own size
    total, parts = reward(["a", "b", "c"], ["a", "b", "c"], torch.zeros(3, 3, 4, 4), sources=sources)
    assert parts["probe"].tolist() == [0.25, -1.0, 0.75] and total.tolist() == [2.25, 1.0, 2.75]
    assert probe.calls[-1] is not None and probe.calls[-1][0] is sources[0]
    reward(["a"], ["a"], torch.zeros(1, 3, 4, 4))  # no sources: called as before
    assert probe.calls[-1] is None
    with pytest.raises(ValueError, match="2 source images for 3 samples"):
        reward(["a", "b", "c"], ["a", "b", "c"], torch.zeros(3, 3, 4, 4), sources=sources[:2])
    # Videos scored frame by frame: every frame with its video's source.
    reward(["a", "b"], ["a", "b"], torch.zeros(2, 3, 3, 4, 4), sources=[sources[0], None])
    assert [None if s is None else float(s.mean()) for s in probe.calls[-1]] == [0.25] * 3 + [None] * 3


def test_with_metadata_binds_sources_for_validation_and_leaves_them_out_when_none():
    probe = _Probe()
    reward = WeightedSum([RewardTerm(probe, name="probe")])  # type: ignore[arg-type]
    sources = [torch.full((3, 4, 4), 0.5), torch.full((3, 6, 6), 0.125)]
    bound = WithMetadata(reward, None, None, sources=sources)
    total, _ = bound(["a", "b"], ["a", "b"], torch.zeros(2, 3, 4, 4))
    assert total.tolist() == [0.5, 0.125] and bound.terms is reward.terms
    calls = []
    # The existing callers (no sources): the wrapped reward is called without the keyword.
    WithMetadata(lambda p, r, i, metadata, replies: calls.append((metadata, replies)), [None], ["x"])(["a"], ["a"], 0)
    assert calls == [([None], ["x"])]


def test_overlapped_remote_terms_get_each_chunk_s_sources():
    probe = _Probe()
    reward = WeightedSum([RewardTerm(probe, name="probe")])  # type: ignore[arg-type]
    sources = [torch.full((3, 2, 2), v / 10) for v in range(7)]
    scorer = {"probe": lambda *a, **kw: reward.score_term("probe", *a, **kw)}
    images, pending = decode_while_scoring(
        lambda x: x, torch.zeros(7, 3, 2, 2), 3, scorer, ["p"] * 7, ["p"] * 7, sources=sources
    )
    assert pending["probe"]().tolist() == pytest.approx([v / 10 for v in range(7)])
    assert sorted(len(c) for c in probe.calls) == [1, 3, 3]


def test_check_sources_and_their_keys():
    good = torch.rand(3, 5, 6)
    assert check_sources([good, None], 2) == [good, None]
    with pytest.raises(ValueError, match="1 source images for 2 samples"):
        check_sources([good], 2)
    with pytest.raises(ValueError, match=r"sources\[1\] must be a float \(3, H, W\) image .* got \(5, 6\)"):
        check_sources([good, torch.rand(5, 6)], 2)
    with pytest.raises(ValueError, match="must be a list"):
        check_sources(good, 1)
    # Keyed by the 8-bit picture: a copy is the same source, a one-level change another.
    assert source_digest(good) == source_digest(good.clone()) != source_digest(good.transpose(1, 2).contiguous())
    changed = good.clone()
    changed[0, 0, 0] = (torch.round(changed[0, 0, 0] * 255) + 1) % 256 / 255
    assert source_digest(changed) != source_digest(good)
    firsts, index = unique_sources([good, good.clone(), changed, good])
    assert len(firsts) == 2 and index == [0, 0, 1, 0]


# ------------------------------------------------------------------ CLIP directional similarity

SIZE = 32


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory) -> str:
    return save_tiny_clip(tmp_path_factory.mktemp("clip"))


def _embed(clip_dir: str, images: list[torch.Tensor], texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalized (image, text) embeddings from CLIPModel.forward, the pixels through CLIP's own image processor
    on the 8-bit images (any size: resized and centre-cropped as the model's processor says)."""
    model = CLIPModel.from_pretrained(clip_dir).eval()
    proc = CLIPImageProcessor.from_pretrained(clip_dir)
    arrays = [(im.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy() for im in images]
    pixels = torch.cat(
        [proc(images=a, return_tensors="pt", input_data_format="channels_last")["pixel_values"] for a in arrays]
    )
    tokens = clip_tokenizer()(texts, padding="max_length", max_length=77, return_tensors="pt")
    with torch.no_grad():
        out = model(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"], pixel_values=pixels)
    return out.image_embeds, out.text_embeds


def _direction(clip_dir: str, edited: torch.Tensor, sources: list[torch.Tensor], before: list[str], after: list[str]):
    """InstructPix2Pix's ``sim_direction``: cos(img(edited) - img(source), txt(after) - txt(before))."""
    n = len(sources)
    img, txt = _embed(clip_dir, [*edited, *sources], [*after, *before])
    return F.cosine_similarity(img[:n] - img[n:], txt[:n] - txt[n:], dim=-1)


def test_clip_directional_is_instructpix2pix_sim_direction_with_the_rows_captions(clip_dir):
    edited, sources = _images(3, seed=1), [*_images(2, seed=2), _images(1, seed=3, size=48, width=40)[0]]
    rows = [
        {"prompt": "make it red", "source_caption": "a cat", "target_caption": "a red cat"},
        {"prompt": "add a hat", "target_caption": "a dog in a hat"},  # no source caption: the neutral one
        None,  # no row: the instruction is the target text
    ]
    prompts = ["make it red", "add a hat", "turn day into night"]
    reward = CLIPDirectional(pretrained_path=clip_dir, batch_size=2)
    got = torch.tensor(reward(prompts, ["x"] * 3, edited, metadata=rows, sources=sources))
    expected = _direction(
        clip_dir, edited, sources, ["a cat", "a photo", "a photo"], ["a red cat", "a dog in a hat", prompts[2]]
    )
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-5)
    assert (expected.abs() > 1e-3).all(), "the random model gives a direction, so the test can fail"
    # The source is embedded at its own size: the 48x40 source resized by the processor, not the edited size.
    unchanged = reward(prompts[:1], ["x"], sources[0][None], metadata=rows[:1], sources=sources[:1])
    assert unchanged == [0.0], "an image left as its source has no direction"


def test_clip_directional_captions_choices_and_batch_invariance(clip_dir):
    edited, sources = _images(4, seed=4), list(_images(2, seed=5)) * 2  # two sources, shared as a group's
    rows = [{"caption": "a house", "target_caption": "a house in snow"}] * 4
    reward = CLIPDirectional(pretrained_path=clip_dir, source_caption_key="caption", prompt="refined", scale=2.0)
    got = torch.tensor(reward(["p"] * 4, ["snowy house"] * 4, edited, metadata=rows, sources=sources))
    expected = _direction(clip_dir, edited, sources, ["a house"] * 4, ["a house in snow"] * 4)
    torch.testing.assert_close(got, 2 * expected, rtol=0, atol=4e-5)
    refined = reward(["p"] * 2, ["snowy house", "a ruin"], edited[:2], sources=sources[:2], metadata=None)
    by_hand = _direction(clip_dir, edited[:2], sources[:2], ["a photo"] * 2, ["snowy house", "a ruin"])
    torch.testing.assert_close(torch.tensor(refined), 2 * by_hand, rtol=0, atol=4e-5)
    alone = [
        reward(["p"], ["snowy house"], edited[i : i + 1], metadata=rows[:1], sources=sources[i : i + 1])[0]
        for i in range(4)
    ]
    assert max(abs(a - b) for a, b in zip(alone, got.tolist(), strict=True)) <= 1e-5


def test_clip_directional_refuses_what_it_cannot_score(clip_dir):
    reward = resolve_reward("clip_directional", {"pretrained_path": clip_dir})
    assert isinstance(reward, CLIPDirectional) and accepts_sources(reward)
    with pytest.raises(ValueError, match="without any \\(sources=None\\)"):
        reward(["p"], ["p"], _images(1))
    with pytest.raises(ValueError, match="sample 1 has no source image"):
        reward(["p", "q"], ["p", "q"], _images(2), sources=[_images(1)[0], None])
    with pytest.raises(ValueError, match=r"metadata\[0\]\['target_caption'\] must be a string, got list"):
        reward(["p"], ["p"], _images(1), metadata=[{"target_caption": ["x"]}], sources=[_images(1)[0]])
    with pytest.raises(ValueError, match="two different field names"):
        CLIPDirectional(pretrained_path=clip_dir, source_caption_key="c", target_caption_key="c")
    # Through the weighted reward: sources and metadata handed on, a video frame by frame.
    total, _ = WeightedSum({"clip_directional": 1.0}, {"clip_directional": {"pretrained_path": clip_dir}})(
        ["p"], ["p"], _images(1, seed=7)[None].expand(1, 2, 3, SIZE, SIZE), sources=[_images(1)[0]]
    )
    assert torch.isfinite(total).all()


# ------------------------------------------------------------------ the EditReward-style judge

JudgeReply = Callable[[dict, dict[str, Any]], tuple[int, bytes]]


def chat(text: str) -> tuple[int, bytes]:
    return 200, json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]}).encode()


def _shown(request: dict) -> dict[str, Any]:
    """What a request shows: the text parts, the decoded images in order, and the role each label names."""
    parts = request["messages"][-1]["content"]
    urls = [p["image_url"]["url"] for p in parts if p["type"] == "image_url"]
    assert all(u.startswith("data:image/png;base64,") for u in urls)
    texts = [p["text"] for p in parts if p["type"] == "text"]
    labels = [t for t in texts if t.startswith("Image ")][:2]
    roles = ["source" if "original" in label else "edited" for label in labels]
    # Each label comes right before its image.
    kinds = [p["type"] for p in parts]
    assert kinds == ["text", "image_url", "text", "image_url", "text"], kinds
    return {"images": [decode_images([u])[0] for u in urls], "roles": roles, "instruction": texts[-1], "labels": labels}


@pytest.fixture
def judge() -> Iterator[Callable[[JudgeReply], tuple[str, dict]]]:
    """Factory: a loopback chat-completions server answering with ``reply(request, headers)``; status 0 hangs
    until the test ends. Returns its base URL and what it saw."""
    servers: list[ThreadingHTTPServer] = []
    release = threading.Event()

    def start(reply: JudgeReply) -> tuple[str, dict]:
        seen: dict[str, Any] = {"requests": [], "auth": []}
        lock = threading.Lock()

        class Handler(QuietHandler):
            def do_POST(self) -> None:  # noqa: N802
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    seen["requests"].append(request)
                    seen["auth"].append(self.headers.get("Authorization"))
                status, body = reply(request, dict(self.headers))
                if status == 0:
                    release.wait(timeout=60)
                    return
                self.answer(status, body)

        server = serve_loopback(Handler)
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/v1", seen

    yield start
    release.set()
    close_servers(servers)


def _fair_with_a_first_position_bias(request: dict, headers: dict) -> tuple[int, bytes]:
    """Scores the edited image's brightness on 1-10 (found by its label), plus 1 when it is shown first."""
    shown = _shown(request)
    edited = shown["images"][shown["roles"].index("edited")]
    return chat(f"Score: {1 + round(8 * float(edited.mean())) + (shown['roles'][0] == 'edited')}")


def test_the_judge_gets_both_images_labelled_in_both_orders_and_averages(judge):
    url, seen = judge(_fair_with_a_first_position_bias)
    edited = torch.stack([torch.full((3, 8, 8), v) for v in (0.0, 128 / 255, 1.0)])  # 8-bit values: sent exactly
    sources = [_images(1, seed=1)[0], _images(1, seed=1)[0], _images(1, seed=2, size=12, width=10)[0]]
    prompts = ["make it dark", "make it grey", "make it white"]
    scores = EditJudge(url=url, model="edit-judge", **FAST)(prompts, ["rewritten"] * 3, edited, sources=sources)
    # Each sample once in each order: the +1 for the first position is in one of its two scores, half of it
    # in the mean of every sample alike.
    assert scores == [1.5, 5.5, 9.5]
    assert len(seen["requests"]) == 6
    for request in seen["requests"]:
        shown = _shown(request)
        i = next(k for k, p in enumerate(prompts) if p in shown["instruction"])
        by_role = dict(zip(shown["roles"], shown["images"], strict=True))
        # The exact pixels of both images, each at its own size, where its label says.
        torch.testing.assert_close(by_role["edited"], edited[i], rtol=0, atol=0)
        torch.testing.assert_close(by_role["source"], sources[i], rtol=0, atol=0)
        assert "rewritten" not in shown["instruction"], "the original instruction is judged"
        first = "edited" if shown["roles"][0] == "edited" else "original"
        assert f"Image 1 is the {first} image" in shown["instruction"] and "from 1 to 10" in shown["instruction"]
        assert request["model"] == "edit-judge" and request["temperature"] == 0.0
    layouts = sorted(
        (next(k for k, p in enumerate(prompts) if p in _shown(r)["instruction"]), tuple(_shown(r)["roles"]))
        for r in seen["requests"]
    )
    assert layouts == [(i, o) for i in range(3) for o in (("edited", "source"), ("source", "edited"))]


def test_a_fixed_layout_and_the_coin(judge):
    url, seen = judge(_fair_with_a_first_position_bias)
    edited, sources = _images(32, seed=3), list(_images(32, seed=4))
    prompts = [f"edit {i}" for i in range(32)]
    fixed = EditJudge(url=url, model="m", order="source_first", **FAST)
    fixed(prompts[:4], prompts[:4], edited[:4], sources=sources[:4])
    assert [_shown(r)["roles"] for r in seen["requests"]] == [["source", "edited"]] * 4
    seen["requests"].clear()
    coin = EditJudge(url=url, model="m", order="coin", **FAST)
    scores = coin(prompts, prompts, edited, sources=sources)
    assert len(seen["requests"]) == 32, "once per sample"
    first = {
        _shown(r)["instruction"].split("instruction was: ")[1].split("\n")[0]: _shown(r)["roles"][0]
        for r in seen["requests"]
    }
    edited_first = sum(role == "edited" for role in first.values())
    assert 8 <= edited_first <= 24, f"the coin showed the edit first {edited_first} times of 32"
    for p, s in zip(prompts, scores, strict=True):  # each score read with the order it was asked in
        i = prompts.index(p)
        assert s == 1 + round(8 * float(edited[i].mean())) + (first[p] == "edited")
    # The same pair gets the same order wherever it sits in the batch.
    seen["requests"].clear()
    coin(prompts[::-1], prompts[::-1], edited.flip(0), sources=sources[::-1])
    again = {
        _shown(r)["instruction"].split("instruction was: ")[1].split("\n")[0]: _shown(r)["roles"][0]
        for r in seen["requests"]
    }
    assert again == first


def test_a_hanging_judge_is_cut_off_at_the_deadline(judge):
    url, seen = judge(lambda r, h: (0, b"") if "stall" in _shown(r)["instruction"] else chat("7"))
    reward = EditJudge(url=url, model="m", order="source_first", timeout_s=0.3, max_retries=1, backoff_s=0.01)
    start = time.monotonic()
    with pytest.warns(UserWarning, match="1 of 3 samples got no score"):
        scores = reward(["ok", "stall", "fine"], ["x"] * 3, _images(3), sources=list(_images(3, seed=1)))
    assert scores[0] == 7.0 and math.isnan(scores[1]) and scores[2] == 7.0
    assert time.monotonic() - start < 2.5, "two 0.3 s attempts, not a hang"
    assert sum("stall" in _shown(r)["instruction"] for r in seen["requests"]) == 2, "tried once, retried once"
    start = time.monotonic()
    with pytest.raises(RewardServerError, match="all 2 requests failed"):
        EditJudge(url=url, model="m", timeout_s=0.3, max_retries=0)(
            ["stall"], ["x"], _images(1), sources=[_images(1)[0]]
        )
    assert time.monotonic() - start < 2.0


def test_a_malformed_reply_is_nan_and_one_unreadable_order_spoils_its_sample(judge):
    def reply(request: dict, headers: dict) -> tuple[int, bytes]:
        shown = _shown(request)
        if "garbage" in shown["instruction"]:
            return 200, b"<html>not json</html>"
        if "half" in shown["instruction"] and shown["roles"][0] == "edited":
            return chat("It depends on taste.")
        return chat("8")

    url, _ = judge(reply)
    reward = EditJudge(url=url, model="m", max_unreadable=0.5, **FAST)
    with pytest.warns(UserWarning, match="2 of 3 samples got no score"):
        scores = reward(["good", "garbage", "half"], ["x"] * 3, _images(3), sources=list(_images(3, seed=1)))
    assert scores[0] == 8.0 and math.isnan(scores[1]) and math.isnan(scores[2]), "not the other order's 8"
    assert reward.failed == 2
    with pytest.raises(RewardServerError, match=r"VLM judge .*: 3 of 4 requests gave no score"):
        reward(["garbage", "half"], ["x"] * 2, _images(2), sources=list(_images(2, seed=1)))


def test_the_token_goes_to_the_judge_only_never_through_a_redirect(judge, monkeypatch):
    url, seen = judge(lambda r, h: chat("6"))
    monkeypatch.setenv("UNIRL_EDIT_JUDGE_KEY", "secret-token")
    reward = EditJudge(url=url, model="m", order="coin", api_key_env="UNIRL_EDIT_JUDGE_KEY", **FAST)
    assert reward(["a"], ["a"], _images(1), sources=[_images(1, seed=1)[0]]) == [6.0]
    assert seen["auth"] == ["Bearer secret-token"]
    target, other = judge(lambda r, h: chat("9"))

    class Redirect(QuietHandler):
        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(302)
            self.send_header("Location", target + "/chat/completions")
            self.send_header("Content-Length", "0")
            self.end_headers()

    server = serve_loopback(Redirect)
    try:
        bounced = EditJudge(
            url=f"http://127.0.0.1:{server.server_address[1]}/v1", model="m", api_key_env="UNIRL_EDIT_JUDGE_KEY"
        )
        with pytest.raises(RewardServerError, match="redirect"):
            bounced(["a"], ["a"], _images(1), sources=[_images(1, seed=1)[0]])
    finally:
        close_servers([server])
    assert other["requests"] == [], "the redirect target got nothing, the token least of all"


def test_the_edit_judge_needs_sources_and_sane_settings(judge):
    url, _ = judge(lambda r, h: chat("5"))
    reward = resolve_reward("edit_judge", {"url": url, "model": "m", **FAST})
    assert isinstance(reward, EditJudge) and accepts_sources(reward) and reward.remote
    with pytest.raises(ValueError, match="reward 'edit_judge': this reward scores edits against their source images"):
        reward(["a"], ["a"], _images(1))
    total, _ = WeightedSum({"edit_judge": 0.5}, {"edit_judge": {"url": url, "model": "m", **FAST}})(
        ["a", "b"], ["a", "b"], _images(2), sources=list(_images(2, seed=1))
    )
    assert total.tolist() == [2.5, 2.5]
    with pytest.raises(ValueError, match="order must be both, coin, source_first or edited_first"):
        EditJudge(url=url, model="m", order="random")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"instruction must hold \{prompt\}"):
        EditJudge(url=url, model="m", instruction="Rate it.")
    with pytest.raises(ValueError, match="reward 'edit_judge': url must start with"):
        EditJudge(url="127.0.0.1:1", model="m")


# ------------------------------------------------------------------ the http reward and the server

READ_TIMEOUT_S = 5.0
LIMITS = {"max_image_pixels": 32 * 32, "max_total_pixels": 16 * 16 * 8, "read_timeout_s": READ_TIMEOUT_S}
SEEN = "tests.served_rewards.SeenSources"


@pytest.fixture(scope="module")
def seen_sources(tmp_path_factory) -> Iterator[tuple[RewardServer, Path]]:
    log = tmp_path_factory.mktemp("sources") / "calls.jsonl"
    log.touch()
    server = serve(SEEN, reward_args={"log": str(log)}, **LIMITS)
    yield server, log
    server.close()


def _edit_scores(images: torch.Tensor, sources: list[torch.Tensor | None]) -> list[float]:
    """What SeenSources answers: brightness minus the source's, both of the 8-bit pictures."""
    q = lambda x: (x * 255).round() / 255  # noqa: E731
    return [
        float(q(im).mean()) - (0.0 if s is None else float(q(s).mean())) for im, s in zip(images, sources, strict=True)
    ]


def test_the_http_reward_sends_the_sources_and_the_server_hands_them_on(seen_sources):
    server, log = seen_sources
    log.write_text("")
    images = _images(3, seed=1, size=16)
    sources = [_images(1, seed=2, size=12, width=10)[0], None, _images(1, seed=3, size=8)[0]]
    client = HTTPReward(server.url, batch_size=2, **FAST)
    assert client(["a"] * 3, ["b"] * 3, images, sources=sources) == pytest.approx(
        _edit_scores(images, sources), abs=1e-6
    )
    assert [c["sources"] for c in read_calls(log)] == [[[3, 12, 10], None], [[3, 8, 8]]], "each at its own size"
    client(["a"], ["b"], images[:1])
    assert read_calls(log)[-1]["sources"] is None, "no sources: the request is as before"
    HTTPReward(server.url, send_sources=False, **FAST)(["a"], ["b"], images[:1], sources=sources[:1])
    assert read_calls(log)[-1]["sources"] is None, "send_sources: false leaves them out"
    total, _ = WeightedSum({"http": 1.0}, {"http": {"url": server.url, **FAST}})(
        ["a"], ["b"], images[:1], sources=sources[:1]
    )
    assert total.tolist() == pytest.approx(_edit_scores(images[:1], sources[:1]), abs=1e-6)
    with pytest.raises(ValueError, match=r"sources\[0\] must be a float"):
        client(["a"], ["b"], images[:1], sources=[torch.zeros(4, 4)])


def _with_sources(sources: Any, n: int = 2) -> bytes:
    request = {
        "prompts": ["p"] * n,
        "refined_prompts": ["r"] * n,
        "images": encode_images(_images(n, seed=3, size=16)),
        "sources": sources,
    }
    return _post_bytes(json.dumps(request).encode())


def _png(height: int, width: int) -> str:
    return encode_images(_images(1, seed=9, size=height, width=width))[0]  # type: ignore[return-value]


GOOD_IMAGES, GOOD_SOURCES = _images(2, seed=7, size=16), [_images(1, seed=8, size=12)[0], None]


def _refused_beside_a_good_request(url: str, data: bytes, status: int, expected: str) -> None:
    """Send the hostile ``data`` while a good request with sources is in flight; the hostile one gets its status
    and a JSON error, the good one its right scores."""
    both = threading.Barrier(2, timeout=10)
    good: dict[str, Any] = {}

    def send_good() -> None:
        both.wait()
        try:
            good["scores"] = HTTPReward(url, timeout_s=30, max_retries=0)(
                ["a", "b"], ["a", "b"], GOOD_IMAGES, sources=GOOD_SOURCES
            )
        except Exception as err:  # reported below
            good["error"] = err

    thread = threading.Thread(target=send_good)
    thread.start()
    both.wait()
    got, headers, body, _ = _exchange(url, data)
    thread.join(timeout=40)
    assert "error" not in good, good.get("error")
    assert good["scores"] == pytest.approx(_edit_scores(GOOD_IMAGES, GOOD_SOURCES), abs=1e-6)
    assert got == status and headers["connection"] == "close" and set(body) == {"error"}, (got, body)
    assert expected in body["error"], body


@pytest.mark.parametrize(
    ("sources", "status", "expected"),
    [
        ([None], 400, "bad request: 'sources' has 1 items for 2 samples"),
        ("abc", 400, "'sources' must be a list of one base64 image string (or null) per sample, got str"),
        ([None, 7], 400, "sources[1] must be a base64 image string or null, got int"),
        ([None, "!!!"], 400, "sources[1]: not a base64-encoded image"),
        ([_pil("GIF"), None], 400, "sources[0]: not a PNG or JPEG image"),
        ([None, _png_header(8, 8)], 400, "sources[1]: cannot decode the image"),
        # 40x40 whose data is broken: a 413 means the header was read first (decoding would fail with a 400).
        ([_png_header(40, 40), None], 413, "sources[0]: 40x40 is over the limit of 1024 pixels per image"),
        # Two 16x16 images leave 1536 of the request's 2048 pixels: a 25x32 source fits, a second does not (refused
        # from its header: its data is broken).
        ([_png(25, 32), _png_header(32, 25)], 413, "sources[1]: the images declare over 2048 pixels in all"),
    ],
    ids=["count", "not-a-list", "not-a-string", "not-base64", "not-png", "corrupt", "huge", "request-total"],
)
def test_a_hostile_source_is_refused_while_another_request_is_scored(seen_sources, sources, status, expected):
    server, _ = seen_sources
    _refused_beside_a_good_request(server.url, _with_sources(sources), status, expected)


def test_a_reward_that_takes_no_sources_is_scored_without_them():
    """The worker in this process (no LitServe): a reward that does not declare sources gets none, though the
    request's sources are still decoded and checked; the sources' pixels count against the request's limit."""
    from unirl_pl.rewards.server_worker import RewardAPI, _Job

    api = RewardAPI("brightness", {}, 8, 0.0, 32 * 32, 16 * 16 * 3, None, 0)
    api.reward = resolve_reward("brightness")
    request = {"prompts": ["p"] * 2, "refined_prompts": ["r"] * 2, "images": encode_images(_images(2, size=16))}
    job = api.decode_request({**request, "sources": encode_sources([_images(1, seed=1, size=16)[0], None])})
    assert isinstance(job, _Job) and job.sources is not None and job.sources[1] is None
    assert api.predict(job) == pytest.approx(_images(2, size=16).mean(dim=(1, 2, 3)).tolist(), abs=1e-6)
    # Two distinct sources (a repeated one is decoded, and counted, once).
    over = api.decode_request({**request, "sources": encode_sources([_images(1, seed=s, size=16)[0] for s in (1, 2)])})
    assert over[0] == 413 and "pixels in all" in over[1], over  # 2 images + 2 sources of 256 > 768


# ------------------------------------------------------------------ PromptRL's edit format reward

IMAGES = torch.zeros(1, 3, 4, 4)


# Expected values from G-U-N/UniRL @53c28c9. unirl/train_edit.py:242-244 (format_reward): 1.0 when
# re.compile(r"<answer>.*?</answer>", re.DOTALL).search(reply), else 0.0. unirl/trainer/edit_grpo_trainer.py:723-733
# (compute_rewards, the "format" branch): a prompt's num_refined refined rows get their own replies' scores and its
# num_skip_refinement unrefined rows the mean of those (0.0 when the prompt has no refined row).
@pytest.mark.parametrize(
    ("replies", "expected"),
    [
        (["<answer>make the sky red</answer>", "make the sky red", None, None], [1.0, 0.0, 0.5, 0.5]),
        (
            ["<answer>a\nred sky</answer>", "<answer>red", "think</answer> <answer>y</answer>", None],
            [1.0, 0.0, 1.0, 2 / 3],
        ),
        (["<ANSWER>x</ANSWER>", "x</answer>", None, None], [0.0, 0.0, 0.0, 0.0]),
        (["<answer></answer>", "<answer>b</answer>", None, None], [1.0, 1.0, 1.0, 1.0]),
        ([None, None, None, None], [0.0, 0.0, 0.0, 0.0]),  # no refined row: 0.0
    ],
)
def test_edit_format_reward_as_promptrl_edit_trainer(replies, expected):
    scores = PromptRLEditFormat()(["make the sky red"] * 4, ["r"] * 4, IMAGES, replies=replies)
    assert scores == pytest.approx(expected)


def test_edit_format_groups_by_instruction_and_source_image():
    # One instruction on two source images: two groups, each unrefined sample at its own group's mean.
    a, b = _images(1, seed=1)[0], _images(1, seed=2)[0]
    replies = ["<answer>x</answer>", None, "x", None]
    sources = [a, a.clone(), b, b]
    reward = PromptRLEditFormat()
    assert reward(["make it red"] * 4, ["r"] * 4, IMAGES, replies=replies, sources=sources) == [1.0, 1.0, 0.0, 0.0]
    # Without sources: one group per instruction.
    assert reward(["make it red"] * 4, ["r"] * 4, IMAGES, replies=replies) == [1.0, 0.5, 0.0, 0.5]
    # The text-to-image format reward gives an unrefined sample a constant instead: not the edit trainer's.
    assert PromptRLFormat()(["make it red"] * 4, ["r"] * 4, IMAGES, replies=replies) == [1.0, 1.0, 0.0, 1.0]
    # No replies at all: the refined prompts read as the replies, as PromptRLFormat does.
    assert reward(["p", "p"], ["<answer>x</answer>", "x"], IMAGES) == [1.0, 0.0]
    assert REGISTRY["promptrl_edit_format"] is PromptRLEditFormat
    assert PromptRLEditFormat(no_refined=1.0)(["p"], ["p"], IMAGES, replies=[None]) == [1.0]
    with pytest.raises(ValueError, match="no_refined"):
        PromptRLEditFormat(no_refined=float("inf"))
    # Through the weighted reward: both keywords handed on.
    reward_sum = WeightedSum({"promptrl_edit_format": 1.0})
    total, _ = reward_sum(["make it red"] * 4, ["r"] * 4, torch.zeros(4, 3, 4, 4), replies=replies, sources=sources)
    assert total.tolist() == [1.0, 1.0, 0.0, 0.0]


def test_encode_sources_encodes_a_shared_source_once():
    shared, other = _images(1, seed=1, size=6, width=9)[0], _images(1, seed=2)[0]
    encoded = encode_sources([shared, None, shared.clone(), other])
    assert encoded[1] is None and encoded[0] == encoded[2] != encoded[3]
    (back,) = decode_images([encoded[0]])
    torch.testing.assert_close(back, (shared * 255).round() / 255, rtol=0, atol=0)
    assert np.asarray(back.shape).tolist() == [3, 6, 9]
