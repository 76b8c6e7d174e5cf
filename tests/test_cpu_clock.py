"""TrainCPUClock: the training CPU seconds logged with each validation leave validation time out."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from unirl_pl.callbacks import TrainCPUClock, cpu_clock


class _Module:
    def __init__(self) -> None:
        self.logged: list[tuple[str, float]] = []

    def log(self, name: str, value: float) -> None:
        self.logged.append((name, value))


@pytest.fixture
def clock(monkeypatch):
    """A clock whose process CPU time is ``now[0]``."""
    now = [0.0]
    monkeypatch.setattr(cpu_clock.time, "process_time", lambda: now[0])
    return TrainCPUClock(), now


def _trainer(sanity: bool = False, fn: str = "fit") -> SimpleNamespace:
    return SimpleNamespace(sanity_checking=sanity, state=SimpleNamespace(fn=fn))


def _validate(callback: TrainCPUClock, now: list[float], start: float, end: float, module, **trainer) -> None:
    now[0] = start
    callback.on_validation_epoch_start(_trainer(**trainer), module)
    now[0] = end
    callback.on_validation_epoch_end(_trainer(**trainer), module)


def test_validation_and_the_sanity_check_are_not_training_time(clock):
    callback, now = clock
    module = _Module()
    now[0] = 100.0  # CPU spent before the fit (imports, model loading) is not training
    callback.on_fit_start(_trainer(), module)
    _validate(callback, now, 100.0, 104.0, module, sanity=True)
    assert module.logged == [], "the sanity check logs nothing"
    _validate(callback, now, 114.0, 120.0, module)  # 10 s of training, then 6 s of validation
    _validate(callback, now, 135.0, 137.0, module)  # 15 s more
    assert module.logged == [(cpu_clock.METRIC, 10.0), (cpu_clock.METRIC, 25.0)]
    now[0] = 140.0
    assert callback.train_cpu_seconds() == 28.0


def test_a_resumed_clock_goes_on_from_the_checkpoint(clock):
    callback, now = clock
    callback.on_fit_start(_trainer(), _Module())
    _validate(callback, now, 7.0, 9.0, _Module())
    now[0] = 12.0
    state = callback.state_dict()
    assert state == {"spent": 10.0}
    resumed, module = TrainCPUClock(), _Module()
    resumed.load_state_dict(state)
    now[0] = 50.0
    resumed.on_fit_start(_trainer(), module)
    _validate(resumed, now, 53.0, 60.0, module)
    assert module.logged == [(cpu_clock.METRIC, 13.0)]


def test_validate_outside_a_fit_logs_nothing(clock):
    callback, now = clock
    module = _Module()
    _validate(callback, now, 1.0, 2.0, module, fn="validate")
    assert module.logged == []
