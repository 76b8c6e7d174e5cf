"""Reference reward server: serves any registered (or dotted-path) reward over the HTTP reward protocol.

Run ``python -m unirl_pl.rewards.server --reward pickscore --reward-args '{"device": "cuda:1"}'`` and
point an ``http`` reward at ``http://127.0.0.1:8000/``. ``POST`` (any path) takes ``{"prompts",
"refined_prompts", "images"}`` (and optionally ``"metadata"``, one object or null per sample, handed to a
reward that declares a ``metadata`` parameter) and answers ``{"scores": [...]}``; ``GET /health`` answers ``{"status":
"ok", "reward": name}``. Concurrent requests (several trainer ranks, or one client's overlapping calls)
are batched: one worker thread scores the requests that arrived within ``batch_wait_s`` of each other
in one call of the reward, up to ``max_batch_size`` samples. Requests are bounded (body size, head and body
read time, PNG/JPEG only, pixels per image and per request); every refusal is a JSON ``{"error": ...}`` with
its 4xx/5xx status, and the connection is closed after it. It is also the template for wrapping a
model whose dependencies cannot live in the trainer's environment: copy it, replace the reward, keep
the protocol.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NoReturn

from torch import Tensor

from unirl_pl.rewards.batcher import RequestBatcher
from unirl_pl.rewards.builtin import RewardFn, resolve_reward
from unirl_pl.rewards.http import MAX_IMAGE_PIXELS, MAX_TOTAL_PIXELS, ImageTooLarge, decode_images
from unirl_pl.rewards.metadata import Metadata, check_metadata
from unirl_pl.rewards.transport import DeadlineSocket

MAX_BODY_BYTES = 64 * 2**20
READ_TIMEOUT_S = 30.0
_READ_CHUNK = 64 * 2**10


class RewardHTTPServer(ThreadingHTTPServer):
    """A threading HTTP server holding one reward; concurrent requests are scored in batches by one
    worker thread (:class:`RequestBatcher`).

    Every request is bounded before the reward sees it: a ``Content-Length`` is required (411) and may
    not exceed ``max_body_bytes`` (413, refused unread); the request line and headers must arrive within
    ``read_timeout_s`` (else the connection is closed, unanswered), the body within another ``read_timeout_s``
    (408); the JSON must parse (400, deep nesting included); ``prompts`` and ``refined_prompts`` must be
    lists of strings as long as ``images`` (400); ``metadata``, when present and not null, must be a list as
    long as ``prompts`` of JSON objects or nulls (400); images must be PNG or JPEG (400) within the pixel limits
    (413, checked from the image header before decoding). Each error reply is ``{"error": "..."}`` and
    closes the connection.

    Args:
        address: (host, port) to bind; port 0 picks a free port (see ``url``).
        reward: The reward callable to serve.
        reward_name: Its name, reported by ``GET /health``.
        max_batch_size: Most samples per reward call when requests are batched together.
        batch_wait_s: How long a batch waits for more requests after its first one.
        max_body_bytes: Largest request body accepted.
        read_timeout_s: Seconds the request line and headers may take to arrive in full (counted from the
            connection's start or its previous reply, so also how long an idle connection is kept), the same
            again for the body, and how long writing a reply may block.
        max_image_pixels: Most pixels (width x height) of one image or video frame.
        max_total_pixels: Most pixels of all the images and frames of one request.
    """

    # Handler threads must not keep the process alive or block close() on a stuck client.
    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        reward: RewardFn,
        reward_name: str,
        max_batch_size: int = 64,
        batch_wait_s: float = 0.005,
        max_body_bytes: int = MAX_BODY_BYTES,
        read_timeout_s: float = READ_TIMEOUT_S,
        max_image_pixels: int = MAX_IMAGE_PIXELS,
        max_total_pixels: int = MAX_TOTAL_PIXELS,
    ) -> None:
        if max_body_bytes < 1 or read_timeout_s <= 0 or max_image_pixels < 1 or max_total_pixels < 1:
            raise ValueError(
                "need max_body_bytes >= 1, read_timeout_s > 0, max_image_pixels >= 1, max_total_pixels >= 1; got "
                f"{max_body_bytes}, {read_timeout_s}, {max_image_pixels}, {max_total_pixels}"
            )
        self.max_body_bytes, self.read_timeout_s = max_body_bytes, read_timeout_s
        self.max_image_pixels, self.max_total_pixels = max_image_pixels, max_total_pixels
        super().__init__(address, _RewardHandler)
        self.batcher = RequestBatcher(reward, reward_name, max_batch_size, batch_wait_s)
        self.reward, self.reward_name = reward, reward_name
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The base URL clients POST to, with the port actually bound."""
        host, port = self.server_address[:2]
        host = host.decode() if isinstance(host, bytes) else host
        return f"http://{f'[{host}]' if ':' in host else host}:{port}/"

    def close(self) -> None:
        """Stop serving (if started by :func:`serve`) and release the socket."""
        if self.thread is not None:
            self.shutdown()
            self.thread.join(timeout=5)
            self.thread = None
        self.server_close()
        self.batcher.close()


class _Refused(Exception):
    """A request refused before it reaches the reward: the HTTP status and what was wrong."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class _RewardHandler(BaseHTTPRequestHandler):
    server: RewardHTTPServer
    _in: DeadlineSocket  # the connection under rfile, with the deadline of what is being read
    protocol_version = "HTTP/1.1"
    # Errors found in the request line itself (a garbled line) get a status line and headers too; the
    # base class would answer them as HTTP/0.9, a bare body without any status.
    default_request_version = "HTTP/1.0"

    @property  # type: ignore[override]
    def timeout(self) -> float:
        # StreamRequestHandler.setup applies it to the connection; reads then get their own deadline (below),
        # so it bounds only writes made outside _reply, such as a "100 Continue".
        return self.server.read_timeout_s

    def setup(self) -> None:
        super().setup()
        # Every read (request line, headers, body) waits only until the deadline of what it reads: the socket
        # timeout alone bounds each read, and a client sending a byte at a time could hold this thread forever.
        self.rfile.close()  # the base class's reader, nothing read from it yet
        self._in = DeadlineSocket(self.connection, time.monotonic() + self.server.read_timeout_s)
        self.rfile = self._in.makefile("rb")

    def handle_one_request(self) -> None:
        # The request line and headers must be in within read_timeout_s of the previous reply (or of
        # connecting); past it the read raises TimeoutError, on which the base class closes the connection.
        self._in.deadline = time.monotonic() + self.server.read_timeout_s
        super().handle_one_request()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class names it so
        pass  # one line per request would drown a training log; errors still go back to the client

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode("utf-8")
        # Writing the reply is bounded too: a client that stops reading cannot hold this thread.
        self.connection.settimeout(self.server.read_timeout_s)
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if status >= 400:
                # After an error the rest of the request may be unread: closing keeps it from ever being
                # parsed as the next request on this connection.
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
        except OSError:  # the client went away or stopped reading; nobody is left to tell
            self.close_connection = True

    def _error(self, status: int, message: str) -> None:
        self._reply(status, {"error": message})

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The base class's errors (bad request line, unsupported method, oversized headers) as JSON too."""
        short, long = self.responses.get(code, ("error", ""))
        self._error(code, f"{message or short}" + (f": {explain}" if explain else f": {long}" if long else ""))

    def handle_expect_100(self) -> bool:
        # A client that waits for "100 Continue" learns of a refused length before sending the body.
        try:
            self._declared_length()
        except _Refused as err:
            self._error(err.status, err.message)
            return False
        return super().handle_expect_100()

    def do_GET(self) -> None:  # noqa: N802 - BaseHTTPRequestHandler's naming
        if self.path.rstrip("/") == "/health":
            self._reply(200, {"status": "ok", "reward": self.server.reward_name})
        else:
            self._error(404, f"unknown path {self.path!r}; POST samples to score, GET /health")

    def do_POST(self) -> None:  # noqa: N802
        try:
            prompts, refined, images, metadata = self._parse(self._read_body())
        except _Refused as err:
            self._error(err.status, err.message)
            return
        except Exception as err:  # a bug here must still answer, and in JSON
            self._error(500, f"the server failed reading the request: {type(err).__name__}: {err}")
            return
        scores, error = self.server.batcher.score(prompts, refined, images, metadata)
        if error is not None:  # the reward failed on this request: 500, which the client may retry
            self._error(500, error)
            return
        self._reply(200, {"scores": scores})

    def _declared_length(self) -> int:
        if "Transfer-Encoding" in self.headers:
            raise _Refused(411, "chunked request bodies are not accepted; send a Content-Length header")
        lengths = self.headers.get_all("Content-Length") or []
        if not lengths:
            raise _Refused(411, "a Content-Length header is required")
        text = lengths[0].strip()
        if len(set(lengths)) > 1 or not (text.isascii() and text.isdigit()):
            raise _Refused(400, f"bad Content-Length {', '.join(lengths)!r}")
        length = int(text)
        if length > self.server.max_body_bytes:
            raise _Refused(413, f"the body of {length} bytes is over the limit of {self.server.max_body_bytes} bytes")
        return length

    def _read_body(self) -> bytes:
        length = self._declared_length()
        self._in.deadline = time.monotonic() + self.server.read_timeout_s  # one deadline for the whole body
        chunks, got = [], 0
        while got < length:
            try:
                chunk = self.rfile.read1(min(length - got, _READ_CHUNK))
            except TimeoutError:
                late = f"the body did not arrive within {self.server.read_timeout_s:g} s ({got} of {length} bytes)"
                raise _Refused(408, late) from None
            if not chunk:
                raise _Refused(400, f"the body ended after {got} of {length} bytes")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def _parse(self, body: bytes) -> tuple[list[str], list[str], Tensor, list[Metadata] | None]:
        try:
            request = json.loads(body)
        except RecursionError:
            raise _Refused(400, "bad request: the JSON is nested too deeply") from None
        except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, an over-long integer
            raise _Refused(400, f"bad request: not JSON ({err})") from None
        if not isinstance(request, dict):
            raise _Refused(400, f"bad request: expected a JSON object, got {type(request).__name__}")
        missing = [key for key in ("prompts", "refined_prompts", "images") if key not in request]
        if missing:
            raise _Refused(400, f"bad request: missing key {', '.join(map(repr, missing))}")
        prompts, refined = request["prompts"], request["refined_prompts"]
        for key, value in (("prompts", prompts), ("refined_prompts", refined)):
            if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
                raise _Refused(400, f"bad request: {key!r} must be a list of strings")
        # Checked before the images are decoded: a wrong metadata list costs no decoding. Null means none.
        metadata = request.get("metadata")
        if metadata is not None:
            try:
                check_metadata(metadata, len(prompts))
            except ValueError as err:
                raise _Refused(400, f"bad request: {err}") from None
        try:
            images = decode_images(request["images"], self.server.max_image_pixels, self.server.max_total_pixels)
        except ImageTooLarge as err:
            raise _Refused(413, f"image too large: {err}") from None
        except ValueError as err:
            raise _Refused(400, f"bad request: {err}") from None
        if not len(prompts) == len(refined) == images.shape[0]:
            raise _Refused(
                400,
                f"bad request: {len(prompts)} prompts, {len(refined)} refined prompts and {images.shape[0]} "
                "images differ",
            )
        return prompts, refined, images, metadata


def serve(
    reward_name: str,
    host: str = "127.0.0.1",
    port: int = 0,
    reward_args: dict[str, Any] | None = None,
    max_batch_size: int = 64,
    batch_wait_s: float = 0.005,
    max_body_bytes: int = MAX_BODY_BYTES,
    read_timeout_s: float = READ_TIMEOUT_S,
    max_image_pixels: int = MAX_IMAGE_PIXELS,
    max_total_pixels: int = MAX_TOTAL_PIXELS,
) -> RewardHTTPServer:
    """Start serving ``reward_name`` (registry name or dotted path) in a background thread.

    Returns the running server: ``server.url`` is where to POST (port 0 binds a free port) and
    ``server.close()`` stops it. ``max_batch_size`` and ``batch_wait_s`` bound the batching of
    concurrent requests (:class:`RequestBatcher`); the other limits are :class:`RewardHTTPServer`'s.
    """
    server = RewardHTTPServer(
        (host, port),
        resolve_reward(reward_name, reward_args),
        reward_name,
        max_batch_size,
        batch_wait_s,
        max_body_bytes,
        read_timeout_s,
        max_image_pixels,
        max_total_pixels,
    )
    # A short poll interval makes close() return quickly (shutdown waits for the next poll).
    server.thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.1}, name=f"reward-server-{reward_name}", daemon=True
    )
    server.thread.start()
    return server


def main(argv: list[str] | None = None) -> None:
    """Command line: serve one reward until interrupted."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reward", required=True, help="registry name (e.g. brightness, ocr) or dotted path")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0 for all; no auth!)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--reward-args", default="{}", help="constructor kwargs as JSON, e.g. '{\"channel\": 0}'")
    parser.add_argument("--max-batch", type=int, default=64, help="most samples per reward call across requests")
    parser.add_argument(
        "--batch-wait-ms", type=float, default=5.0, help="how long a batch waits for more concurrent requests"
    )
    parser.add_argument(
        "--max-body-mb",
        type=float,
        default=MAX_BODY_BYTES / 2**20,
        help="largest request body in MiB; a larger Content-Length is refused unread (413)",
    )
    parser.add_argument(
        "--read-timeout-s",
        type=float,
        default=READ_TIMEOUT_S,
        help="seconds the request line and headers may take to arrive in full (else the connection is closed), "
        "the same for the body (else 408); also the idle-connection timeout",
    )
    parser.add_argument(
        "--max-image-pixels",
        type=int,
        default=MAX_IMAGE_PIXELS,
        help="most pixels (width x height) of one image or video frame, checked before decoding (else 413)",
    )
    parser.add_argument(
        "--max-request-pixels",
        type=int,
        default=MAX_TOTAL_PIXELS,
        help="most pixels of all the images and frames of one request (else 413)",
    )
    args = parser.parse_args(argv)

    def fail(message: str) -> NoReturn:
        # One line and exit status 2, like an argparse error, and no traceback: these are setup mistakes.
        print(f"{parser.prog}: error: {message}", file=sys.stderr, flush=True)
        raise SystemExit(2)

    try:
        reward_args = json.loads(args.reward_args)
    except json.JSONDecodeError as err:
        fail(f"--reward-args is not JSON: {err}")
    if not isinstance(reward_args, dict):
        fail(f"--reward-args must be a JSON object of constructor kwargs, got {args.reward_args!r}")
    try:
        reward = resolve_reward(args.reward, reward_args)
    except (ValueError, TypeError, ImportError, OSError) as err:
        fail(f"cannot start reward {args.reward!r}: {err}")
    try:
        server = RewardHTTPServer(
            (args.host, args.port),
            reward,
            args.reward,
            max_batch_size=args.max_batch,
            batch_wait_s=args.batch_wait_ms / 1000,
            max_body_bytes=int(args.max_body_mb * 2**20),
            read_timeout_s=args.read_timeout_s,
            max_image_pixels=args.max_image_pixels,
            max_total_pixels=args.max_request_pixels,
        )
    except ValueError as err:
        fail(str(err))
    except OSError as err:
        fail(f"cannot listen on {args.host}:{args.port}: {err}")
    print(f"serving reward {args.reward!r} at {server.url} (GET {server.url}health)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        server.batcher.close()


if __name__ == "__main__":
    main()
