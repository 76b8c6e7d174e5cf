"""Reference reward server: serves any registered (or dotted-path) reward over the HTTP reward protocol.

Run ``python -m unirl_pl.rewards.server --reward brightness --port 8000`` and point an ``http``
reward at ``http://127.0.0.1:8000/``. ``POST`` (any path) takes ``{"prompts", "refined_prompts",
"images"}`` and answers ``{"scores": [...]}``; ``GET /health`` answers ``{"status": "ok", "reward":
name}``. It is also the template for wrapping a model whose dependencies cannot live in the
trainer's environment: copy it, replace the reward, keep the protocol.
"""

from __future__ import annotations

import argparse
import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from unirl_pl.rewards.builtin import RewardFn, resolve_reward
from unirl_pl.rewards.http import decode_images


class RewardHTTPServer(ThreadingHTTPServer):
    """A threading HTTP server holding one reward; requests score one at a time under a lock.

    Args:
        address: (host, port) to bind; port 0 picks a free port (see ``url``).
        reward: The reward callable to serve.
        reward_name: Its name, reported by ``GET /health``.
    """

    # Handler threads must not keep the process alive or block close() on a stuck client.
    daemon_threads = True

    def __init__(self, address: tuple[str, int], reward: RewardFn, reward_name: str) -> None:
        super().__init__(address, _RewardHandler)
        self.reward, self.reward_name = reward, reward_name
        # Connections are served in parallel, but reward models (GPU ones especially) are rarely
        # thread-safe, and serialized calls keep memory bounded: one batch is scored at a time.
        self.reward_lock = threading.Lock()
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
        try:
            with self.server.reward_lock:
                scores = [float(s) for s in self.server.reward(prompts, refined, images)]
        except Exception as err:  # the reward failed: 500, which the client may retry
            self._reply(500, {"error": f"reward {self.server.reward_name!r} failed: {type(err).__name__}: {err}"})
            return
        if len(scores) != len(prompts) or not all(math.isfinite(s) for s in scores):
            self._reply(500, {"error": f"reward {self.server.reward_name!r} returned {scores} for {len(prompts)}"})
            return
        self._reply(200, {"scores": scores})


def serve(
    reward_name: str, host: str = "127.0.0.1", port: int = 0, reward_args: dict[str, Any] | None = None
) -> RewardHTTPServer:
    """Start serving ``reward_name`` (registry name or dotted path) in a background thread.

    Returns the running server: ``server.url`` is where to POST (port 0 binds a free port) and
    ``server.close()`` stops it.
    """
    server = RewardHTTPServer((host, port), resolve_reward(reward_name, reward_args), reward_name)
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
    args = parser.parse_args(argv)
    server = RewardHTTPServer(
        (args.host, args.port), resolve_reward(args.reward, json.loads(args.reward_args)), args.reward
    )
    print(f"serving reward {args.reward!r} at {server.url} (GET {server.url}health)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
