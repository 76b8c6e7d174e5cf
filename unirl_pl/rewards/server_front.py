"""The reward server's HTTP front (:mod:`unirl_pl.rewards.server` starts it, with LitServe): the protocol that
bounds a request's head, and the guard in front of LitServe's endpoint. It runs in the process LitServe forks for
uvicorn; the reward runs in another (:mod:`unirl_pl.rewards.server_worker`).

Everything a client can get wrong is refused here before the request is queued, except what only decoding finds
(the worker refuses that as the request's own reply): nothing a request holds makes LitServe fail the batch it
was queued with.

- :class:`GuardedH11Protocol` (uvicorn's h11 protocol): the request line and headers must arrive in full within
  ``read_timeout_s`` of connecting or of the previous reply, however the bytes trickle in, else the connection is
  closed unanswered (uvicorn itself bounds only an idle kept connection); a reply the client stops reading is
  abandoned after as long; a malformed head is answered with a JSON 400.
- :class:`RequestGuard` (ASGI middleware, before LitServe's route): ``GET /health``, JSON errors for other paths
  and methods, the length checks (411, 413 unread and before ``100 Continue``), one deadline for the whole body
  (408), the JSON and its fields (400); a valid POST to any path goes on to LitServe's endpoint. An error reply
  of LitServe's own becomes ``{"error": ...}`` too, and every error closes the connection.

The front and the worker end when the process that started the server is gone (:func:`exit_with_parent`);
LitServe's queue manager, idle then, does not.
"""

import asyncio
import json
import os
import sys
import threading
import time
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from unirl_pl.rewards.metadata import check_metadata, check_per_sample

# What a request may not get through: (HTTP status, message), answered as {"error": message}.
Refusal = tuple[int, str]


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request head and on a stalled reply (see the module doc).

    ``read_timeout_s`` is set on a subclass per server (:func:`guarded_protocol`).
    """

    read_timeout_s: float = 30.0
    _head_timer: asyncio.TimerHandle | None = None
    _write_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head()

    def _arm_head(self) -> None:
        self._cancel_head()
        self._head_timer = self.loop.call_later(self.read_timeout_s, self._close_unanswered)

    def _cancel_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _close_unanswered(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # Until a whole head is parsed the client's state stays IDLE: bytes trickling in do not move the deadline.
        if self.conn.their_state is not h11.IDLE:
            self._cancel_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # The next head on a kept connection gets its own deadline, from this reply (a pipelined one may be in).
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_head()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.read_timeout_s, self.transport.abort)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        # Called by uvicorn inside its ``except h11.RemoteProtocolError``: that error says what was wrong.
        error = sys.exc_info()[1]
        body = json.dumps({"error": f"bad request syntax: {error or msg}"}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        try:
            for event in (
                h11.Response(status_code=400, headers=[*headers, (b"connection", b"close")], reason=b"Bad Request"),
                h11.Data(data=body),
                h11.EndOfMessage(),
            ):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:  # a reply was already under way: nothing more can be said on this connection
            pass
        self.transport.close()


def guarded_protocol(read_timeout_s: float) -> type[GuardedH11Protocol]:
    """:class:`GuardedH11Protocol` with this ``read_timeout_s``, for uvicorn's ``http`` setting."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"read_timeout_s": read_timeout_s})


def exit_with_parent(parent: int) -> None:
    """End this process (LitServe's worker or HTTP front) once ``parent``, the process that started the server, is
    gone: killed without stopping LitServe, it would leave them serving and polling forever."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class _ClientGone(Exception):
    """The client closed the connection before its body was in: nobody is left to answer."""


async def _reply(send: Any, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))]
    if status >= 400:
        # After an error the rest of the request may be unread: closing keeps it from being taken for the next one.
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


def _error_text(body: bytes) -> str:
    """What an error reply from LitServe or FastAPI (``{"detail": ...}``) says, for ``{"error": ...}``."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return body[:300].decode("utf-8", "replace").strip() or "error"
    if isinstance(parsed, dict):
        for key in ("error", "detail"):
            if key in parsed:
                return parsed[key] if isinstance(parsed[key], str) else json.dumps(parsed[key])
    return json.dumps(parsed)[:300]


def declared_length(headers: list[tuple[bytes, bytes]], max_body_bytes: int) -> int:
    """The body length a request declares, or the refusal: chunked or no length (411), over the limit (413).

    h11 has already refused a malformed or conflicting ``Content-Length`` (400)."""
    names = {name.lower() for name, _ in headers}
    if b"transfer-encoding" in names:
        raise _Refused(411, "chunked request bodies are not accepted; send a Content-Length header")
    lengths = [value for name, value in headers if name.lower() == b"content-length"]
    if not lengths:
        raise _Refused(411, "a Content-Length header is required")
    length = int(lengths[0])
    if length > max_body_bytes:
        raise _Refused(413, f"the body of {length} bytes is over the limit of {max_body_bytes} bytes")
    return length


def check_request(body: bytes) -> Refusal | None:
    """Why a request body is not a scoring request (400), or None. The images are checked when decoded."""
    try:
        request = json.loads(body)
    except RecursionError:
        return 400, "bad request: the JSON is nested too deeply"
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, an over-long integer
        return 400, f"bad request: not JSON ({err})"
    if not isinstance(request, dict):
        return 400, f"bad request: expected a JSON object, got {type(request).__name__}"
    missing = [key for key in ("prompts", "refined_prompts", "images") if key not in request]
    if missing:
        return 400, f"bad request: missing key {', '.join(map(repr, missing))}"
    prompts, refined, images = request["prompts"], request["refined_prompts"], request["images"]
    for key, value in (("prompts", prompts), ("refined_prompts", refined)):
        if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
            return 400, f"bad request: {key!r} must be a list of strings"
    if request.get("metadata") is not None:  # null means none
        try:
            check_metadata(request["metadata"], len(prompts))
        except ValueError as err:
            return 400, f"bad request: {err}"
    if request.get("sources") is not None:  # null means none; the images themselves are checked when decoded
        try:
            check_per_sample(request["sources"], len(prompts), "sources", str, "base64 image string")
        except ValueError as err:
            return 400, f"bad request: {err}"
    if not isinstance(images, list) or not images:
        return 400, "bad request: 'images' must be a non-empty list"
    if not len(prompts) == len(refined) == len(images):
        return 400, (
            f"bad request: {len(prompts)} prompts, {len(refined)} refined prompts and {len(images)} images differ"
        )
    return None


class RequestGuard:
    """ASGI middleware in front of LitServe's endpoint (see the module doc).

    Args:
        app: The application behind it (LitServe's FastAPI app).
        reward_name: Reported by ``GET /health``.
        api_path: LitServe's scoring route, where a valid POST to any path is sent.
        max_body_bytes: Largest request body accepted.
        read_timeout_s: Seconds the body may take to arrive in full.
        parent_pid: The process that started the server: the front ends when it is gone.
    """

    def __init__(
        self,
        app: Any,
        reward_name: str,
        api_path: str,
        max_body_bytes: int,
        read_timeout_s: float,
        parent_pid: int,
    ) -> None:
        self.app, self.reward_name, self.api_path = app, reward_name, api_path
        self.max_body_bytes, self.read_timeout_s, self.parent_pid = max_body_bytes, read_timeout_s, parent_pid

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":  # lifespan: the HTTP front's process starts
            if scope["type"] == "lifespan":
                exit_with_parent(self.parent_pid)
            await self.app(scope, receive, send)
            return
        method, path = scope["method"], scope["path"]
        try:
            if method == "GET":
                if path.rstrip("/") == "/health":
                    await _reply(send, 200, {"status": "ok", "reward": self.reward_name})
                else:
                    await _reply(send, 404, {"error": f"unknown path {path!r}; POST samples to score, GET /health"})
                return
            if method != "POST":
                await _reply(send, 501, {"error": f"Unsupported method ({method!r}); POST samples to score"})
                return
            length = declared_length(scope["headers"], self.max_body_bytes)
            body = await self._read_body(receive, length)
            # Parsing a large body takes a while: off the event loop, so other connections keep their deadlines.
            refusal = await asyncio.to_thread(check_request, body)
            if refusal is not None:
                raise _Refused(*refusal)
        except _Refused as err:
            await _reply(send, err.status, {"error": err.message})
            return
        except _ClientGone:
            return
        except Exception as err:  # a bug here must still answer, and in JSON
            await _reply(send, 500, {"error": f"the server failed reading the request: {type(err).__name__}: {err}"})
            return
        await self.app(self._to_endpoint(scope), self._replay(body, receive), self._json_errors(send))

    async def _read_body(self, receive: Any, length: int) -> bytes:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.read_timeout_s  # one deadline for the whole body, however it trickles in
        chunks, got = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except TimeoutError:
                late = f"the body did not arrive within {self.read_timeout_s:g} s ({got} of {length} bytes)"
                raise _Refused(408, late) from None
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunks.append(message.get("body", b""))
            got += len(chunks[-1])
            if not message.get("more_body", False):
                break
        if got != length:  # h11 frames the body by its Content-Length; this is a safeguard
            raise _Refused(400, f"the body holds {got} bytes, not the {length} declared")
        return b"".join(chunks)

    def _to_endpoint(self, scope: dict[str, Any]) -> dict[str, Any]:
        # Any path scores (the protocol's "POST any path"); LitServe reads the body as JSON whatever it was labeled.
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
        return {
            **scope,
            "path": self.api_path,
            "raw_path": self.api_path.encode(),
            "query_string": b"",
            "headers": [*headers, (b"content-type", b"application/json")],
        }

    @staticmethod
    def _replay(body: bytes, receive: Any) -> Any:
        sent = False

        async def replay() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: what the connection says next (a disconnect)

        return replay

    @staticmethod
    def _json_errors(send: Any) -> Any:
        """``send`` for LitServe's replies: an error status is re-sent as ``{"error": ...}`` that closes."""
        held: dict[str, Any] = {}

        async def relay(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                held.update(status=message["status"], body=b"")
                return
            if "status" not in held:
                await send(message)
                return
            held["body"] += message.get("body", b"")
            if not message.get("more_body", False):
                await _reply(send, held["status"], {"error": _error_text(held["body"])})

        return relay
