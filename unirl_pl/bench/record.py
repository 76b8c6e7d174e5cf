"""The bench's accounting: the table's rows, the recorder the project's phases report to, one run's results.

The project marks its phases with :mod:`unirl_pl.timing`; :class:`Recorder` is installed for the fit
(``timing.recording``) and turns them into exclusive CPU seconds per row. Nothing of the project is
replaced or wrapped at run time.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

PHASES: tuple[str, ...] = (
    "decode",
    "text_encode",
    "denoise",
    "image_decode",
    "reward",
    "advantages",
    "lm_loss",
    "lm_backward",
    "dit_loss",
    "dit_backward",
    "optimizer",
    "gate_c2",
    "gate_ledger",
    "gate_parity",
    "rollout_glue",
    "train_glue",
    "logging",
    "overhead",
)
"""Rows of the table: each a disjoint share of the step. ``rollout_glue`` is the rest of
``ExperienceSource.collect`` and ``train_glue`` the rest of ``training_step`` (metrics, staleness, zero_grad,
finiteness checks), ``logging`` is the module's metric writes, and ``overhead`` is what no other row covers
(Lightning's loop, batch fetch, callback dispatch)."""

PROJECT_ONLY = ("gate_c2", "gate_ledger", "gate_parity", "rollout_glue", "train_glue", "logging", "overhead")

GATE_PHASES = ("gate_c2", "gate_ledger", "gate_parity")

clock = time.process_time


class _Frame:
    __slots__ = ("children", "name", "opaque", "start")

    def __init__(self, name: str, opaque: bool, start: float) -> None:
        self.name, self.opaque, self.start, self.children = name, opaque, start, 0.0


class Recorder:
    """Exclusive CPU time per phase: a phase nested in another is subtracted from its parent.

    An ``opaque`` phase (a gate) owns everything it runs: loops a gate runs are not counted as loop phases.
    The project reports its backward passes as one ``backward`` phase; the row is named by the loss it runs
    in: ``dit_backward`` inside ``dit_loss`` (the DiT's per-step backward), ``lm_backward`` elsewhere (the
    LM's loss, backpropagated per micro-batch inside ``lm_loss`` or by ``training_step`` after the losses).

    Args:
        clock: Seconds as a float (CPU time of the process; a test passes a fake one).
    """

    def __init__(self, clock: Callable[[], float] = clock) -> None:
        self.clock = clock
        self.totals: dict[str, float] = defaultdict(float)
        self._stack: list[_Frame | None] = []  # None: a phase entered where nothing is recorded
        self._opaque = 0

    def current(self) -> str | None:
        """The innermost phase being timed."""
        return self._stack[-1].name if self._stack and self._stack[-1] is not None else None

    def enter(self, name: str, opaque: bool = False) -> None:
        """Phase ``name`` starts (:class:`unirl_pl.timing.Recorder`)."""
        if self._opaque:
            self._stack.append(None)
            return
        if name == "backward":
            name = "dit_backward" if self.current() == "dit_loss" else "lm_backward"
        self._opaque += opaque
        self._stack.append(_Frame(name, opaque, self.clock()))

    def exit(self) -> None:
        """The innermost phase ends: its time less its children's goes to its row, all of it to its parent."""
        frame = self._stack.pop()
        if frame is None:
            return
        elapsed = self.clock() - frame.start
        self._opaque -= frame.opaque
        self.totals[frame.name] += elapsed - frame.children
        # Below a recorded frame every frame is recorded (None frames only sit above an opaque one).
        if self._stack:
            parent = self._stack[-1]
            assert parent is not None
            parent.children += elapsed

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Nothing is recorded inside (the floor step)."""
        self._opaque += 1
        try:
            yield
        finally:
            self._opaque -= 1

    def take(self) -> dict[str, float]:
        """The phase totals since the last call."""
        out = dict(self.totals)
        self.totals.clear()
        return out


def fill_overhead(rep: dict[str, float]) -> None:
    """Set ``rep["overhead"]`` to the step total less every other row: what no phase covers."""
    rep["overhead"] = rep["total"] - sum(v for k, v in rep.items() if k not in ("total", "overhead"))


@dataclass
class RunResult:
    """Per-repetition CPU seconds by phase (plus ``total``) of the project and the floor, one gate setting."""

    gates: bool
    images_per_step: int
    project: list[dict[str, float]] = field(default_factory=list)
    floor: list[dict[str, float]] = field(default_factory=list)
    parity_cost: float = 0.0
    parity_every: int = 0
    tokens: list[int] = field(default_factory=list)

    def median(self, side: str, phase: str) -> float:
        """The median over repetitions of ``phase`` on ``side`` (``project`` or ``floor``)."""
        return statistics.median(rep.get(phase, 0.0) for rep in getattr(self, side))

    def span(self, side: str, phase: str) -> tuple[float, float]:
        """(min, max) over repetitions of ``phase`` on ``side``."""
        values = [rep.get(phase, 0.0) for rep in getattr(self, side)]
        return min(values), max(values)

    @property
    def ratio(self) -> float:
        """Median over repetitions of project total / floor total (interleaved pairs)."""
        return statistics.median(a["total"] / b["total"] for a, b in zip(self.project, self.floor, strict=True))

    @property
    def gate_share(self) -> float:
        """Median over repetitions of gate time / (step total - gate time)."""
        return statistics.median(
            sum(r.get(g, 0.0) for g in GATE_PHASES) / (r["total"] - sum(r.get(g, 0.0) for g in GATE_PHASES))
            for r in self.project
        )
