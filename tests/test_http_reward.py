"""HTTP reward client, its transport (deadline, retries, redirects, reply cap, proxies) and the reference
server, on loopback only, with every server closed by its fixture."""

import json
import pickle
import re
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from http.server import ThreadingHTTPServer

import pytest
import torch

from tests.helpers import QuietHandler, close_servers, serve_loopback
from unirl_pl.rewards import Brightness, WeightedSum, transport
from unirl_pl.rewards.http import HTTPReward, RewardServerError, decode_images, encode_images
from unirl_pl.rewards.server import serve
from unirl_pl.rewards.transport import RequestRejected, TransportFailed, post, retry_budget

# Small enough that no test waits on the network for long, large enough for a loaded CI runner.
FAST = {"timeout_s": 2.0, "max_retries": 2, "backoff_s": 0.01}


def _images(n: int, seed: int = 0, size: int = 16) -> torch.Tensor:
    # Exact multiples of 1/255, so the 8-bit PNG round trip loses nothing and scores match exactly.
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, size, size), generator=g).float() / 255


@pytest.fixture(scope="module")
def reference_server() -> Iterator[str]:
    server = serve("brightness", host="127.0.0.1", port=0)  # one per module: each start spawns LitServe's worker
    yield server.url
    server.close()


Reply = Callable[[int, dict], tuple[int, bytes]]


@pytest.fixture
def custom_server() -> Iterator[Callable[[Reply], str]]:
    """Factory: a loopback server answering each POST with ``reply(call_index, request) -> (status, body)``.

    A reply may block on ``release`` (to simulate a hung server); the finalizer sets it so no
    handler thread outlives the test, then shuts every server down.
    """
    servers: list[ThreadingHTTPServer] = []
    release = threading.Event()

    def start(reply: Reply) -> str:
        calls = [0]
        seen: list[dict[str, str]] = []  # each request's headers
        lock = threading.Lock()

        class Handler(QuietHandler):
            def do_POST(self) -> None:  # noqa: N802
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    index = calls[0]
                    calls[0] += 1
                    seen.append(dict(self.headers))
                status, body = reply(index, request)
                if status == 0:  # hang until the client has given up, then drop the connection
                    release.wait(timeout=5)
                    return
                self.answer(status, body)

        server = serve_loopback(Handler)
        server.calls = calls  # type: ignore[attr-defined]
        server.seen = seen  # type: ignore[attr-defined]
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/"

    start.servers = servers  # type: ignore[attr-defined]
    yield start
    release.set()
    close_servers(servers)


def _ok(request: dict) -> bytes:
    return json.dumps({"scores": [0.5] * len(request["prompts"])}).encode()


def test_round_trip_matches_direct_call(reference_server: str):
    images = _images(5)
    prompts, refined = [f"p{i}" for i in range(5)], [f"r{i}" for i in range(5)]
    reward = HTTPReward(reference_server, batch_size=2, **FAST)  # 3 requests: 2 + 2 + 1
    remote = reward(prompts, refined, images)
    direct = Brightness()(prompts, refined, images)
    assert len(remote) == 5
    assert remote == pytest.approx(direct, abs=1e-6)


def test_registry_and_weighted_sum(reference_server: str):
    images = _images(3, seed=1)
    total, parts = WeightedSum({"http": 2.0}, {"http": {"url": reference_server, **FAST}})(["a"] * 3, ["b"] * 3, images)
    assert torch.allclose(total, 2 * torch.tensor(Brightness()(["a"] * 3, ["b"] * 3, images)), atol=1e-6)
    assert set(parts) == {"http"}


def _open(url: str, data: bytes | None = None):
    # No proxy from the environment may intercept loopback requests.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    return opener.open(urllib.request.Request(url, data=data), timeout=2)


def test_health_endpoint(reference_server: str):
    with _open(reference_server + "health") as reply:
        assert json.loads(reply.read()) == {"status": "ok", "reward": "brightness"}


def test_reference_server_rejects_bad_request(reference_server: str):
    body = json.dumps({"prompts": ["a", "b"], "refined_prompts": ["a"], "images": encode_images(_images(2))})
    with pytest.raises(urllib.error.HTTPError) as err:
        _open(reference_server, body.encode())
    assert err.value.code == 400
    assert "2 prompts, 1 refined prompts and 2 images differ" in err.value.read().decode()


@pytest.mark.parametrize("status", [400, 401, 404, 413])
def test_client_error_is_not_retried(custom_server, status: int):
    url = custom_server(lambda index, request: (status, b'{"error": "no such route"}' + b"x" * 1000))
    with pytest.raises(RequestRejected, match=f"rejected the request: HTTP {status}.*no such route") as err:
        HTTPReward(url, **FAST)(["p"], ["r"], _images(1))
    assert url in str(err.value) and err.value.status == status and err.value.url == url
    assert "x" * 250 in str(err.value) and "x" * 300 not in str(err.value), "the first 300 bytes of the body"
    assert custom_server.servers[0].calls[0] == 1


@pytest.mark.parametrize("status", [500, 502, 503, 408, 429])
def test_server_errors_timeouts_and_throttling_are_retried(custom_server, status: int):
    url = custom_server(lambda index, request: (status, b"busy"))
    with pytest.raises(TransportFailed, match=f"after 3 attempts .*HTTP {status} .*: busy") as err:
        HTTPReward(url, **FAST)(["p"], ["r"], _images(1))
    assert url in str(err.value) and err.value.attempts == 3 and err.value.status == status
    assert custom_server.servers[0].calls[0] == 3


def test_encode_decode_video_round_trip():
    video = torch.randint(0, 256, (2, 3, 3, 8, 8)).float() / 255
    encoded = encode_images(video)
    assert isinstance(encoded[0], list) and len(encoded[0]) == 3
    assert torch.equal(decode_images(encoded), video)
    with pytest.raises(ValueError, match="not a base64-encoded image"):
        decode_images(["!!!"])


@pytest.mark.parametrize("first", ["hang", "503"])
def test_retries_then_succeeds(custom_server, first: str):
    def reply(index: int, request: dict) -> tuple[int, bytes]:
        if index == 0:
            return (0, b"") if first == "hang" else (503, b"busy")
        return 200, _ok(request)

    url = custom_server(reply)
    reward = HTTPReward(url, timeout_s=0.5, max_retries=2, backoff_s=0.01)
    assert reward(["a", "b"], ["a", "b"], _images(2)) == [0.5, 0.5]
    assert custom_server.servers[0].calls[0] == 2


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b"<html>oops</html>", "non-JSON"),
        (b'{"scores": [1.0, 2.0, 3.0]}', "returned 3 scores for 4 images"),
        (b'{"scores": [1.0, NaN, 3.0, 4.0]}', "invalid score at index 1: nan"),
        (b'{"scores": [1.0, "2", 3.0, 4.0]}', "invalid score at index 1"),
        (b'{"score": [1.0, 2.0, 3.0, 4.0]}', "no 'scores' key"),
        (b"[1.0, 2.0, 3.0, 4.0]", "no 'scores' key"),
    ],
)
def test_garbage_reply_is_a_clear_error(custom_server, body: bytes, expected: str):
    url = custom_server(lambda index, request: (200, body))
    with pytest.raises(RewardServerError, match=expected) as err:
        HTTPReward(url, **FAST)(["p"] * 4, ["r"] * 4, _images(4))
    assert url in str(err.value)
    assert custom_server.servers[0].calls[0] == 1  # a malformed reply is not retried


def test_server_down_fails_after_retries():
    with socket.socket() as sock:  # a port that was just free and now has no listener
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}/"
    with pytest.raises(RewardServerError, match="after 3 attempts") as err:
        HTTPReward(url, **FAST)(["p"], ["r"], _images(1))
    assert url in str(err.value) and "Connection" in str(err.value)


def test_client_validates_arguments():
    with pytest.raises(ValueError, match="http:// or https://"):
        HTTPReward("127.0.0.1:8000")
    with pytest.raises(ValueError, match="image_format"):
        HTTPReward("http://127.0.0.1:1/", image_format="bmp")


def test_the_reward_pickles_and_keeps_no_connection(reference_server: str):
    reward = pickle.loads(pickle.dumps(HTTPReward(reference_server, **FAST)))
    images = _images(2, seed=4)
    assert reward(["a", "b"], ["a", "b"], images) == pytest.approx(Brightness()([""] * 2, [""] * 2, images), abs=1e-6)
    err = pickle.loads(pickle.dumps(TransportFailed("down", "http://h/", 3, 503)))
    assert (str(err), err.url, err.attempts, err.status) == ("down", "http://h/", 3, 503)


# ------------------------------------------------------------------ transport: scripted peers
class Scripted:
    """A loopback TCP peer: reads each HTTP request (head and Content-Length body), records its head, then
    lets ``respond(conn, index, stop)`` write whatever it likes, byte by byte if it wants."""

    def __init__(self, respond: Callable[[socket.socket, int, threading.Event], None]) -> None:
        self.respond, self.requests, self.stop = respond, [], threading.Event()
        self._lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.05)
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listener.getsockname()[1]}/"

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5)
            data = b""
            try:
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                head, _, body = data.partition(b"\r\n\r\n")
                text = head.decode("latin-1")
                lengths = [
                    line.split(":")[1] for line in text.split("\r\n") if line.lower().startswith("content-length")
                ]
                length = int(lengths[0]) if lengths else 0
                while len(body) < length:
                    body += conn.recv(65536)
                with self._lock:
                    index = len(self.requests)
                    self.requests.append(text)
                self.respond(conn, index, self.stop)
            except OSError:  # the client gave up: what this peer is for
                pass

    def seen(self, count: int, timeout_s: float = 5.0) -> int:
        """How many requests this peer has read, once ``count`` are or ``timeout_s`` has passed: on a loaded
        machine its threads may read the last request the client sent (and gave up on) after the client's error."""
        end = time.monotonic() + timeout_s
        while len(self.requests) < count and time.monotonic() < end:
            time.sleep(0.01)
        return len(self.requests)

    def close(self) -> None:
        self.stop.set()
        self.listener.close()


@pytest.fixture
def scripted() -> Iterator[Callable[..., Scripted]]:
    peers: list[Scripted] = []

    def start(respond: Callable[[socket.socket, int, threading.Event], None]) -> Scripted:
        peers.append(Scripted(respond))
        return peers[-1]

    yield start
    for peer in peers:
        peer.close()


def _drip_body(conn: socket.socket, index: int, stop: threading.Event) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n")
    while not stop.wait(0.3):
        conn.sendall(b" ")


def _drip_headers(conn: socket.socket, index: int, stop: threading.Event) -> None:
    for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 100:
        if stop.wait(0.3):
            return
        conn.sendall(bytes([byte]))


def _reply(raw: bytes) -> Callable[[socket.socket, int, threading.Event], None]:
    def respond(conn: socket.socket, index: int, stop: threading.Event) -> None:
        conn.sendall(raw)

    return respond


@pytest.mark.parametrize("drip", [_drip_body, _drip_headers], ids=["body", "headers"])
def test_a_trickling_reply_fails_at_the_deadline(scripted, drip):
    # A byte every 0.3 s never idles a read for 1 s: only a deadline over the whole reply ends it.
    peer = scripted(drip)
    start = time.monotonic()
    with pytest.raises(TransportFailed, match="after 1 attempt .*no complete reply within the 1 s deadline") as err:
        HTTPReward(peer.url, timeout_s=1.0, max_retries=0)(["p"], ["r"], _images(1))
    assert time.monotonic() - start < 5.0  # the drip alone lasts 30 s; the margin is for a loaded CI
    assert peer.url in str(err.value) and len(peer.requests) == 1


def test_retries_stay_within_the_documented_budget(scripted):
    peer = scripted(_drip_body)
    budget = retry_budget(0.5, 2, 0.05)  # 3 deadlines of 0.5 s and waits of 0.05 s and 0.1 s
    start = time.monotonic()
    with pytest.raises(TransportFailed, match="after 3 attempts"):
        HTTPReward(peer.url, timeout_s=0.5, max_retries=2, backoff_s=0.05)(["p"], ["r"], _images(1))
    assert budget - 0.1 < time.monotonic() - start < budget + 0.4
    assert peer.seen(3) == 3


def test_an_explicit_total_budget_cuts_the_retries_short(scripted):
    peer = scripted(_drip_body)
    with pytest.raises(TransportFailed, match="the 0.8 s time budget leaves no room for another attempt") as err:
        post(peer.url, b"{}", deadline_s=0.5, max_retries=5, backoff_s=0.05, total_s=0.8)
    # 0.5 s, a 0.05 s wait, then the second attempt gets only what is left of the 0.8 s (the error says so, with
    # the deadline it was cut to); no third one.
    cut = re.search(
        r"no complete reply within the 0.5 s deadline \(this attempt cut to (\d+\.\d+) s by the 0.8 s time budget, "
        r"total_s\)",
        str(err.value),
    )
    assert cut is not None and 0 < float(cut.group(1)) < 0.5, str(err.value)
    assert err.value.attempts == 2 and peer.seen(2) == 2


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_is_never_followed(scripted, custom_server, status: int):
    elsewhere = custom_server(lambda index, request: (200, _ok(request)))  # another origin: another port
    peer = scripted(_reply(f"HTTP/1.1 {status} Moved\r\nLocation: {elsewhere}\r\nContent-Length: 0\r\n\r\n".encode()))
    reward = HTTPReward(peer.url, headers={"Authorization": "Bearer secret"}, **FAST)
    with pytest.raises(RequestRejected, match=f"HTTP {status} Moved redirecting to '{elsewhere}'.*not followed") as err:
        reward(["p"], ["r"], _images(1))
    assert err.value.status == status and peer.url in str(err.value)
    assert custom_server.servers[0].calls[0] == 0 and custom_server.servers[0].seen == []
    assert len(peer.requests) == 1 and "Authorization: Bearer secret" in peer.requests[0]


def test_a_reply_declared_over_the_cap_is_refused_unread(scripted):
    # It declares 1 GB and sends one byte: refused from the header at once, not waited for.
    peer = scripted(_reply(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000000\r\n\r\n{"))
    start = time.monotonic()
    with pytest.raises(RewardServerError, match="larger than the 1000-byte cap") as err:
        HTTPReward(peer.url, max_reply_bytes=1000, **FAST)(["p"], ["r"], _images(1))
    assert not isinstance(err.value, TransportFailed | RequestRejected)
    assert time.monotonic() - start < 1.8 and len(peer.requests) == 1  # waiting for the body: 2 s x 3 attempts


@pytest.mark.parametrize(
    "raw",
    [
        b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + b" " * 5000,
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"400\r\n" + b" " * 1024 + b"\r\n" + b"0\r\n\r\n",
    ],
    ids=["until-close", "chunked"],
)
def test_a_reply_sent_over_the_cap_is_refused(scripted, raw: bytes):
    peer = scripted(_reply(raw))
    with pytest.raises(RewardServerError, match="larger than the 1000-byte cap"):
        post(peer.url, b"{}", deadline_s=2.0, max_reply_bytes=1000)
    assert len(peer.requests) == 1


def test_a_reply_at_the_cap_is_accepted(scripted):
    body = json.dumps({"scores": [0.25]}).encode()
    peer = scripted(_reply(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body))
    assert HTTPReward(peer.url, max_reply_bytes=len(body), **FAST)(["p"], ["r"], _images(1)) == [0.25]


def test_a_truncated_reply_is_retried(scripted):
    peer = scripted(_reply(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b'{"scores": [1]}'))
    with pytest.raises(TransportFailed, match="after 2 attempts .*IncompleteRead"):
        post(peer.url, b"{}", deadline_s=2.0, max_retries=1, backoff_s=0.01)
    assert len(peer.requests) == 2


# ------------------------------------------------------------------ transport: proxies from the environment
PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy", "no_proxy")


@pytest.fixture
def clean_proxy_env(monkeypatch) -> pytest.MonkeyPatch:
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    return monkeypatch


def _free_port() -> int:
    with socket.socket() as sock:  # a port that was just free and now has no listener
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_loopback_bypasses_the_environment_proxy(clean_proxy_env, reference_server: str):
    clean_proxy_env.setenv("http_proxy", f"http://127.0.0.1:{_free_port()}")  # a proxy that is down
    images = _images(1)
    assert HTTPReward(reference_server, **FAST)(["p"], ["r"], images) == pytest.approx(
        Brightness()(["p"], ["r"], images), abs=1e-6
    )


def test_another_host_goes_through_the_http_proxy(clean_proxy_env, scripted):
    proxy = scripted(_reply(b'HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n{"ok": 1}'))
    clean_proxy_env.setenv("http_proxy", proxy.url.replace("http://", "http://user:pw@"))
    assert post("http://reward.invalid:8000/score?x=1", b"{}", deadline_s=2.0) == b'{"ok": 1}'
    head = proxy.requests[0]
    assert head.startswith("POST http://reward.invalid:8000/score?x=1 HTTP/1.1\r\n")
    assert "Host: reward.invalid:8000" in head and "Proxy-Authorization: Basic dXNlcjpwdw==" in head


def test_https_through_a_proxy_is_tunnelled_without_the_request_headers(clean_proxy_env, scripted):
    proxy = scripted(_reply(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n"))
    clean_proxy_env.setenv("https_proxy", proxy.url)
    with pytest.raises(TransportFailed, match="Tunnel connection failed: 403"):
        post("https://reward.invalid/v1", b"{}", {"Authorization": "Bearer secret"}, deadline_s=2.0)
    assert proxy.requests[0].startswith("CONNECT reward.invalid:443 HTTP/1.") and "secret" not in proxy.requests[0]


def test_no_proxy_is_honored(clean_proxy_env, scripted):
    proxy = scripted(_reply(b""))
    clean_proxy_env.setenv("http_proxy", proxy.url)
    parts = urllib.parse.urlsplit("http://reward.invalid:8000/score")
    deadline = time.monotonic() + 1
    assert transport._connection(parts, deadline)[0].host == "127.0.0.1"  # the proxy
    clean_proxy_env.setenv("no_proxy", "reward.invalid")
    conn, target, _ = transport._connection(parts, deadline)
    assert (conn.host, conn.port, target) == ("reward.invalid", 8000, "/score")  # direct


def test_post_validates_its_arguments():
    with pytest.raises(ValueError, match="http:// or https://"):
        post("ftp://127.0.0.1/", b"", deadline_s=1.0)
    with pytest.raises(ValueError, match="deadline_s > 0"):
        post("http://127.0.0.1:1/", b"", deadline_s=0)
    assert transport.is_loopback("127.0.0.2") and transport.is_loopback("::1") and transport.is_loopback("localhost")
    assert not transport.is_loopback("10.0.0.1") and not transport.is_loopback("127.example.com")
