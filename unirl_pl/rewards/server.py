"""Reference reward server: serves any registered (or dotted-path) reward over the HTTP reward protocol, on LitServe.

Run ``python -m unirl_pl serve-reward --reward pickscore --reward-args '{"device": "cuda:1"}'`` (its command line:
:mod:`unirl_pl.rewards.server_cli`) and point an ``http`` reward at ``http://127.0.0.1:8000/``. ``POST`` (any path)
takes ``{"prompts", "refined_prompts", "images"}`` (and optionally ``"metadata"``, one object or null per sample,
handed to a reward that declares a ``metadata`` parameter, and ``"sources"``, one base64 source image or null per
sample, handed decoded to a reward that declares ``sources``) and answers ``{"scores": [...]}``; ``GET /health``
answers ``{"status": "ok", "reward": name}``. LitServe (the ``serve`` extra: ``pip install 'unirl_pl[serve]'``) runs
the reward in a worker process of its own (:mod:`unirl_pl.rewards.server_worker`) and batches concurrent requests
(several trainer ranks, or one client's overlapping calls): the requests that reach the worker within ``batch_wait_s``
of each other are scored together, in reward calls of one image size and at most ``max_batch_size`` samples. Requests
are bounded (body size, head and body read time, PNG/JPEG only, pixels per image and per request:
:mod:`unirl_pl.rewards.server_front`); every refusal is a JSON ``{"error": ...}`` with its 4xx/5xx status, and the
connection is closed after it. To serve a model whose dependencies cannot live in the trainer's environment, serve
your own reward class by dotted path, or speak the protocol from any framework (docs/rewards.md).
"""

from __future__ import annotations

import atexit
import gc
import http.client
import json
import logging
import os
import socket
import threading
import time
from multiprocessing import get_context
from types import ModuleType
from typing import Any

from unirl_pl.rewards.http import MAX_IMAGE_PIXELS, MAX_TOTAL_PIXELS

MAX_BODY_BYTES = 64 * 2**20
READ_TIMEOUT_S = 30.0
START_TIMEOUT_S = 900.0
# The interfaces LitServe binds (LitServer.run refuses any other host).
HOSTS = ("127.0.0.1", "0.0.0.0", "::")
INSTALL = "pip install 'unirl_pl[serve]'"


def _parts() -> tuple[ModuleType, ModuleType]:
    """The server's parts on LitServe (front, worker), or an ImportError naming the missing package and how to
    install it."""
    try:
        from unirl_pl.rewards import server_front, server_worker
    except ImportError as err:
        if err.name is None or err.name.startswith("unirl_pl"):
            raise
        raise ImportError(
            f"the reward server needs the {err.name!r} package (the serve extra): {INSTALL}", name=err.name
        ) from None
    return server_front, server_worker


class RewardServer:
    """One reward served by LitServe: :meth:`start` runs it in a background thread, :meth:`close` stops it.

    Every request is bounded before the reward sees it: a ``Content-Length`` is required (411) and may not exceed
    ``max_body_bytes`` (413, refused unread); the request line and headers must arrive within ``read_timeout_s``
    (else the connection is closed, unanswered), the body within another ``read_timeout_s`` (408); the JSON must
    parse (400, deep nesting included); ``prompts`` and ``refined_prompts`` must be lists of strings as long as
    ``images`` (400); ``metadata``, when present and not null, must be a list as long as ``prompts`` of JSON objects
    or nulls (400); ``sources``, when present and not null, a list as long as ``prompts`` of base64 strings or nulls
    (400); images and source images must be PNG or JPEG (400) within the pixel limits, the sources' pixels counted
    with the images' (413, checked from the image header before decoding). Each error reply is ``{"error": "..."}``
    and closes the connection. A reward call that raises, or returns the wrong count or a non-finite score, fails
    only the request that causes it (500).

    Args:
        reward_name: Registry name or dotted path; the reward is built in LitServe's worker process.
        reward_args: Its constructor keyword arguments.
        host: Interface to bind: ``127.0.0.1``, ``0.0.0.0`` or ``::`` (the ones LitServe binds).
        port: Port to bind; 0 picks a free one (see ``url``).
        max_batch_size: Most samples per reward call when requests are batched together.
        batch_wait_s: How long LitServe's worker collects requests into a batch (its ``batch_timeout``).
        max_body_bytes: Largest request body accepted.
        read_timeout_s: Seconds the request line and headers may take to arrive in full (counted from the
            connection's start or its previous reply, so also how long an idle connection is kept), the same
            again for the body, and how long a reply may wait for a client that stopped reading.
        max_image_pixels: Most pixels (width x height) of one image or video frame.
        max_total_pixels: Most pixels of all the images and frames of one request.
        start_timeout_s: Seconds :meth:`start` waits for ``GET /health`` to answer (building the reward included)
            before it gives up with a RuntimeError.
    """

    def __init__(
        self,
        reward_name: str,
        reward_args: dict[str, Any] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        max_batch_size: int = 64,
        batch_wait_s: float = 0.005,
        max_body_bytes: int = MAX_BODY_BYTES,
        read_timeout_s: float = READ_TIMEOUT_S,
        max_image_pixels: int = MAX_IMAGE_PIXELS,
        max_total_pixels: int = MAX_TOTAL_PIXELS,
        start_timeout_s: float = START_TIMEOUT_S,
    ) -> None:
        if (
            max_batch_size < 1
            or batch_wait_s < 0
            or max_body_bytes < 1
            or read_timeout_s <= 0
            or max_image_pixels < 1
            or max_total_pixels < 1
            or start_timeout_s <= 0
        ):
            raise ValueError(
                "need max_batch_size >= 1, batch_wait_s >= 0, max_body_bytes >= 1, read_timeout_s > 0, "
                "max_image_pixels >= 1, max_total_pixels >= 1, start_timeout_s > 0; got "
                f"{max_batch_size}, {batch_wait_s}, {max_body_bytes}, {read_timeout_s}, {max_image_pixels}, "
                f"{max_total_pixels}, {start_timeout_s}"
            )
        if host not in HOSTS:
            raise ValueError(f"host must be one of {', '.join(HOSTS)} (the interfaces LitServe binds), got {host!r}")
        front, worker = _parts()
        self.reward_name, self.host, self.port, self.read_timeout_s = reward_name, host, port, read_timeout_s
        self.start_timeout_s = start_timeout_s
        # The worker is spawned: what it reports goes through a pipe of the same start method.
        self._setup_errors, setup_errors = get_context("spawn").Pipe(duplex=False)
        self.api = worker.RewardAPI(
            reward_name,
            dict(reward_args or {}),
            max_batch_size,
            batch_wait_s,
            max_image_pixels,
            max_total_pixels,
            setup_errors,
            os.getpid(),
        )
        self._server = worker.ls.LitServer(
            self.api,
            accelerator="cpu",  # one worker; the reward puts itself on the device its reward_args name
            devices=1,
            workers_per_device=1,
            timeout=False,  # a request waits for its batch however long: the client holds the deadline
            disable_openapi_url=True,
            middlewares=[
                (
                    front.RequestGuard,
                    {
                        "reward_name": reward_name,
                        "api_path": self.api.api_path,
                        "max_body_bytes": max_body_bytes,
                        "read_timeout_s": read_timeout_s,
                        "parent_pid": os.getpid(),
                    },
                )
            ],
        )
        # Stopping waits this long for open connections (read_timeout_s bounds each one's head and body).
        self._server.uvicorn_graceful_timeout = read_timeout_s
        self._protocol = front.guarded_protocol(read_timeout_s)
        # Set when LitServer.run returns. Waited on instead of the thread: a join interrupted by Ctrl-C marks the
        # thread stopped while it runs on (CPython 3.11).
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._serving = False

    @property
    def url(self) -> str:
        """The base URL clients POST to, with the port actually bound."""
        return f"http://{f'[{self.host}]' if ':' in self.host else self.host}:{self.port}/"

    def start(self) -> RewardServer:
        """Bind, build the reward in LitServe's worker and return once ``GET /health`` answers.

        Raises:
            OSError: the port cannot be bound.
            ValueError: the reward cannot be built (unknown name, bad ``reward_args``, ...): one line saying why.
            RuntimeError: LitServe stopped before serving, or did not serve within ``start_timeout_s``.
        """
        self.port = _free_port(self.host, self.port)
        # LitServe forks its queue manager and its HTTP front from this process. A garbage collection in a forked
        # child runs the destructors of this process's unreachable objects there, where their threads do not
        # exist: an earlier reward's onnxruntime session hung a child forever that way. So the garbage is
        # collected here and what is left frozen (never collected in a child) until the forks are done.
        gc.collect()
        gc.freeze()
        try:
            self._start()
        finally:
            gc.unfreeze()
        self._serving = True
        return self

    def _start(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        self._thread = threading.Thread(target=self._run, name=f"reward-server-{self.reward_name}", daemon=True)
        self._thread.start()
        atexit.register(self.close)  # before multiprocessing's own exit, which would wait for the worker forever
        while not self.healthy():  # LitServe starts uvicorn once its worker has built the reward
            if self._setup_errors.poll():
                self._stopped.wait(timeout=30)  # LitServe stops on its own once the worker reports the failure
                raise ValueError(self._setup_errors.recv())
            if self._stopped.is_set():
                raise RuntimeError(f"LitServe stopped before serving: {self._failure!r}")
            workers = getattr(self._server, "inference_workers", None) or []
            gone = [p.exitcode for p in workers if p.exitcode is not None]
            if gone and not self._setup_errors.poll(0.5):  # a setup failure's message may still be on its way
                raise RuntimeError(f"the reward worker exited (code {gone[0]}) before serving")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the reward server did not answer GET /health within start_timeout_s={self.start_timeout_s:g} s"
                )
            time.sleep(0.05)

    def _run(self) -> None:
        try:
            self._server.run(
                host=self.host,
                port=self.port,
                num_api_servers=1,
                log_level="error",  # uvicorn's and LitServe's: one line per request would drown a training log
                generate_client_file=False,
                api_server_worker_type="process",
                http=self._protocol,
                timeout_keep_alive=self.read_timeout_s,
                access_log=False,
            )
        except BaseException as err:  # start() reports it
            self._failure = err
        finally:
            self._stopped.set()

    def healthy(self) -> bool:
        """Whether ``GET /health`` answers, within 2 s, that this reward is served."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        conn = http.client.HTTPConnection(host, self.port, timeout=2)
        try:
            conn.request("GET", "/health")
            reply = conn.getresponse()
            return reply.status == 200 and json.loads(reply.read()).get("reward") == self.reward_name
        except (OSError, http.client.HTTPException, ValueError):
            return False
        finally:
            conn.close()

    def wait(self) -> None:
        """Block until the server stops (LitServe stops it when its worker dies)."""
        while self._thread is not None and not self._stopped.wait(timeout=0.5):
            pass

    def close(self) -> None:
        """Stop serving: the HTTP front, the worker and LitServe's queue manager."""
        shutdown = getattr(self._server, "_shutdown_event", None)  # set by LitServer.run; what its own stop waits on
        if self._thread is not None and not self._stopped.is_set() and shutdown is not None:
            # LitServe's worker monitor polls the queue manager that its shutdown stops: its crash on the closed
            # connection is the shutdown, not an error.
            logging.getLogger("litserve.server").addFilter(_monitor_after_shutdown)
            shutdown.set()
            # Serving, LitServe stops within uvicorn's grace period; before serving (a worker that died while
            # starting) it waits for a worker that will never be ready, and only the process's exit ends it.
            self._stopped.wait(timeout=self.read_timeout_s + 30 if self._serving else 5)
        atexit.unregister(self.close)
        self._thread, self._serving = None, False


def _monitor_after_shutdown(record: logging.LogRecord) -> bool:
    """Drops LitServe's "Monitoring worker crashed" when the crash is the queue manager's connection closing."""
    error = record.exc_info[1] if record.exc_info else None
    return not (record.getMessage() == "Monitoring worker crashed" and isinstance(error, EOFError | OSError))


def _free_port(host: str, port: int) -> int:
    """``port``, or a free one for 0, after checking it can be bound (uvicorn would exit the process instead)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds it
        sock.bind((host, port))
        return sock.getsockname()[1]


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
    start_timeout_s: float = START_TIMEOUT_S,
) -> RewardServer:
    """Start serving ``reward_name`` (registry name or dotted path) in the background (:class:`RewardServer`).

    Returns the running server: ``server.url`` is where to POST (port 0 binds a free port) and
    ``server.close()`` stops it.
    """
    return RewardServer(
        reward_name,
        reward_args,
        host,
        port,
        max_batch_size,
        batch_wait_s,
        max_body_bytes,
        read_timeout_s,
        max_image_pixels,
        max_total_pixels,
        start_timeout_s,
    ).start()
