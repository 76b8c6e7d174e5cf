"""The VLM judge against a fake OpenAI-compatible server on loopback: requests in the chat format with the
images as data URLs, the three templates, robust parsing, concurrency, retries, and the failure policy
(a stalled or garbled sample is NaN for model.nonfinite_rewards; a server that is down is an error)."""

from __future__ import annotations

import json
import math
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import ThreadingHTTPServer

import pytest
import torch

from tests.helpers import QuietHandler, close_servers, read_metrics, run_cli, series, serve_loopback
from unirl_pl.rewards import WeightedSum
from unirl_pl.rewards.http import RewardServerError, decode_images
from unirl_pl.rewards.vlm_judge import VLMJudge, parse_choice, parse_score, parse_yes_no

FAST = {"timeout_s": 2.0, "max_retries": 1, "backoff_s": 0.01}

# reply(request) -> (status, body): status 0 never answers before the test ends (the client times out first).
Reply = Callable[[dict], tuple[int, bytes]]


def chat(text: str) -> tuple[int, bytes]:
    """A 200 chat completion whose message is ``text``."""
    return 200, json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]}).encode()


def _images(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, 8, 8), generator=g).float() / 255


def _text(request: dict) -> str:
    return request["messages"][-1]["content"][-1]["text"]


def _pixels(request: dict) -> list[torch.Tensor]:
    urls = [part["image_url"]["url"] for part in request["messages"][-1]["content"] if part["type"] == "image_url"]
    assert all(u.startswith("data:image/png;base64,") for u in urls)
    return list(decode_images(urls))


@pytest.fixture
def judge_server() -> Iterator[Callable[[Reply], tuple[str, dict]]]:
    """Factory: a loopback server answering ``POST /v1/chat/completions`` with ``reply``; returns its base URL
    and a stats dict (requests seen, most in flight at once). Stalled handlers are released at teardown."""
    servers: list[ThreadingHTTPServer] = []
    release = threading.Event()

    def start(reply: Reply) -> tuple[str, dict]:
        stats = {"requests": [], "in_flight": 0, "max_in_flight": 0, "paths": set()}
        lock = threading.Lock()

        class Handler(QuietHandler):
            def do_POST(self) -> None:  # noqa: N802
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    stats["requests"].append(request)
                    stats["paths"].add(self.path)
                    stats["in_flight"] += 1
                    stats["max_in_flight"] = max(stats["max_in_flight"], stats["in_flight"])
                try:
                    status, body = reply(request)
                    if status == 0:
                        release.wait(timeout=120)  # never answers within a test: released at teardown
                        return
                finally:
                    # Leaves the count before the reply is sent: once the client has the reply it may send its
                    # next request, which this thread must not still be counted beside.
                    with lock:
                        stats["in_flight"] -= 1
                self.answer(status, body)

        server = serve_loopback(Handler)
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/v1", stats

    yield start
    release.set()
    close_servers(servers)


# ------------------------------------------------------------------ parsing (pure)
@pytest.mark.parametrize(
    "reply, expected",
    [
        ("7", 7.0),
        (" 8.5 ", 8.5),
        ("Score: 6", 6.0),
        ("The image is good. Final Score: 9", 9.0),
        ("**Score:** 4", 4.0),
        ("I'd give it 7/10", 7.0),
        ("3 out of 10", 3.0),
        ("Reasoning: 2 cats, 1 dog. Score: 5", 5.0),
        ("11", None),  # out of range
        ("0", None),
        ("2 cats and 3 dogs", None),  # ambiguous
        ("I cannot rate this image.", None),
        ("", None),
        # A stated scale is not the score, and its dash is not a minus sign.
        ("On a score 1-10: 6", 6.0),
        ("On a score of 1-10, I give it 6", 6.0),
        ("Final Score (1-10): 7.5", 7.5),
        # Out of range however it is written: labeled, as a ratio, negative.
        ("Score: 15", None),
        ("12/10", None),
        ("-3", None),
        # A ratio on another scale is not a score on this one.
        ("4/5", None),
        ("Score: 4/5", None),
        ("<html><body><h1>502 Bad Gateway</h1></body></html>", None),
        # A reasoning judge: the verdict is read, not the numbers of the reasoning.
        ("<think>At first 3/10, then 2 details ...</think><answer>Score: 8</answer>", 8.0),
        ("Composition 4/10 ... </think> Final score: 6", 6.0),
        # UnifiedReward's dimensions: their mean.
        ("Alignment Score (1-5): 4\nCoherence Score (1-5): 5\nStyle Score (1-5): 2", 11 / 3),
        ("Alignment Score (1-5): 4\nCoherence Score (1-5): 12\nStyle Score (1-5): 2", None),
    ],
)
def test_parse_score(reply, expected):
    assert parse_score(reply, 1, 10) == expected


@pytest.mark.parametrize(
    "reply, expected",
    [
        ("Yes", 1.0),
        ("no.", 0.0),
        ("Yes, there is a cat; no dog.", 1.0),
        ("NO", 0.0),
        ("yes or no", None),
        ("maybe", None),
    ],
)
def test_parse_yes_no(reply, expected):
    assert parse_yes_no(reply) == expected


@pytest.mark.parametrize(
    "reply, expected",
    [
        ("1", 0),
        ("2", 1),
        ("Image 2", 1),
        ("The first one.", 0),
        ("2 is better than 1", 1),
        ("10", None),
        ("both", None),
        # The verdict, wherever the image it names first stands in the sentence.
        ("image 2 is clearly better than image 1", 1),
        ("Image 1 is worse than image 2", 1),
        ("The first image is better.", 0),
        ("I prefer image 2.", 1),
        ("Image 1, because image 2 is blurry", 0),
        ("Image 1 is better. No wait, image 2 is better.", None),
        ('{"winner": 2}', 1),
        ('{"better": "Image 1"}', 0),
        ('{"winner": true}', None),
        # UnifiedReward-Think: the reasoning scores both images; the answer tag decides.
        (
            "<think>1. Semantic consistency:\n Image 1 (9/10) ...\n Image 2 (7/10) ...\nTotal score:\nImage 1: 9+8=17\n"
            "Image 2: 7+9=16</think>\n<answer>Image 2 is better</answer>",
            1,
        ),
    ],
)
def test_parse_choice(reply, expected):
    assert parse_choice(reply) == expected


# Issue 41 item 9: each negation once read as its opposite (or a choice); a negated or undecided reply is
# unreadable (None), which the judge counts as such (NaN for the sample, max_unreadable for the call).
@pytest.mark.parametrize(
    "parse, reply",
    [
        (parse_choice, "Image 1 is not better."),
        (parse_choice, "Image 1 is no better than image 2"),
        (parse_choice, "The first image is not preferred."),
        (parse_choice, "I would not choose image 1"),
        (parse_choice, "I can't pick 1 or 2"),
        (parse_choice, "Neither image 1 nor image 2 is better"),
        (parse_choice, "Image 2 isn’t better"),
        (parse_choice, "<answer>Image 1 is not better</answer>"),
        (parse_yes_no, "I can't say yes"),
        (parse_yes_no, "I cannot say no."),
    ],
)
def test_a_negated_or_undecided_verdict_is_unreadable(parse, reply):
    assert parse(reply) is None


@pytest.mark.parametrize(
    "parse, reply, expected",
    [
        (parse_choice, "Image 1 is better", 0),
        (parse_choice, "1", 0),
        (parse_choice, "<answer>2</answer>", 1),
        (parse_choice, "Image 2 is better, image 1 is not.", 1),
        (parse_choice, "Image 1 does not show a cat, so image 2 is better", 1),
        (parse_yes_no, "Yes", 1.0),
        (parse_yes_no, "yes, it does", 1.0),
        (parse_yes_no, "The image does not show a dog. No.", 0.0),
    ],
)
def test_plain_verdicts_beside_a_negation_still_parse(parse, reply, expected):
    assert parse(reply) == expected


# ------------------------------------------------------------------ the templates against the fake server
def test_score_template_sends_the_chat_format_and_parses_each_reply(judge_server):
    replies = {"a red cat": "Score: 7", "a blue dog": "8/10", "a green square": "3"}
    url, stats = judge_server(lambda r: chat(next(v for k, v in replies.items() if k in _text(r))))
    images = _images(3)
    judge = VLMJudge(url=url, model="unified-reward", **FAST)
    prompts = list(replies)
    assert judge(prompts, ["rewritten"] * 3, images) == [7.0, 8.0, 3.0]
    assert stats["paths"] == {"/v1/chat/completions"}
    request = next(r for r in stats["requests"] if "a red cat" in _text(r))
    assert request["model"] == "unified-reward" and request["temperature"] == 0.0 and request["max_tokens"] == 512
    assert "from 1 to 10" in _text(request) and "rewritten" not in _text(request), "the original prompt is judged"
    (pixels,) = _pixels(request)
    torch.testing.assert_close(pixels, images[0], rtol=0, atol=0)  # the data URL holds the exact image


def test_refined_prompt_and_a_custom_instruction(judge_server):
    url, stats = judge_server(lambda r: chat("5"))
    judge = VLMJudge(
        url=url + "/chat/completions", model="m", prompt="refined", instruction="Rate {prompt}: {low}-{high}"
    )
    judge(["orig"], ["the rewrite"], _images(1))
    assert _text(stats["requests"][0]) == "Rate the rewrite: 1-10"


def test_yes_no_template_is_the_fraction_of_yes_over_the_prompts_questions(judge_server):
    answers = {"Is there a cat?": "Yes", "Is the cat red?": "No", "Is there a dog?": "yes"}

    def reply(request: dict) -> tuple[int, bytes]:
        text = _text(request)
        return chat(next((a for q, a in answers.items() if q in text), "yes" if "Does the image show" in text else "?"))

    url, stats = judge_server(reply)
    questions = {"a red cat": ["Is there a cat?", "Is the cat red?"], "a dog": ["Is there a dog?"]}
    judge = VLMJudge(url=url, model="m", template="yes_no", questions=questions, **FAST)
    assert judge(["a red cat", "a dog", "a bird"], ["x"] * 3, _images(3)) == [0.5, 1.0, 1.0]
    assert len(stats["requests"]) == 4, "one request per question; the unlisted prompt gets the default one"
    assert any("Does the image show a bird?" in _text(r) for r in stats["requests"])


def _brighter_wins(request: dict) -> tuple[int, bytes]:
    first, second = _pixels(request)
    return chat("1" if first.mean() > second.mean() else "Image 2")


def test_pairwise_template_is_the_win_rate_within_each_prompts_group(judge_server):
    url, stats = judge_server(_brighter_wins)
    levels = [0.2, 0.8, 0.5, 0.1, 0.9]
    images = torch.stack([torch.full((3, 8, 8), v) for v in levels])
    prompts = ["p", "p", "p", "q", "q"]
    judge = VLMJudge(url=url, model="m", template="pairwise", **FAST)
    # Group p: 0.8 beats both (1.0), 0.5 beats 0.2 (0.5), 0.2 beats none (0.0); group q: 0.9 wins.
    assert judge(prompts, prompts, images) == [0.0, 1.0, 0.5, 0.0, 1.0]
    assert len(stats["requests"]) == 3 + 1, "every pair within a group once, none across groups"
    both = VLMJudge(url=url, model="m", template="pairwise", both_orders=True, **FAST)
    assert both(prompts, prompts, images) == [0.0, 1.0, 0.5, 0.0, 1.0]
    assert len(stats["requests"]) == 4 + 8
    assert judge(["alone"], ["alone"], images[:1]) == [0.5]


# ------------------------------------------------------------------ faults
def test_a_garbled_reply_is_nan_for_that_sample_only(judge_server):
    def reply(request: dict) -> tuple[int, bytes]:
        text = _text(request)
        if "garbage" in text:
            return 200, b"<html>not json</html>"
        if "rambling" in text:
            return chat("It depends on taste.")
        if "wrong shape" in text:
            return 200, json.dumps({"choices": []}).encode()
        return chat("6")

    url, _ = judge_server(reply)
    judge = VLMJudge(url=url, model="m", max_unreadable=0.75, **FAST)
    prompts = ["fine", "garbage", "rambling", "wrong shape"]
    with pytest.warns(UserWarning, match="3 of 4 samples got no score"):
        scores = judge(prompts, prompts, _images(4))
    assert scores[0] == 6.0 and all(math.isnan(s) for s in scores[1:])
    assert judge.failed == 3


def test_a_pair_whose_only_verdict_is_unreadable_gives_both_images_nan(judge_server):
    """The one comparison of a two-image group came back unreadable: neither image won or lost (counting it as
    a win for either, e.g. "the second image wins", would be a reward from nothing); both are NaN and the
    reward's error policy decides."""
    url, stats = judge_server(lambda r: chat("I can't pick 1 or 2"))
    args = {"url": url, "model": "m", "template": "pairwise", "max_unreadable": 1.0, **FAST}
    judge = VLMJudge(**args)
    with pytest.warns(UserWarning, match="2 of 2 samples got no score"):
        scores = judge(["p", "p"], ["p", "p"], _images(2))
    assert len(stats["requests"]) == 1 and all(math.isnan(s) for s in scores), scores
    assert judge.failed == 2
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="reward 'vlm_judge' returned nan for sample 0"):
        WeightedSum({"vlm_judge": 1.0}, {"vlm_judge": args})(["p", "p"], ["p", "p"], _images(2))


def test_a_judge_answering_nonsense_stops_the_call_naming_itself_and_quoting_a_reply(judge_server):
    url, _ = judge_server(lambda r: chat("Score: 15") if "BAD" in _text(r) else chat("7"))
    judge = VLMJudge(url=url, model="m", **FAST)
    with pytest.raises(RewardServerError, match=r"VLM judge .*: 2 of 3 requests gave no score .*'Score: 15'"):
        judge(["a", "BAD1", "BAD2"], ["a"] * 3, _images(3))
    with pytest.warns(UserWarning, match="2 of 3 samples"):
        scores = VLMJudge(url=url, model="m", max_unreadable=0.7, **FAST)(["a", "BAD1", "BAD2"], ["a"] * 3, _images(3))
    assert scores[0] == 7.0
    # Exactly at the threshold still scores: the check is "above".
    with pytest.warns(UserWarning, match="1 of 2 samples"):
        assert VLMJudge(url=url, model="m", **FAST)(["a", "BAD"], ["a"] * 2, _images(2))[0] == 7.0


def test_a_reply_cut_at_max_tokens_is_warned_about(judge_server):
    def cut(request: dict) -> tuple[int, bytes]:
        body = {"choices": [{"message": {"content": "Let me think about the"}, "finish_reason": "length"}]}
        return 200, json.dumps(body).encode()

    url, _ = judge_server(cut)
    with pytest.warns(UserWarning) as caught:
        scores = VLMJudge(url=url, model="m", max_tokens=8, max_unreadable=1.0, **FAST)(["a"], ["a"], _images(1))
    assert any("1 of 1 replies were cut at max_tokens=8" in str(w.message) for w in caught)
    assert math.isnan(scores[0])


def test_a_stalled_request_times_out_to_nan_and_the_others_are_scored(judge_server):
    url, stats = judge_server(lambda r: (0, b"") if "stall" in _text(r) else chat("9"))
    judge = VLMJudge(url=url, model="m", timeout_s=0.3, max_retries=1, backoff_s=0.01, max_concurrency=4)
    start = time.monotonic()
    with pytest.warns(UserWarning, match="1 of 3 samples"):
        scores = judge(["ok", "stall", "ok too"], ["x"] * 3, _images(3))
    elapsed = time.monotonic() - start
    assert scores[0] == 9.0 and math.isnan(scores[1]) and scores[2] == 9.0
    assert sum("stall" in _text(r) for r in stats["requests"]) == 2, "tried once, retried once"
    assert elapsed < 3.0, f"two 0.3 s timeouts should not take {elapsed:.1f} s"


def test_a_server_that_is_down_is_an_error_not_a_batch_of_nans():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed when the block ends: nothing listens there
    judge = VLMJudge(url=f"http://127.0.0.1:{port}/v1", model="m", **FAST)
    with pytest.raises(RewardServerError, match=rf"127.0.0.1:{port}/v1/chat/completions: all 2 requests failed"):
        judge(["a", "b"], ["a", "b"], _images(2))


def test_a_rejected_request_is_an_error_at_once_and_5xx_is_retried(judge_server):
    url, stats = judge_server(lambda r: (404, b'{"error": "model m not found"}'))
    with pytest.raises(RewardServerError, match="rejected the request: HTTP 404.*model m not found"):
        VLMJudge(url=url, model="m", **FAST)(["a"], ["a"], _images(1))
    assert len(stats["requests"]) == 1, "a 4xx is not retried"

    calls = {"n": 0}

    def flaky(request: dict) -> tuple[int, bytes]:
        calls["n"] += 1
        return (503, b"busy") if calls["n"] == 1 else chat("4")

    url, _ = judge_server(flaky)
    assert VLMJudge(url=url, model="m", **FAST)(["a"], ["a"], _images(1)) == [4.0]


def test_no_more_than_max_concurrency_requests_are_in_flight(judge_server):
    def slow(request: dict) -> tuple[int, bytes]:
        time.sleep(0.05)
        return chat("5")

    url, stats = judge_server(slow)
    VLMJudge(url=url, model="m", max_concurrency=3, **FAST)([f"p{i}" for i in range(9)], ["x"] * 9, _images(9))
    assert stats["max_in_flight"] == 3, "three at once: bounded, and actually concurrent"


def test_nan_from_the_judge_goes_through_the_nonfinite_policy(judge_server):
    url, _ = judge_server(lambda r: chat("no idea") if "bad" in _text(r) else chat("8"))
    args = {"vlm_judge": {"url": url, "model": "m", **FAST}}
    prompts = ["good", "bad", "good"]
    with pytest.warns(UserWarning):
        total, parts = WeightedSum({"vlm_judge": 0.5}, args, nonfinite="drop")(prompts, prompts, _images(3))
    assert total[0] == 4.0 and math.isnan(total[1]) and total[2] == 4.0
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="reward 'vlm_judge' returned nan for sample 1"):
        WeightedSum({"vlm_judge": 0.5}, args)(prompts, prompts, _images(3))


def test_an_always_first_judge_gives_the_refined_and_unrefined_samples_equal_reward(judge_server):
    """Rollout order puts a prompt's unrefined samples first; a judge that always answers "1" must not turn
    that order into a reward against the refiner."""
    url, stats = judge_server(lambda r: chat("1"))
    prompts = [f"p{g}" for g in range(16) for _ in range(4)]  # 16 groups: 2 unrefined, then 2 refined
    images = _images(64, seed=3)
    unrefined = [i for i in range(64) if i % 4 < 2]
    refined = [i for i in range(64) if i % 4 >= 2]

    both = VLMJudge(url=url, model="m", template="pairwise", both_orders=True, **FAST)(prompts, prompts, images)
    assert both == [0.5] * 64, "each pair asked both ways: the bias cancels exactly"

    once = VLMJudge(url=url, model="m", template="pairwise", **FAST)(prompts, prompts, images)
    gap = sum(once[i] for i in unrefined) / 32 - sum(once[i] for i in refined) / 32
    # Shown in batch order the first sample of each group would win all 3 of its games and the gap would be 0.5.
    assert abs(gap) < 0.15, gap
    assert len(stats["requests"]) == 16 * 6 * 2 + 16 * 6, "both orders: twice the pairs; otherwise once each"


def test_the_pairwise_order_depends_on_the_pair_not_on_its_place_in_the_batch(judge_server):
    url, stats = judge_server(lambda r: chat("1"))
    images = _images(4, seed=5)
    judge = VLMJudge(url=url, model="m", template="pairwise", **FAST)
    forward = judge(["p"] * 4, ["p"] * 4, images)
    backward = judge(["p"] * 4, ["p"] * 4, images.flip(0))
    assert forward == backward[::-1], "the same images get the same win rates in any batch order"


def test_presets_send_unifiedrewards_formats_and_read_its_replies(judge_server):
    url, stats = judge_server(
        lambda r: chat("Alignment Score (1-5): 5\nCoherence Score (1-5): 4\nStyle Score (1-5): 3")
    )
    judge = VLMJudge(url=url, model="m", preset="unifiedreward", **FAST)
    assert judge(["a cat"], ["a cat"], _images(1)) == [4.0]
    assert "Alignment Score (1-5)" in _text(stats["requests"][0]) and "[a cat]" in _text(stats["requests"][0])

    def think(request: dict) -> tuple[int, bytes]:
        first, second = _pixels(request)
        better = 1 if first.mean() > second.mean() else 2
        return chat(f"<think>Image 1 (6/10) ... Image 2 (8/10)</think>\n<answer>Image {better} is better</answer>")

    url, stats = judge_server(think)
    judge = VLMJudge(url=url, model="m", preset="unifiedreward_think", **FAST)
    levels = torch.stack([torch.full((3, 8, 8), v) for v in (0.2, 0.9, 0.5)])
    assert judge(["p"] * 3, ["p"] * 3, levels) == [0.0, 1.0, 0.5]
    assert stats["requests"][0]["max_tokens"] == 2048 and "<answer>" in _text(stats["requests"][0])
    with pytest.raises(ValueError, match="preset 'unifiedreward' is the 'score' template"):
        VLMJudge(url=url, model="m", preset="unifiedreward", template="pairwise")


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="pairwise template compares the images of one prompt"):
        VLMJudge(url="http://127.0.0.1:1/v1", model="m", template="pairwise", prompt="refined")
    with pytest.raises(ValueError, match="max_unreadable must be in"):
        VLMJudge(url="http://127.0.0.1:1/v1", model="m", max_unreadable=1.5)
    with pytest.raises(ValueError, match="template must be"):
        VLMJudge(url="http://127.0.0.1:1/v1", model="m", template="likert")
    with pytest.raises(ValueError, match="url must start with"):
        VLMJudge(url="127.0.0.1:1", model="m")
    with pytest.raises(ValueError, match="questions must map"):
        VLMJudge(url="http://127.0.0.1:1/v1", model="m", template="yes_no", questions={"p": []})
    with pytest.raises(ValueError, match="api_key_env 'UNIRL_NO_SUCH_KEY' is not set"):
        VLMJudge(url="http://127.0.0.1:1/v1", model="m", api_key_env="UNIRL_NO_SUCH_KEY")(["a"], ["a"], _images(1))


# ------------------------------------------------------------------ acceptance: a fit with a stalling judge
@pytest.mark.integration
def test_a_fit_with_a_stalling_judge_drops_the_stalled_samples_and_trains_on_the_rest(tmp_path, judge_server):
    """Margins that hold on a loaded machine: a stalled request never answers (the server holds it until the
    test ends), and the 5 s deadline is some 1000x a healthy loopback reply. Both stalls fall in the first
    step, whose two chunks of 8 are scored concurrently, so the fit waits for the deadline once."""
    seen, stalled, lock = [0], [0], threading.Lock()

    def reply(request: dict) -> tuple[int, bytes]:
        (pixels,) = _pixels(request)
        with lock:
            seen[0] += 1
            stall = seen[0] in (3, 13)  # two of the first step's 16 requests; the second step's 16 all answer
            stalled[0] += stall
        return (0, b"") if stall else chat(f"Score: {1 + round(9 * float(pixels.mean()))}")

    url, stats = judge_server(reply)
    judge = {"url": url, "model": "judge", "timeout_s": 5.0, "max_retries": 0, "max_concurrency": 8}
    with pytest.warns(UserWarning, match="samples got no score"):
        cli = run_cli(
            tmp_path,
            "--trainer.max_steps=2",
            "--trainer.limit_val_batches=0",
            "--model.rollout.num_steps=4",
            "--model.generator_algorithm.init_args.sde_window=[0,2]",
            "--model.rewards={vlm_judge: 1.0}",
            f"--model.reward_args={{vlm_judge: {json.dumps(judge)}}}",
            "--model.nonfinite_rewards=drop",
        )
    rows = read_metrics(cli)
    dropped = series(rows, "reward/dropped")
    assert dropped == [2.0, 0.0] and stalled[0] == 2, (dropped, stalled)
    assert all(math.isfinite(v) for v in series(rows, "reward/vlm_judge")), "the others were scored"
    assert cli.model.ledger["transformer"] == 2 and cli.model.ledger["llm"] == 2, "both steps trained"
    assert len(stats["requests"]) == 2 * 16, "one request per image of the tiny recipe's 4 x 4 samples"


def test_a_judge_that_drips_its_reply_is_cut_off_at_the_deadline():
    """Headers at once, then the body a byte every 0.3 s: one attempt may take timeout_s, body included."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    done = threading.Event()

    def drip() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 400\r\n\r\n")
            while not done.wait(0.3):
                try:
                    conn.sendall(b" ")
                except OSError:
                    return

    threading.Thread(target=drip, daemon=True).start()
    judge = VLMJudge(url=f"http://127.0.0.1:{server.getsockname()[1]}/v1", model="m", timeout_s=1.0, max_retries=0)
    start = time.monotonic()
    with pytest.raises(RewardServerError, match="all 1 requests failed"):
        judge(["a"], ["a"], _images(1))
    done.set()
    server.close()
    assert time.monotonic() - start < 2.0


def test_a_redirect_to_another_origin_never_receives_the_token(judge_server, monkeypatch):
    """A judge answering 302 to another host:port: the request is not followed, the token never leaves."""
    other_url, other = judge_server(lambda r: chat("9"))
    seen_auth: list[str | None] = []

    class Redirect(QuietHandler):
        def do_POST(self) -> None:  # noqa: N802
            seen_auth.append(self.headers.get("Authorization"))
            self.send_response(302)
            self.send_header("Location", other_url + "/chat/completions")
            self.send_header("Content-Length", "0")
            self.end_headers()

    server = serve_loopback(Redirect)
    monkeypatch.setenv("UNIRL_JUDGE_KEY", "secret-token")
    judge = VLMJudge(url=f"http://127.0.0.1:{server.server_address[1]}/v1", model="m", api_key_env="UNIRL_JUDGE_KEY")
    try:
        with pytest.raises(RewardServerError, match="redirect"):
            judge(["a", "b"], ["a", "b"], _images(2))
    finally:
        close_servers([server])
    assert seen_auth and all(a == "Bearer secret-token" for a in seen_auth), "the configured URL gets the token"
    assert other["requests"] == [], "the redirect target got nothing"
