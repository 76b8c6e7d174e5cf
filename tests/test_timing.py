"""unirl_pl.timing: phases reach the installed recorder in order, and cost nothing without one."""

from __future__ import annotations

import inspect
import sys
import threading
import time

import pytest

from unirl_pl import timing


class Log:
    """A recorder that writes down what it is told."""

    def __init__(self) -> None:
        self.events: list[tuple[str, ...]] = []

    def enter(self, name: str, opaque: bool) -> None:
        self.events.append(("enter", name, "opaque" if opaque else ""))

    def exit(self) -> None:
        self.events.append(("exit",))


class Counting:
    """A recorder that must never be called."""

    calls = 0

    def enter(self, name: str, opaque: bool) -> None:
        Counting.calls += 1

    def exit(self) -> None:
        Counting.calls += 1


def test_without_a_recorder_a_phase_is_the_shared_null_context_and_cheap():
    assert timing.current() is None
    seen = {id(timing.phase("denoise")) for _ in range(10_000)}
    assert seen == {id(timing.NULL)}  # nothing allocated per call
    calls = []

    @timing.timed("optimizer")
    def step(x: int) -> int:
        calls.append(x)
        return x + 1

    start = time.perf_counter()
    for i in range(10_000):
        with timing.phase("decode"):
            pass
        assert step(i) == i + 1
    per_call = (time.perf_counter() - start) / 10_000
    assert len(calls) == 10_000
    assert per_call < 50e-6, f"{per_call * 1e6:.1f} us per phase + timed call without a recorder"


def test_phases_reach_the_recorder_nested_and_in_order():
    log = Log()

    @timing.timed("gate_c2", opaque=True)
    def gate() -> str:
        with timing.phase("decode"):
            return "ran"

    with timing.recording(log):
        with timing.phase("rollout_glue"):
            with timing.phase("denoise"):
                pass
        assert gate() == "ran"
    assert log.events == [
        ("enter", "rollout_glue", ""),
        ("enter", "denoise", ""),
        ("exit",),
        ("exit",),
        ("enter", "gate_c2", "opaque"),
        ("enter", "decode", ""),
        ("exit",),
        ("exit",),
    ]
    assert timing.current() is None


def test_an_error_still_exits_every_phase_and_uninstalls_the_recorder():
    log = Log()

    @timing.timed("optimizer")
    def fails() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"), timing.recording(log):
        with timing.phase("train_glue"):
            fails()
    assert [e[0] for e in log.events] == ["enter", "enter", "exit", "exit"]
    assert timing.current() is None


def test_recording_nests_and_restores_the_previous_recorder():
    outer, inner = Log(), Log()
    with timing.recording(outer):
        with timing.recording(inner):
            with timing.phase("reward"):
                pass
        assert timing.current() is outer
        with timing.phase("advantages"):
            pass
    assert inner.events == [("enter", "reward", ""), ("exit",)]
    assert outer.events == [("enter", "advantages", ""), ("exit",)]


@pytest.mark.skipif(
    getattr(sys.flags, "thread_inherit_context", False), reason="new threads inherit the context on this build"
)
def test_other_threads_do_not_report_into_the_installing_threads_recorder():
    Counting.calls = 0
    seen = []

    def worker() -> None:
        seen.append(timing.current())
        with timing.phase("reward"):
            pass

    with timing.recording(Counting()):
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
    assert seen == [None] and Counting.calls == 0


def test_timed_keeps_the_signature_lightning_inspects():
    def training_step(self, exp: object, batch_idx: int) -> None:
        """Doc."""

    wrapped = timing.timed("train_glue")(training_step)
    assert wrapped.__wrapped__ is training_step
    assert wrapped.__name__ == "training_step" and wrapped.__doc__ == "Doc."
    assert list(inspect.signature(wrapped).parameters) == ["self", "exp", "batch_idx"]
