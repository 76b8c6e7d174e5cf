"""One HTTP POST with a deadline, bounded retries, no redirects and a reply size cap, for the remote rewards.

Both remote rewards (``http``, ``vlm_judge``) send their requests through :func:`post`. It speaks HTTP
with :mod:`http.client` directly (standard library only) because ``urllib``'s timeout bounds each
socket operation, not the request: a server sending one byte every 0.8 s held a client with a 2 s
timeout for 32 s. Here every connect, send and receive of an attempt gets only the time left before
that attempt's deadline, so an attempt ends ``deadline_s`` after it started, whatever the peer does.

Semantics of :func:`post`:

- **Deadline**: each attempt (connect, TLS handshake, sending the body, the status line, the headers and
  the whole reply body) must finish within ``deadline_s``; then the connection is closed and abandoned.
  Name resolution is the one step the deadline cannot interrupt (the system resolver's own timeout).
- **Retries**: a timeout, a refused, reset or dropped connection, a malformed reply, a 5xx, a 408 or a
  429 is retried up to ``max_retries`` times, after ``backoff_s``, ``2 * backoff_s``, ... seconds. All
  attempts and waits together stay within ``total_s``, by default
  ``deadline_s * (max_retries + 1) + backoff_s * (2 ** max_retries - 1)`` (every attempt may use its
  whole deadline); a retry that the budget cannot hold is not started. Then :class:`TransportFailed`.
- **Retry-After**: a 429 or 503 with a ``Retry-After`` header (delta-seconds, or an HTTP-date) waits that
  long before the next attempt instead of the backoff. A wait that would reach past the time budget is not
  slept: the call fails at once, saying how long the server asked to wait. A value that is neither
  (``soon``, ``-1``, ``1.5``) is ignored and the backoff applies.
- **Rejected at once**: a 4xx other than 408 and 429 (:class:`RequestRejected`, with the status and
  the first 300 bytes of the reply), and any 3xx: redirects are never followed, so the headers (an
  ``Authorization`` bearer token included) only ever go to the configured URL.
- **Reply cap**: a reply body over ``max_reply_bytes`` (declared or actually sent) is refused with a
  :class:`RewardServerError`, not retried; a peer cannot make the client buffer more than the cap.
- **Proxies**: a loopback host (``localhost``, ``127.*``, ``::1``) is always reached directly, since
  cluster environments often set an ``http_proxy`` that does not list loopback in ``no_proxy``. Other
  hosts honor ``http_proxy`` / ``https_proxy`` / ``no_proxy`` as ``urllib`` reads them: plain HTTP goes to
  the proxy with the absolute URL, HTTPS through a ``CONNECT`` tunnel (whose setup is bounded per read,
  not by the deadline). ``user:password@`` in the proxy URL becomes a ``Proxy-Authorization`` header.

Nothing is kept between calls (no pooled connection), so objects that call :func:`post` stay picklable.
"""

from __future__ import annotations

import base64
import email.utils
import http.client
import io
import ipaddress
import time
import urllib.parse
import urllib.request
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

MAX_REPLY_BYTES = 64 * 2**20  # far above any scores or chat reply; a cap, not an expected size
DETAIL_BYTES = 300  # how much of an error reply's body a message quotes
_SEND_CHUNK = 64 * 2**10  # the deadline is re-armed between chunks of the request body
RETRIED_STATUSES = frozenset({408, 429})  # besides every 5xx
RETRY_AFTER_STATUSES = frozenset({429, 503})  # whose Retry-After header sets the wait before the next attempt


class RewardServerError(RuntimeError):
    """A reward server could not be reached, failed, or answered something that breaks the protocol."""

    def __init__(self, message: str, url: str = "", attempts: int = 0, status: int | None = None) -> None:
        super().__init__(message)
        self.url, self.attempts, self.status = url, attempts, status


class RequestRejected(RewardServerError):
    """The server answered with a status that a retry would not change: a 4xx other than 408/429, or a
    redirect (3xx, never followed). ``status`` is the HTTP status."""


class TransportFailed(RewardServerError):
    """Every attempt failed in transport (timeout, connection error, malformed reply, 5xx, 408, 429), or
    the time budget ran out; ``attempts`` says how many were made, ``status`` is the last HTTP status
    received (None when the last attempt got no reply)."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a URL's hostname, without brackets) names this machine's loopback interface."""
    host = host.lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a DNS name other than localhost
        return False


def retry_budget(deadline_s: float, max_retries: int, backoff_s: float) -> float:
    """The default ``total_s`` of :func:`post`: every attempt's deadline plus every backoff wait."""
    return deadline_s * (max_retries + 1) + backoff_s * (2**max_retries - 1)


def post(
    url: str,
    body: bytes,
    headers: Mapping[str, str] | None = None,
    *,
    deadline_s: float,
    max_retries: int = 0,
    backoff_s: float = 0.5,
    total_s: float | None = None,
    max_reply_bytes: int = MAX_REPLY_BYTES,
    label: str = "server",
) -> bytes:
    """POST ``body`` to ``url`` and return the body of its 2xx reply (see the module docstring).

    Args:
        url: ``http://`` or ``https://`` URL; its path and query are the request target.
        body: The request body, sent with a ``Content-Length``.
        headers: Request headers (``Content-Type``, ``Authorization``, ...); sent to ``url`` only.
        deadline_s: Seconds one attempt may take in all: connect, send, headers and the whole reply.
        max_retries: Further attempts after a retryable failure (0: try once).
        backoff_s: Wait before the first retry; doubles for each one after. A 429/503's ``Retry-After``
            replaces the wait after that reply.
        total_s: Seconds all attempts and waits may take together; default :func:`retry_budget`.
        max_reply_bytes: Largest reply body accepted.
        label: How messages name the peer, e.g. ``"reward server"`` or ``"VLM judge"``.

    Raises:
        RequestRejected: a 3xx (redirects are not followed) or a 4xx other than 408/429, at once.
        TransportFailed: the last retryable failure, once the retries or the time budget are spent.
        RewardServerError: a reply larger than ``max_reply_bytes`` (not retried).
        ValueError: a URL that is not http(s), or a negative limit.
    """
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"url must be http:// or https:// with a host, got {url!r}")
    if deadline_s <= 0 or max_retries < 0 or backoff_s < 0 or max_reply_bytes < 0:
        raise ValueError(
            "need deadline_s > 0, max_retries >= 0, backoff_s >= 0, max_reply_bytes >= 0; got "
            f"{deadline_s}, {max_retries}, {backoff_s}, {max_reply_bytes}"
        )
    budget = retry_budget(deadline_s, max_retries, backoff_s) if total_s is None else total_s
    # The server closes after its reply, so no half-read connection lingers on either side.
    sent = {"Connection": "close", **(headers or {})}
    start = time.monotonic()
    end = start + budget
    last, status, attempts = "no attempt fitted in the time budget", None, 0
    asked: float | None = None  # the last reply's Retry-After, in seconds
    for attempt in range(max_retries + 1):
        if attempt:
            pause = backoff_s * 2 ** (attempt - 1) if asked is None else asked
            if time.monotonic() + pause >= end:
                if asked is None:
                    last += f" (the {budget:g} s time budget leaves no room for another attempt)"
                else:  # sleeping first would only fail later: the server said it will not be ready in time
                    left = max(end - time.monotonic(), 0.0)
                    last += (
                        f" (the server asked to wait {asked:g} s before retrying (Retry-After), more than the "
                        f"{left:.1f} s left of the {budget:g} s time budget)"
                    )
                break
            time.sleep(pause)
        began = time.monotonic()
        deadline = min(began + deadline_s, end)
        if deadline <= began:
            break
        attempts += 1
        asked = None  # only a 429/503 reply of this attempt replaces the next backoff
        try:
            return _attempt(url, parts, body, sent, deadline, max_reply_bytes, label, attempts)
        except _Retryable as err:
            last, status, asked = str(err), err.status, err.retry_after
        except TimeoutError:  # a socket timeout, or the deadline passing between two reads
            cut = (
                f" (this attempt cut to {deadline - began:.2f} s by the {budget:g} s time budget, total_s)"
                if deadline < began + deadline_s
                else ""
            )
            last, status = f"TimeoutError: no complete reply within the {deadline_s:g} s deadline{cut}", None
        except (OSError, http.client.HTTPException) as err:  # refused, reset, dropped, malformed reply
            last, status = f"{type(err).__name__}: {err}".rstrip(": "), None
    plural = "" if attempts == 1 else "s"
    raise TransportFailed(
        f"{label} {url} failed after {attempts} attempt{plural} in {time.monotonic() - start:.1f} s: {last}",
        url,
        attempts,
        status,
    )


class _Retryable(Exception):
    """A reply whose status may change on a retry (5xx, 408, 429), and the wait its Retry-After asks for."""

    def __init__(self, message: str, status: int, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.retry_after = status, retry_after


def retry_after_s(value: str | None) -> float | None:
    """Seconds a ``Retry-After`` header value asks to wait: delta-seconds (``"120"``) or an HTTP-date (the
    time left until it, 0 once past); None for anything else, so that a garbled value falls back to the backoff."""
    text = (value or "").strip()
    if text.isascii() and text.isdigit():
        try:
            return float(int(text))
        except (ValueError, OverflowError):  # more digits than int() or a float holds: no sane wait, garbage
            return None
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):  # not a date either
        return None
    if when.tzinfo is None:  # "-0000" parses naive; an HTTP-date is always GMT
        when = when.replace(tzinfo=UTC)
    return max((when - datetime.now(UTC)).total_seconds(), 0.0)


def _attempt(
    url: str,
    parts: urllib.parse.SplitResult,
    body: bytes,
    headers: dict[str, str],
    deadline: float,
    max_reply_bytes: int,
    label: str,
    attempt: int,
) -> bytes:
    where = f"{label} {url}"
    conn, target, extra = _connection(parts, deadline)
    reply = None
    try:
        conn.connect()
        conn.sock = DeadlineSocket(conn.sock, deadline)  # every later send and read gets the time left
        conn.request("POST", target, body=body, headers={**headers, **extra})
        reply = conn.getresponse()
        status = reply.status
        if 200 <= status < 300:
            return _read_capped(reply, max_reply_bytes, url, where, attempt)
        if 300 <= status < 400:
            location = reply.getheader("Location", "(no Location header)")
            raise RequestRejected(
                f"{where} answered HTTP {status} {reply.reason} redirecting to {location!r}: redirects are not "
                "followed (headers such as Authorization go only to the configured url); set url to the final address",
                url,
                attempt,
                status,
            )
        detail = _detail(reply)
        what = f"HTTP {status} {reply.reason}" + (f": {detail}" if detail else "")
        if status >= 500 or status in RETRIED_STATUSES:
            wait = retry_after_s(reply.getheader("Retry-After")) if status in RETRY_AFTER_STATUSES else None
            raise _Retryable(what, status, wait)
        raise RequestRejected(
            f"{where} rejected the request: {what} (attempt {attempt}; a 4xx other than 408/429 is not retried)",
            url,
            attempt,
            status,
        )
    finally:
        # On success, failure and abandon alike nothing outlives the call. A reply that closes its
        # connection has already been detached from ``conn``, so it is closed on its own.
        if reply is not None:
            reply.close()
        conn.close()


def _connection(
    parts: urllib.parse.SplitResult, deadline: float
) -> tuple[http.client.HTTPConnection, str, dict[str, str]]:
    """The connection for one attempt (direct or through the environment's proxy), the request target,
    and any proxy headers to add."""
    host, https = parts.hostname or "", parts.scheme == "https"
    port = parts.port or (443 if https else 80)
    timeout = max(deadline - time.monotonic(), 1e-3)
    target = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
    cls: type[http.client.HTTPConnection] = http.client.HTTPSConnection if https else http.client.HTTPConnection
    proxy = None if is_loopback(host) or urllib.request.proxy_bypass(host) else _proxy(parts.scheme)
    if proxy is None:
        return cls(host, port, timeout=timeout), target, {}
    proxy_host, proxy_port, auth = proxy
    if https:  # a CONNECT tunnel: the proxy sees only host:port, the TLS session is end to end
        conn = http.client.HTTPSConnection(proxy_host, proxy_port, timeout=timeout)
        conn.set_tunnel(host, port, headers=auth)
        return conn, target, {}
    # Plain HTTP through a proxy: the absolute URL as the target (http.client sets Host from it).
    netloc = f"[{host}]" if ":" in host else host
    absolute = urllib.parse.urlunsplit(("http", f"{netloc}:{port}", parts.path or "/", parts.query, ""))
    return http.client.HTTPConnection(proxy_host, proxy_port, timeout=timeout), absolute, auth


def _proxy(scheme: str) -> tuple[str, int, dict[str, str]] | None:
    """(host, port, proxy headers) of the environment's proxy for ``scheme``, or None."""
    address = urllib.request.getproxies().get(scheme)
    if not address:
        return None
    if "://" not in address:  # "proxy:3128", as curl and urllib accept it
        address = "http://" + address
    proxy = urllib.parse.urlsplit(address)
    if not proxy.hostname:
        return None
    auth = {}
    if proxy.username is not None:
        user = urllib.parse.unquote(proxy.username)
        password = urllib.parse.unquote(proxy.password or "")
        token = base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
        auth["Proxy-Authorization"] = f"Basic {token}"
    return proxy.hostname, proxy.port or 80, auth


def _read_capped(reply: http.client.HTTPResponse, cap: int, url: str, where: str, attempt: int) -> bytes:
    declared = reply.getheader("Content-Length")
    length = int(declared) if declared is not None and declared.strip().isdigit() else None
    too_large = f"{where}: the reply is larger than the {cap}-byte cap (max_reply_bytes); not read"
    if length is not None and length > cap:
        raise RewardServerError(too_large, url, attempt, reply.status)
    chunks, size = [], 0
    while chunk := reply.read(min(_SEND_CHUNK, cap + 1 - size)):
        chunks.append(chunk)
        size += len(chunk)
        if size > cap:  # no or a false Content-Length: the count of what arrived is what matters
            raise RewardServerError(too_large, url, attempt, reply.status)
    if length is not None and size < length:  # http.client returns b"" at a premature end, without raising
        raise http.client.IncompleteRead(b"".join(chunks), length - size)
    return b"".join(chunks)


def _detail(reply: http.client.HTTPResponse) -> str:
    """The start of an error reply's body, for the message; what cannot be read is left out."""
    try:
        return reply.read(DETAIL_BYTES).decode("utf-8", "replace").strip()
    except (OSError, http.client.HTTPException):  # only a hint: a broken body must not hide the status
        return ""


class DeadlineSocket:
    """A connected socket whose every send and receive waits at most until ``deadline`` (a
    ``time.monotonic()`` value, which may be moved on: the reward server sets one per request head and body).

    ``http.client`` reads a reply through ``sock.makefile("rb")`` and sends with ``sock.sendall``; both
    go through here, and each operation first sets the socket timeout to the time left (raising
    ``TimeoutError`` once none is), so a peer trickling bytes cannot stretch the request.
    """

    def __init__(self, sock: Any, deadline: float) -> None:
        self._sock, self.deadline = sock, deadline
        # Like a socket's makefile references: http.client closes the connection as soon as a reply
        # that ends with the connection is read, and the reply's reader must keep the socket open.
        self._readers, self._closed = 0, False

    def _arm(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the deadline passed")
        self._sock.settimeout(left)

    def sendall(self, data: bytes) -> None:
        view = memoryview(data)
        for lo in range(0, len(view), _SEND_CHUNK):
            self._arm()
            self._sock.sendall(view[lo : lo + _SEND_CHUNK])

    def recv_into(self, buffer: Any, nbytes: int = 0) -> int:
        self._arm()
        return self._sock.recv_into(buffer, nbytes)

    def makefile(self, mode: str = "rb", *args: Any, **kwargs: Any) -> io.BufferedReader:
        self._readers += 1
        return io.BufferedReader(_DeadlineReader(self))

    def reader_closed(self) -> None:
        self._readers -= 1
        if self._closed:
            self.close()

    def close(self) -> None:
        self._closed = True
        if self._readers <= 0:
            self._sock.close()

    def __getattr__(self, name: str) -> Any:  # setsockopt, fileno, ...: the real socket's
        return getattr(self._sock, name)


class _DeadlineReader(io.RawIOBase):
    """The raw stream under a reply's buffered reader: each read is one deadline-bound receive."""

    def __init__(self, sock: DeadlineSocket) -> None:
        super().__init__()
        self._sock = sock

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        return self._sock.recv_into(buffer)

    def close(self) -> None:
        if not self.closed:
            self._sock.reader_closed()
        super().close()
