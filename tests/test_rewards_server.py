"""The reference server serving registered rewards: concurrent requests batched into one reward call,
served PickScore equal to PickScore in process, every refused request (its status, its JSON error, the
connection closed, a concurrent good request still scored right), and (integration) a 2-step fit on the
tiny SD3 pipeline whose rewards through the server equal the in-process ones."""

from __future__ import annotations

import base64
import importlib
import io
import json
import math
import socket
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from PIL import Image

from tests.helpers import ROOT
from tests.pipelines import make_sd3_pipeline
from tests.test_rewards_clip import PROMPTS, _config, _save_processor
from unirl_pl.cli import main
from unirl_pl.rewards import Brightness, HTTPReward
from unirl_pl.rewards.batcher import RequestBatcher
from unirl_pl.rewards.clip_models import PickScore
from unirl_pl.rewards.http import encode_images
from unirl_pl.rewards.server import RewardHTTPServer, serve
from unirl_pl.rewards.server import main as server_main

FAST = {"timeout_s": 10.0, "max_retries": 1, "backoff_s": 0.01}
HERE = "tests.test_rewards_server"


def _images(n: int, seed: int = 0, size: int = 32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, size, size), generator=g).float() / 255


def test_concurrent_requests_are_scored_in_one_call_and_split_back():
    server = serve("brightness", max_batch_size=64, batch_wait_s=0.5)
    try:
        client = HTTPReward(server.url, **FAST)
        results: dict[int, list[float]] = {}
        batches = {i: _images(2, seed=i, size=8) for i in range(4)}

        def call(i: int) -> None:
            results[i] = client([f"p{i}"] * 2, [f"r{i}"] * 2, batches[i])

        threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=20)
        for i in range(4):
            assert results[i] == pytest.approx(Brightness()([""] * 2, [""] * 2, batches[i]), abs=1e-6)
        calls = server.batcher.calls  # samples per reward call
        assert sum(calls) == 8 and len(calls) < 4, calls
    finally:
        server.close()


def test_the_batcher_keeps_image_sizes_apart_and_respects_the_batch_limit():
    sizes: list[tuple[int, int]] = []

    def reward(prompts, refined, images):
        sizes.append((len(prompts), images.shape[-1]))
        return images.mean(dim=(1, 2, 3)).tolist()

    batcher = RequestBatcher(reward, "r", max_size=4, wait_s=0.3)
    try:
        jobs = [(3, 8), (1, 8), (2, 16), (2, 8)]
        out: dict[int, tuple] = {}
        threads = []
        for i, (n, size) in enumerate(jobs):
            t = threading.Thread(
                target=lambda i=i, n=n, s=size: out.__setitem__(
                    i, batcher.score(["p"] * n, ["r"] * n, _images(n, i, s))
                )
            )
            threads.append(t)
            t.start()
            t.join(timeout=0.05)  # arrive in order, within one batch window
        for t in threads:
            t.join(timeout=10)
        assert all(out[i][1] is None and len(out[i][0]) == n for i, (n, _) in enumerate(jobs))
        assert all(n <= 4 for n, _ in sizes) and sum(n for n, _ in sizes) == 8
        assert all(len({s}) == 1 for _, s in sizes)
        assert (3 + 1, 8) in sizes, "the first two requests (same size, 4 samples) were scored together"
    finally:
        batcher.close()


def test_a_failing_reward_fails_its_request():
    def broken(prompts, refined, images):
        raise RuntimeError("out of memory")

    batcher = RequestBatcher(broken, "broken", wait_s=0.0)
    try:
        scores, error = batcher.score(["p"], ["r"], _images(1, size=8))
        assert scores is None and "reward 'broken' failed: RuntimeError: out of memory" in error
    finally:
        batcher.close()


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--reward", "brightness", "--reward-args", "{channel: 0"], "--reward-args is not JSON"),
        (["--reward", "brightness", "--reward-args", "[0]"], "--reward-args must be a JSON object"),
        (["--reward", "no_such_reward"], "unknown reward 'no_such_reward'"),
        (["--reward", "brightness", "--reward-args", '{"colour": 0}'], "bad reward_args"),
        (["--reward", "brightness", "--reward-args", '{"channel": 7}'], "channel must be 0, 1, 2 or None"),
        (["--reward", "brightness", "--read-timeout-s", "0"], "read_timeout_s > 0"),
    ],
)
def test_the_command_line_refuses_a_bad_start_in_one_line(capsys, argv: list[str], expected: str):
    with pytest.raises(SystemExit) as exit_:
        server_main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert expected in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_the_command_line_names_every_limit(capsys):
    with pytest.raises(SystemExit):
        server_main(["--help"])
    out = capsys.readouterr().out
    for flag in ("--max-body-mb", "--read-timeout-s", "--max-image-pixels", "--max-request-pixels"):
        assert flag in out


# ------------------------------------------------------------------ refused requests
# Each test sends one faulty request over a raw socket while a good request runs on another thread; the
# fault must get its status and a JSON error on a connection the server then closes, and the good
# request its right scores. The limits are small so that no test waits long.
LIMITS = {
    "max_body_bytes": 200_000,
    "read_timeout_s": 0.5,
    "max_image_pixels": 32 * 32,
    "max_total_pixels": 16 * 16 * 8,
}


@pytest.fixture
def start_server() -> Iterator[Callable[..., RewardHTTPServer]]:
    """Factory: a running RewardHTTPServer on a free loopback port, with ``LIMITS`` unless given."""
    servers: list[RewardHTTPServer] = []

    def start(reward: Any = None, name: str = "brightness", **kwargs: Any) -> RewardHTTPServer:
        server = RewardHTTPServer(("127.0.0.1", 0), reward or Brightness(), name, **{**LIMITS, **kwargs})
        server.thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        server.thread.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


def _address(url: str) -> tuple[str, int]:
    host, port = url.split("//")[1].rstrip("/").split(":")
    return host, int(port)


def _exchange(
    url: str, data: bytes, drip: bytes = b"", drip_every_s: float = 0.2, timeout: float = 5.0
) -> tuple[int, dict[str, str], Any, float]:
    """Send ``data`` (then ``drip`` one byte at a time) and read the reply until the server closes the
    connection: (status, headers, the body as JSON, seconds until the connection closed). A server that
    keeps the connection open fails the test by the socket timeout."""
    with socket.create_connection(_address(url), timeout=timeout) as sock:
        start = time.monotonic()
        sock.sendall(data)
        answered = threading.Event()

        def trickle() -> None:
            for byte in drip:
                if answered.wait(drip_every_s):
                    return
                try:
                    sock.sendall(bytes([byte]))
                except OSError:
                    return

        dripper = threading.Thread(target=trickle, daemon=True)
        dripper.start()
        raw = b""
        while chunk := sock.recv(65536):  # raises TimeoutError if the connection stays open
            raw += chunk
            answered.set()
        answered.set()
        elapsed = time.monotonic() - start
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return status, headers, json.loads(body), elapsed


def _post_bytes(body: bytes, extra: str = "", length: int | str | None = None) -> bytes:
    """A raw POST of ``body`` with ``Content-Length: length`` (default: the body's; "" for none)."""
    declared = "" if length == "" else f"Content-Length: {len(body) if length is None else length}\r\n"
    head = f"POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{declared}{extra}\r\n"
    return head.encode() + body


def _request(images: list[Any], prompts: Any = None, refined: Any = None) -> bytes:
    n = len(images)
    prompts = [f"p{i}" for i in range(n)] if prompts is None else prompts
    refined = [f"r{i}" for i in range(n)] if refined is None else refined
    return json.dumps({"prompts": prompts, "refined_prompts": refined, "images": images}).encode()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _pil(fmt: str, size: int = 16) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), (10, 200, 30)).save(buf, format=fmt)
    return _b64(buf.getvalue())


def _png_header(width: int, height: int, idat: bytes = b"not a zlib stream") -> str:
    """A PNG declaring width x height, cheap to build whatever the size. With the default data, decoding
    fails (400), so only a check on the header made before decoding can refuse it as too large (413)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit grayscale
    return _b64(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


GOOD = _images(2, seed=7, size=16)


def _alongside_good_request(url: str, fault: Callable[[], Any]) -> Any:
    """Run ``fault`` while a good request is sent from another thread at the same moment; check the good
    one got the right scores, and return what ``fault`` returned."""
    both = threading.Barrier(2, timeout=5)
    out: dict[str, Any] = {}

    def good() -> None:
        both.wait()
        try:
            out["scores"] = HTTPReward(url, timeout_s=5.0, max_retries=0)(["a", "b"], ["a", "b"], GOOD)
        except Exception as err:  # reported by the assertion below
            out["error"] = err
        out["at"] = time.monotonic()

    thread = threading.Thread(target=good)
    thread.start()
    both.wait()
    result = fault()
    thread.join(timeout=10)
    assert "error" not in out, out.get("error")
    assert out["scores"] == pytest.approx(Brightness()(["a", "b"], ["a", "b"], GOOD), abs=1e-6)
    return result, out["at"]


def _refused(url: str, data: bytes, status: int, expected: str, **kwargs: Any) -> tuple[dict[str, Any], float]:
    """Send the faulty ``data`` alongside a good request and check the refusal; returns the JSON and the
    seconds until the connection closed."""
    (got, headers, body, elapsed), _ = _alongside_good_request(url, lambda: _exchange(url, data, **kwargs))
    assert got == status, body
    assert headers["content-type"] == "application/json" and headers["connection"] == "close"
    assert set(body) == {"error"} and expected in body["error"], body
    return body, elapsed


@pytest.mark.parametrize("fmt", ["BMP", "GIF", "TIFF"])
def test_only_png_and_jpeg_are_decoded(start_server, fmt: str):
    server = start_server()
    _refused(server.url, _post_bytes(_request([_pil(fmt)])), 400, "images[0]: not a PNG or JPEG image")


def test_png_and_jpeg_are_decoded(start_server):
    server = start_server()
    for fmt in ("png", "jpeg"):
        client = HTTPReward(server.url, timeout_s=5.0, max_retries=0, image_format=fmt)
        assert len(client(["a", "b"], ["a", "b"], GOOD)) == 2


def test_a_decompression_bomb_is_refused_before_decoding(start_server):
    server = start_server()
    # 400 M pixels of zeros, the first rows' worth compressed: over PIL's own limit, which Image.open raises.
    bomb = _png_header(20000, 20000, zlib.compress(b"\0" * 20001 * 100))
    _refused(server.url, _post_bytes(_request([bomb])), 413, "image too large")


def test_an_image_over_the_pixel_limit_is_refused_from_its_header(start_server):
    server = start_server()  # max_image_pixels 32 x 32
    # 40 x 40 whose data is broken: decoding it would fail (400), so a 413 means the header was checked first.
    body, _ = _refused(server.url, _post_bytes(_request([_png_header(40, 40)])), 413, "40x40")
    assert "1024 pixels per image" in body["error"]


def test_a_request_over_the_total_pixel_limit_is_refused(start_server):
    server = start_server()  # max_total_pixels: 8 images of 16 x 16
    images = encode_images(_images(9, seed=1, size=16))
    _refused(server.url, _post_bytes(_request(images)), 413, "pixels in all")


def test_a_body_over_the_size_limit_is_refused_unread(start_server):
    server = start_server()
    # Only the headers are sent: a server that waited for the body would answer 408, not 413.
    data = _post_bytes(b"", length=LIMITS["max_body_bytes"] + 1)
    _refused(server.url, data, 413, f"over the limit of {LIMITS['max_body_bytes']} bytes")


def test_a_body_over_the_size_limit_is_refused_before_100_continue(start_server):
    server = start_server()
    data = _post_bytes(b"", "Expect: 100-continue\r\n", length=LIMITS["max_body_bytes"] + 1)
    _refused(server.url, data, 413, "over the limit")  # the first status line read is the 413, not a 100


@pytest.mark.parametrize(
    ("extra", "length", "status", "expected"),
    [
        ("", "", 411, "a Content-Length header is required"),
        ("Transfer-Encoding: chunked\r\n", "", 411, "chunked request bodies are not accepted"),
        ("Content-Length: 7\r\n", None, 400, "bad Content-Length '2, 7'"),
        ("", "2x", 400, "bad Content-Length '2x'"),
    ],
)
def test_a_missing_or_bad_length_is_refused(start_server, extra: str, length: str | None, status: int, expected: str):
    server = start_server()
    _refused(server.url, _post_bytes(b"{}", extra, length), status, expected)


def test_a_body_that_does_not_arrive_in_time_is_refused(start_server):
    server = start_server()  # read_timeout_s 0.5
    _, elapsed = _refused(server.url, _post_bytes(b"[1", length=1000), 408, "within 0.5 s (2 of 1000 bytes)")
    assert elapsed < 3


def test_a_trickled_body_is_held_to_one_deadline(start_server):
    server = start_server()  # read_timeout_s 0.5; a byte every 0.2 s for 6 s never idles a read that long
    data = _post_bytes(b"[", length=100)
    _, elapsed = _refused(server.url, data, 408, "within 0.5 s", drip=b"1," * 15)
    assert elapsed < 3


def test_the_last_read_gets_only_what_is_left_of_the_deadline(start_server):
    server = start_server(read_timeout_s=1.0)
    # Bytes until 0.8 s, then nothing: the deadline answers at 1 s; a read given the full timeout would
    # wait until 1.8 s.
    data = _post_bytes(b"[", length=100)
    _, elapsed = _refused(server.url, data, 408, "within 1 s", drip=b"1," * 4, drip_every_s=0.1)
    assert elapsed < 1.5


def test_a_good_request_is_answered_while_a_body_is_stalled(start_server):
    server = start_server(read_timeout_s=1.5)

    def stalled() -> tuple[int, float]:
        return _exchange(server.url, _post_bytes(b"[1", length=1000))[0], time.monotonic()

    (status, stall_ended), good_at = _alongside_good_request(server.url, stalled)
    # The stalled request holds only its own thread: the good one is scored long before the stall ends.
    assert status == 408 and good_at < stall_ended - 0.5


def test_an_idle_connection_is_dropped(start_server):
    server = start_server()  # read_timeout_s 0.5: the request line never comes
    with socket.create_connection(_address(server.url), timeout=5) as sock:
        start = time.monotonic()
        assert sock.recv(100) == b""
        assert time.monotonic() - start < 3


def _slowloris(url: str, drip_every_s: float = 0.1) -> tuple[bytes, float, float]:
    """Send a request line, then a header a byte at a time, each byte well within the read timeout, until the
    server hangs up: (what came back, seconds until then, when). A server that waits for the whole head holds
    the connection past the drip and fails the test by the socket timeout."""
    with socket.create_connection(_address(url), timeout=8) as sock:
        start = time.monotonic()
        sock.sendall(b"POST / HTTP/1.1\r\n")
        stop = threading.Event()

        def drip() -> None:
            for byte in b"X-Slow: " + b"a" * 100:  # 10 s of bytes: longer than the socket timeout
                if stop.wait(drip_every_s):
                    return
                try:
                    sock.sendall(bytes([byte]))
                except OSError:
                    return

        dripper = threading.Thread(target=drip, daemon=True)
        dripper.start()
        try:
            got = sock.recv(65536)
        except ConnectionResetError:  # dropped with a byte unread: a hang-up all the same
            got = b""
        stop.set()
        dripper.join(timeout=1)
        return got, time.monotonic() - start, time.monotonic()


def test_a_request_head_sent_a_byte_at_a_time_is_held_to_one_deadline(start_server):
    server = start_server()  # read_timeout_s 0.5; a byte every 0.1 s never idles a read that long
    got, elapsed, _ = _slowloris(server.url)
    assert got == b"" and 0.4 < elapsed < 3.0  # the drip alone would take 10 s


def test_a_good_request_is_answered_while_a_head_trickles_in(start_server):
    server = start_server(read_timeout_s=1.5)
    (got, elapsed, dropped_at), good_at = _alongside_good_request(server.url, lambda: _slowloris(server.url))
    # The trickling client holds only its own thread: the good one is scored long before it is dropped.
    assert got == b"" and elapsed < 4.0 and good_at < dropped_at - 0.5


def test_each_request_on_a_kept_connection_gets_its_own_head_deadline(start_server):
    server = start_server(read_timeout_s=1.0)  # three requests 0.4 s apart outlast one deadline
    with socket.create_connection(_address(server.url), timeout=4) as sock:
        reader = sock.makefile("rb")
        for _ in range(3):
            time.sleep(0.4)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert reader.readline().split()[1] == b"200"
            head = list(iter(reader.readline, b"\r\n"))
            length = next(int(line.split(b":")[1]) for line in head if line.lower().startswith(b"content-length"))
            assert json.loads(reader.read(length))["status"] == "ok"


def test_the_body_gets_its_own_deadline_after_the_head(start_server):
    server = start_server(read_timeout_s=2.0)
    data = _post_bytes(_request(encode_images(GOOD)), "Connection: close\r\n")
    head_end = data.index(b"\r\n\r\n") + 4
    # The head takes 1.2 s and the body 1.2 s more: each within its own 2 s, not both within one.
    with socket.create_connection(_address(server.url), timeout=6) as sock:
        for lo, hi, pause in ((0, 20, 1.2), (20, head_end, 1.2), (head_end, len(data), 0.0)):
            sock.sendall(data[lo:hi])
            time.sleep(pause)
        raw = b"".join(iter(lambda: sock.recv(65536), b""))
    assert raw.startswith(b"HTTP/1.1 200 "), raw[:300]


def test_deeply_nested_json_is_a_bad_request(start_server):
    server = start_server()
    _refused(server.url, _post_bytes(b"[" * 100_000), 400, "nested too deeply")


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b"{not json", "not JSON"),
        (b"[1, 2]", "expected a JSON object, got list"),
        (b'{"prompts": ["a"]}', "missing key 'refined_prompts', 'images'"),
        (_request([_pil("PNG")], prompts=[1]), "'prompts' must be a list of strings"),
        (_request([_pil("PNG")], refined="r"), "'refined_prompts' must be a list of strings"),
        (_request([_pil("PNG")], prompts=[None]), "'prompts' must be a list of strings"),
        (_request([_pil("PNG")] * 2, prompts=["a"]), "1 prompts, 2 refined prompts and 2 images differ"),
        (_request(["!!!"]), "images[0]: not a base64-encoded image"),
        (_request([_png_header(8, 8)]), "images[0]: cannot decode the image"),
    ],
)
def test_a_malformed_request_is_a_bad_request(start_server, body: bytes, expected: str):
    server = start_server()
    _refused(server.url, _post_bytes(body), 400, expected)


@pytest.mark.parametrize(
    ("data", "status", "expected"),
    [
        (b"PUT / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", 501, "Unsupported method ('PUT')"),
        (b"GARBAGE\r\n\r\n", 400, "Bad request syntax"),
        (b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n", 404, "unknown path '/nowhere'"),
    ],
)
def test_the_server_s_own_errors_are_json(start_server, data: bytes, status: int, expected: str):
    server = start_server()
    _refused(server.url, data, status, expected)


def _poisoned(prompts: list[str], refined: list[str], images: torch.Tensor) -> list[float]:
    """Brightness, except that the prompt "raise" makes the call raise and "nan" scores NaN."""
    if "raise" in prompts:
        raise RuntimeError("poisoned prompt")
    scores = images.mean(dim=(1, 2, 3)).tolist()
    return [math.nan if p == "nan" else s for p, s in zip(prompts, scores, strict=True)]


@pytest.mark.parametrize(("poison", "expected"), [("raise", "RuntimeError: poisoned prompt"), ("nan", "nan")])
def test_one_bad_request_does_not_fail_its_batch_mates(start_server, poison: str, expected: str):
    # A long batch window: the good request and the poisoned one are scored in one call first.
    server = start_server(_poisoned, "poisoned", batch_wait_s=0.3)
    data = _post_bytes(_request(encode_images(_images(1, seed=3, size=16)), prompts=[poison], refined=["r"]))
    body, _ = _refused(server.url, data, 500, expected)
    assert "reward 'poisoned'" in body["error"]
    assert server.batcher.calls[0] == 3 and sorted(server.batcher.calls[1:]) == [1, 2], server.batcher.calls


def test_a_batch_that_fails_alone_fails_once(start_server):
    server = start_server(_poisoned, "poisoned")
    data = _post_bytes(_request(encode_images(_images(1, size=16)), prompts=["raise"], refined=["r"]))
    status, _, body, _ = _exchange(server.url, data)
    assert status == 500 and "poisoned prompt" in body["error"]
    assert server.batcher.calls == [1]  # one request alone is not scored twice


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("clip")
    torch.manual_seed(0)
    from transformers import CLIPModel

    CLIPModel(_config()).save_pretrained(path)
    _save_processor(path)
    return str(path)


def test_served_pickscore_equals_pickscore_in_process(clip_dir):
    args = {"pretrained_path": clip_dir, "processor_path": clip_dir}
    images = torch.rand(5, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    local = PickScore(**args)(PROMPTS, PROMPTS, images)
    server = serve("pickscore", reward_args=args)
    try:
        served = HTTPReward(server.url, batch_size=5, **FAST)(PROMPTS, PROMPTS, images)
    finally:
        server.close()
    assert max(abs(a - b) for a, b in zip(served, local, strict=True)) <= 1e-6


# ------------------------------------------------------------------ acceptance: a 2-step fit through the server
class RecordRewards(pl.Callback):
    """Every training step's per-sample rewards (the experience is the batch at train-batch start)."""

    taken: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        RecordRewards.taken.append(batch.rewards.detach().cpu().clone())


def _fit(tmp_path: Path, pipeline: Path, rewards: str, reward_args: str, name: str) -> list[torch.Tensor]:
    shared = importlib.import_module(HERE)  # the module the CLI imports the callback from
    shared.RecordRewards.taken = []
    main(
        [
            "fit",
            "--config",
            str(ROOT / "recipes" / "sd35.yaml"),
            f"--model.pipeline_path={pipeline}",
            "--model.llm=null",
            "--model.mode=generator_only",
            "--trainer.accelerator=cpu",
            "--trainer.devices=1",
            "--model.generator.init_args.dtype=float32",
            "--model.generator.init_args.height=32",
            "--model.generator.init_args.width=32",
            "--model.generator.init_args.max_sequence_length=16",
            "--data.prompts_per_step=2",
            "--data.samples_per_prompt=2",
            "--model.rollout.num_steps=4",
            "--model.generator_algorithm.init_args.sde_window=[0,2]",
            "--trainer.max_steps=2",
            "--trainer.limit_val_batches=0",
            "--trainer.enable_checkpointing=false",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            f"--trainer.callbacks=[{HERE}.RecordRewards]",
            f"--trainer.logger.init_args.save_dir={tmp_path}",
            f"--trainer.logger.init_args.name={name}",
            f"--trainer.default_root_dir={tmp_path}",
            f"--model.rewards={rewards}",
            f"--model.reward_args={reward_args}",
        ]
    )
    return list(shared.RecordRewards.taken)


@pytest.mark.integration
def test_a_two_step_fit_gets_the_same_rewards_from_the_server_as_in_process(tmp_path, clip_dir):
    pipeline = make_sd3_pipeline(tmp_path / "pipeline")
    # Both sides run the CLIP towers on 2 images at a time (the client's request size), so the float32
    # sums are the same and the rewards can be compared bitwise.
    args = f'{{"pretrained_path": "{clip_dir}", "processor_path": "{clip_dir}", "batch_size": 2}}'
    local = _fit(tmp_path, pipeline, "{pickscore: 1.0}", f"{{pickscore: {args}}}", "local")
    reward_args = {"pretrained_path": clip_dir, "processor_path": clip_dir, "batch_size": 2}
    server = serve("pickscore", reward_args=reward_args)
    try:
        # batch_size 2 < 4 images a step: the first request is in flight while the second half decodes.
        http = f'{{http: {{url: "{server.url}", batch_size: 2, timeout_s: 30}}}}'
        served = _fit(tmp_path, pipeline, "{http: 1.0}", http, "served")
        assert sum(server.batcher.calls) == 2 * 4, "every image of both steps went through the server"
    finally:
        server.close()
    assert len(local) == len(served) == 2
    for a, b in zip(local, served, strict=True):
        assert a.shape == (4,) and torch.isfinite(a).all()
        assert torch.equal(a, b), (a - b).abs().max()
