"""HTTP reward client and reference server, on loopback only, with every server closed by its fixture."""

import json
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from unirl_pl.rewards import Brightness, WeightedSum
from unirl_pl.rewards.http import HTTPReward, RewardServerError, decode_images, encode_images
from unirl_pl.rewards.server import serve

# Small enough that no test waits on the network for long, large enough for a loaded CI runner.
FAST = {"timeout_s": 2.0, "max_retries": 2, "backoff_s": 0.01}


def _images(n: int, seed: int = 0, size: int = 16) -> torch.Tensor:
    # Exact multiples of 1/255, so the 8-bit PNG round trip loses nothing and scores match exactly.
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, size, size), generator=g).float() / 255


@pytest.fixture
def reference_server() -> Iterator[str]:
    server = serve("brightness", host="127.0.0.1", port=0)
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
        lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    index = calls[0]
                    calls[0] += 1
                status, body = reply(index, request)
                if status == 0:  # hang until the client has given up, then drop the connection
                    release.wait(timeout=5)
                    return
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        server.calls = calls  # type: ignore[attr-defined]
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/"

    start.servers = servers  # type: ignore[attr-defined]
    yield start
    release.set()
    for server in servers:
        server.shutdown()
        server.server_close()


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


def test_client_error_is_not_retried(custom_server):
    url = custom_server(lambda index, request: (404, b'{"error": "no such route"}'))
    with pytest.raises(RewardServerError, match="after 1 attempt: HTTP 404.*no such route") as err:
        HTTPReward(url, **FAST)(["p"], ["r"], _images(1))
    assert url in str(err.value)
    assert custom_server.servers[0].calls[0] == 1


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
