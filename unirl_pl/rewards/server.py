"""Reference reward server: serves any registered (or dotted-path) reward over the HTTP reward protocol.

Run ``python -m unirl_pl.rewards.server --reward pickscore --reward-args '{"device": "cuda:1"}'`` and
point an ``http`` reward at ``http://127.0.0.1:8000/``. ``POST`` (any path) takes ``{"prompts",
"refined_prompts", "images"}`` and answers ``{"scores": [...]}``; ``GET /health`` answers ``{"status":
"ok", "reward": name}``. Concurrent requests (several trainer ranks, or one client's overlapping calls)
are batched: one worker thread scores the requests that arrived within ``batch_wait_s`` of each other
in one call of the reward, up to ``max_batch_size`` samples. It is also the template for wrapping a
model whose dependencies cannot live in the trainer's environment: copy it, replace the reward, keep
the protocol.
"""

from __future__ import annotations

import argparse
import json
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
from torch import Tensor

from unirl_pl.rewards.builtin import RewardFn, resolve_reward
from unirl_pl.rewards.http import decode_images


@dataclass
class _Job:
    """One request waiting for its scores: filled by the batch worker, then ``done`` is set."""

    prompts: list[str]
    refined: list[str]
    images: Tensor
    done: threading.Event = field(default_factory=threading.Event)
    scores: list[float] | None = None
    error: str | None = None


class RequestBatcher:
    """Scores requests in batches on one worker thread: the first waiting request opens a batch, which
    takes every request that arrives within ``wait_s`` with the same image shape, up to ``max_size``
    samples, and the reward is called once on their concatenation.

    One thread calls the reward, so models that are not thread-safe (most GPU models) are safe and
    memory is bounded by one batch. A reward that raises, or returns a non-finite score or the wrong
    count, fails every request of that batch (500, which the client retries).

    Args:
        reward: The reward to call.
        reward_name: Its name, for error messages.
        max_size: Most samples per call (a single larger request is still scored whole).
        wait_s: How long a batch waits for more requests after its first one (0: no waiting).
    """

    def __init__(self, reward: RewardFn, reward_name: str, max_size: int = 64, wait_s: float = 0.005) -> None:
        if max_size < 1 or wait_s < 0:
            raise ValueError(f"need max_batch_size >= 1 and batch_wait_s >= 0, got {max_size}, {wait_s}")
        self.reward, self.reward_name, self.max_size, self.wait_s = reward, reward_name, max_size, wait_s
        self.calls: list[int] = []  # samples per reward call, for tests and logs
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._held: _Job | None = None  # a request that did not fit the last batch opens the next
        self._thread = threading.Thread(target=self._work, name=f"reward-batcher-{reward_name}", daemon=True)
        self._thread.start()

    def score(self, prompts: list[str], refined: list[str], images: Tensor) -> tuple[list[float] | None, str | None]:
        """(scores, None) or (None, error) for one request, after its batch has been scored."""
        job = _Job(prompts, refined, images)
        self._queue.put(job)
        job.done.wait()
        return job.scores, job.error

    def close(self) -> None:
        """Stop the worker after the requests already queued."""
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _next_batch(self) -> list[_Job] | None:
        first = self._held or self._queue.get()
        self._held = None
        if first is None:
            return None
        batch, size = [first], len(first.prompts)
        deadline = time.monotonic() + self.wait_s
        while size < self.max_size:
            try:
                job = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if job is None:
                self._queue.put(None)  # seen again after this batch: stop then
                break
            fits = job.images.shape[1:] == first.images.shape[1:] and size + len(job.prompts) <= self.max_size
            if not fits:
                self._held = job
                break
            batch.append(job)
            size += len(job.prompts)
        return batch

    def _work(self) -> None:
        while (batch := self._next_batch()) is not None:
            prompts = [p for job in batch for p in job.prompts]
            refined = [r for job in batch for r in job.refined]
            images = torch.cat([job.images for job in batch])
            error, scores = None, []
            try:
                scores = [float(s) for s in self.reward(prompts, refined, images)]
                if len(scores) != len(prompts) or not all(math.isfinite(s) for s in scores):
                    error = f"reward {self.reward_name!r} returned {scores} for {len(prompts)} samples"
            except Exception as err:  # the reward failed: every request of the batch gets the error
                error = f"reward {self.reward_name!r} failed: {type(err).__name__}: {err}"
            self.calls.append(len(prompts))
            lo = 0
            for job in batch:
                hi = lo + len(job.prompts)
                job.scores, job.error = (None, error) if error else (scores[lo:hi], None)
                lo = hi
                job.done.set()


class RewardHTTPServer(ThreadingHTTPServer):
    """A threading HTTP server holding one reward; concurrent requests are scored in batches by one
    worker thread (:class:`RequestBatcher`).

    Args:
        address: (host, port) to bind; port 0 picks a free port (see ``url``).
        reward: The reward callable to serve.
        reward_name: Its name, reported by ``GET /health``.
        max_batch_size: Most samples per reward call when requests are batched together.
        batch_wait_s: How long a batch waits for more requests after its first one.
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
    ) -> None:
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


class _RewardHandler(BaseHTTPRequestHandler):
    server: RewardHTTPServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class names it so
        pass  # one line per request would drown a training log; errors still go back to the client

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - BaseHTTPRequestHandler's naming
        if self.path.rstrip("/") == "/health":
            self._reply(200, {"status": "ok", "reward": self.server.reward_name})
        else:
            self._reply(404, {"error": f"unknown path {self.path!r}; POST samples to score, GET /health"})

    def do_POST(self) -> None:  # noqa: N802
        try:
            length = self.headers.get("Content-Length")
            if length is None or not length.isdigit():
                raise ValueError("a Content-Length header is required")
            request = json.loads(self.rfile.read(int(length)))
            prompts, refined = request["prompts"], request["refined_prompts"]
            images = decode_images(request["images"])
            if not (isinstance(prompts, list) and isinstance(refined, list)):
                raise ValueError("'prompts' and 'refined_prompts' must be lists of strings")
            if not len(prompts) == len(refined) == images.shape[0]:
                raise ValueError(
                    f"{len(prompts)} prompts, {len(refined)} refined prompts and {images.shape[0]} images differ"
                )
        except (ValueError, KeyError, TypeError) as err:  # the client's fault: 400, not retried
            what = f"missing key {err}" if isinstance(err, KeyError) else str(err)
            self._reply(400, {"error": f"bad request: {what}"})
            return
        scores, error = self.server.batcher.score(prompts, refined, images)
        if error is not None:  # the reward failed: 500, which the client may retry
            self._reply(500, {"error": error})
            return
        self._reply(200, {"scores": scores})


def serve(
    reward_name: str,
    host: str = "127.0.0.1",
    port: int = 0,
    reward_args: dict[str, Any] | None = None,
    max_batch_size: int = 64,
    batch_wait_s: float = 0.005,
) -> RewardHTTPServer:
    """Start serving ``reward_name`` (registry name or dotted path) in a background thread.

    Returns the running server: ``server.url`` is where to POST (port 0 binds a free port) and
    ``server.close()`` stops it. ``max_batch_size`` and ``batch_wait_s`` bound the batching of
    concurrent requests (:class:`RequestBatcher`).
    """
    server = RewardHTTPServer(
        (host, port), resolve_reward(reward_name, reward_args), reward_name, max_batch_size, batch_wait_s
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
    args = parser.parse_args(argv)
    try:
        reward_args = json.loads(args.reward_args)
    except json.JSONDecodeError as err:
        parser.error(f"--reward-args is not JSON: {err}")
    server = RewardHTTPServer(
        (args.host, args.port),
        resolve_reward(args.reward, reward_args),
        args.reward,
        max_batch_size=args.max_batch,
        batch_wait_s=args.batch_wait_ms / 1000,
    )
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
