"""Named phases of a training step, reported to a recorder when a tool installs one.

The project marks where its phases run (``with timing.phase("denoise"):``, or ``@timing.timed("optimizer")``
on a whole function); a tool that wants their cost (``python -m unirl_pl bench``) installs a recorder for
the duration of a run with :func:`recording`. Without one, a phase is a context variable read and a
shared do-nothing context: nothing is recorded and nothing allocated, so the marks stay in production code.

A recorder decides what a phase's time means (the bench counts exclusive time: a phase nested in another
is subtracted from it). An ``opaque`` phase asks the recorder to count everything it runs as its own (a
gate that runs the loops itself must not show up as rollout time). The recorder is held in a
:class:`contextvars.ContextVar`, so work a step hands to other threads (remote reward requests) is not
reported into the step's stack.

Phase names used by the project (the bench's rows): ``decode``, ``text_encode``, ``denoise``,
``image_decode``, ``reward``, ``advantages``, ``lm_loss``, ``dit_loss``, ``backward``, ``optimizer``,
``gate_c2``, ``gate_ledger``, ``gate_parity``, ``rollout_glue``, ``train_glue``, ``logging``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Protocol, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class Recorder(Protocol):
    """What :func:`phase` reports to: every ``enter`` is followed by exactly one ``exit`` (also on an error)."""

    def enter(self, name: str, opaque: bool) -> None:
        """Phase ``name`` starts (``opaque``: it owns the time of the phases it runs)."""

    def exit(self) -> None:
        """The innermost phase that entered ends."""


_current: ContextVar[Recorder | None] = ContextVar("unirl_pl_timing_recorder", default=None)


class _Null:
    """The context :func:`phase` returns when nothing records: one shared instance, no state."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


NULL = _Null()


class _Phase:
    __slots__ = ("name", "opaque", "recorder")

    def __init__(self, recorder: Recorder, name: str, opaque: bool) -> None:
        self.recorder, self.name, self.opaque = recorder, name, opaque

    def __enter__(self) -> None:
        self.recorder.enter(self.name, self.opaque)

    def __exit__(self, *exc: object) -> None:
        self.recorder.exit()


def phase(name: str, opaque: bool = False) -> _Null | _Phase:
    """A context manager that reports phase ``name`` to the installed recorder, or does nothing (the shared
    :data:`NULL`) when none is installed. ``opaque``: the recorder counts the phases nested in this one as
    this one's time (gates)."""
    recorder = _current.get()
    if recorder is None:
        return NULL
    return _Phase(recorder, name, opaque)


def timed(name: str, opaque: bool = False) -> Callable[[F], F]:
    """Decorate a function so that each call is phase ``name`` (see :func:`phase`); the recorder is looked up
    at call time, so a function decorated at import is timed by whatever recorder a later run installs."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            recorder = _current.get()
            if recorder is None:
                return fn(*args, **kwargs)
            recorder.enter(name, opaque)
            try:
                return fn(*args, **kwargs)
            finally:
                recorder.exit()

        return wrapper  # type: ignore[return-value]

    return decorate


def current() -> Recorder | None:
    """The recorder phases report to in this context, or None."""
    return _current.get()


@contextmanager
def recording(recorder: Recorder) -> Iterator[Recorder]:
    """Install ``recorder`` for the block (phases in this thread report to it); the previous one (usually
    none) is back afterwards, also on an error."""
    token = _current.set(recorder)
    try:
        yield recorder
    finally:
        _current.reset(token)
