"""``Retry-After`` in the reward clients' transport, on loopback: a 429/503's wait replaces the backoff, a
wait past the time budget fails at once saying what the server asked, and a garbled value (or one on
another status) leaves the backoff in charge. Through ``post``, ``HTTPReward`` and ``VLMJudge``."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from tests.test_http_reward import Scripted
from unirl_pl.rewards.http import HTTPReward
from unirl_pl.rewards.transport import TransportFailed, post, retry_after_s
from unirl_pl.rewards.vlm_judge import VLMJudge

OK = b'{"scores": [0.25]}'


def _raw(status: str, body: bytes = b"busy", retry_after: str | None = None) -> bytes:
    header = "" if retry_after is None else f"Retry-After: {retry_after}\r\n"
    return f"HTTP/1.1 {status}\r\n{header}Content-Length: {len(body)}\r\n\r\n".encode() + body


def _in_order(*replies: bytes | None) -> Callable[[socket.socket, int, threading.Event], None]:
    """The n-th request gets the n-th reply (the last one after that); None drops the connection unanswered."""

    def respond(conn: socket.socket, index: int, stop: threading.Event) -> None:
        raw = replies[min(index, len(replies) - 1)]
        if raw is not None:
            conn.sendall(raw)

    return respond


@pytest.fixture
def peer() -> Iterator[Callable[..., Scripted]]:
    peers: list[Scripted] = []

    def start(*replies: bytes | None) -> Scripted:
        peers.append(Scripted(_in_order(*replies)))
        return peers[-1]

    yield start
    for one in peers:
        one.close()


@pytest.mark.parametrize("status", ["429 Too Many Requests", "503 Service Unavailable"])
def test_the_retry_waits_as_long_as_retry_after_asks(peer, status: str):
    server = peer(_raw(status, retry_after="1"), _raw("200 OK", OK))
    reward = HTTPReward(server.url, timeout_s=2.0, max_retries=2, backoff_s=0.01)  # the backoff alone: 0.01 s
    start = time.monotonic()
    assert reward(["p"], ["r"], _blank()) == [0.25]
    assert 0.95 <= time.monotonic() - start < 4.0 and len(server.requests) == 2  # upper: room for a loaded CI


def test_a_wait_past_the_budget_fails_at_once_saying_what_was_asked(peer):
    server = peer(_raw("429 Too Many Requests", retry_after="100"), _raw("200 OK", OK))
    start = time.monotonic()
    with pytest.raises(TransportFailed, match=r"asked to wait 100 s .*Retry-After.* left of the 5 s") as err:
        post(server.url, b"{}", deadline_s=1.0, max_retries=3, backoff_s=0.01, total_s=5.0)
    assert time.monotonic() - start < 3.0, "it must not sleep before failing (the budget left is 5 s)"
    assert (err.value.attempts, err.value.status, len(server.requests)) == (1, 429, 1)
    assert "HTTP 429 Too Many Requests: busy" in str(err.value)


@pytest.mark.parametrize("value", ["soon", "-1", "1.5", "", "9" * 400, "1, 2"])
def test_a_garbled_retry_after_falls_back_to_the_backoff(peer, value: str):
    # A value read as 0 would retry at once, one read as a long wait would fail: only the backoff gives 0.3 s.
    server = peer(_raw("429 Too Many Requests", retry_after=value), _raw("200 OK", OK))
    start = time.monotonic()
    assert post(server.url, b"{}", deadline_s=2.0, max_retries=1, backoff_s=0.3, total_s=5.0) == OK
    assert 0.28 <= time.monotonic() - start < 1.5 and len(server.requests) == 2


def test_retry_after_on_another_status_is_ignored(peer):
    # A 500 is retried after the backoff whatever its header says; read as a wait, 100 s would fail at once.
    server = peer(_raw("500 Internal Server Error", retry_after="100"), _raw("200 OK", OK))
    assert post(server.url, b"{}", deadline_s=1.0, max_retries=1, backoff_s=0.01, total_s=5.0) == OK
    assert len(server.requests) == 2


def test_retry_after_sets_only_the_next_wait(peer):
    # 0 s after the 429, then the dropped connection waits the second backoff (2 * 1 s), not the 429's 0 s:
    # 2 s in all (the backoff after the 429 too would make it 3 s; the 429's 0 s twice, 0 s).
    server = peer(_raw("429 Too Many Requests", retry_after="0"), None, _raw("200 OK", OK))
    start = time.monotonic()
    assert post(server.url, b"{}", deadline_s=1.0, max_retries=2, backoff_s=1.0, total_s=8.0) == OK
    assert 1.95 <= time.monotonic() - start < 2.8 and len(server.requests) == 3


def test_an_http_date_is_a_wait_until_then(peer):
    # Past: retry at once (the backoff would be 3 s). Far ahead: over the budget, so it fails at once.
    past = peer(_raw("503 Service Unavailable", retry_after="Wed, 21 Oct 2015 07:28:00 GMT"), _raw("200 OK", OK))
    start = time.monotonic()
    assert post(past.url, b"{}", deadline_s=1.0, max_retries=1, backoff_s=3.0) == OK
    assert time.monotonic() - start < 2.5 and len(past.requests) == 2
    future = peer(_raw("503 Service Unavailable", retry_after="Fri, 01 Jan 2100 00:00:00 GMT"), _raw("200 OK", OK))
    with pytest.raises(TransportFailed, match="asked to wait"):
        post(future.url, b"{}", deadline_s=1.0, max_retries=1, backoff_s=0.01, total_s=5.0)
    assert len(future.requests) == 1


def test_retry_after_values_are_read_as_the_rfc_writes_them():
    assert retry_after_s("120") == 120.0 and retry_after_s(" 0 ") == 0.0
    assert 3590 < (retry_after_s(_http_date(time.time() + 3600)) or 0) <= 3600
    for garbage in (None, "", "soon", "-1", "1.5", "1e3", "9" * 5000, "Mon, 32 Foo 2000"):
        assert retry_after_s(garbage) is None, garbage


def test_the_vlm_judge_honors_retry_after(peer):
    reply = json.dumps({"choices": [{"message": {"role": "assistant", "content": "7"}}]}).encode()
    server = peer(_raw("429 Too Many Requests", retry_after="1"), _raw("200 OK", reply))
    judge = VLMJudge(url=server.url + "v1", model="m", timeout_s=2.0, max_retries=1, backoff_s=0.01)
    start = time.monotonic()
    assert judge(["a"], ["a"], _blank()) == [7.0]
    assert time.monotonic() - start >= 0.95 and len(server.requests) == 2


def _http_date(epoch: float) -> str:
    return time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(epoch))


def _blank() -> torch.Tensor:
    return torch.zeros(1, 3, 8, 8)
