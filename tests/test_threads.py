"""The intra-op thread count: one thread on a CPU run, torch's default on a GPU run (``unirl_pl.threads``).

The signal (is a GPU visible?) is injected, so both branches run on any machine; the signal itself is
checked with torch's answer and the device nodes replaced.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tests.helpers import TINY
from unirl_pl import threads
from unirl_pl.cli import main
from unirl_pl.threads import VARIABLE, gpu_visible, set_threads


@pytest.fixture
def thread_calls(monkeypatch):
    """``torch.set_num_threads`` calls, and no OMP_NUM_THREADS in this process's environment."""
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.delenv(VARIABLE, raising=False)
    return calls


def test_a_cpu_run_gets_one_thread(monkeypatch, thread_calls):
    monkeypatch.setattr(threads, "gpu_visible", lambda env=None: False)
    set_threads()
    assert os.environ[VARIABLE] == "1" and thread_calls == [1]
    child: dict[str, str] = {}
    set_threads(env=child)
    assert child == {VARIABLE: "1"} and thread_calls == [1]


def test_a_gpu_run_keeps_torchs_default(monkeypatch, thread_calls):
    monkeypatch.setattr(threads, "gpu_visible", lambda env=None: True)
    set_threads()
    assert VARIABLE not in os.environ and thread_calls == []
    child: dict[str, str] = {}
    set_threads(env=child)
    assert child == {} and thread_calls == []
    # The caller may know better than the signal (the bench, a CPU trainer on a GPU machine).
    set_threads(cpu=True)
    assert os.environ[VARIABLE] == "1" and thread_calls == [1]


def test_a_users_count_wins_on_either_kind_of_run(monkeypatch, thread_calls):
    monkeypatch.setenv(VARIABLE, "3")
    for cpu in (True, False, None):
        set_threads(cpu=cpu)
    assert os.environ[VARIABLE] == "3" and thread_calls == []
    set_threads(4)  # a recipe's own count
    assert thread_calls == [4]


def test_the_signal_asks_torch_once_it_is_loaded(monkeypatch):
    for available in (True, False):
        monkeypatch.setattr(torch.cuda, "is_available", lambda available=available: available)
        assert gpu_visible() is available


def test_before_torch_loads_the_signal_is_the_device_nodes_and_cuda_visible_devices(monkeypatch, tmp_path):
    # As in __main__, before torch is imported: nothing may import it here.
    monkeypatch.delitem(sys.modules, "torch")
    node = tmp_path / "nvidia0"
    node.touch()
    monkeypatch.setattr(threads, "GPU_DEVICE_NODES", (str(tmp_path / "nvidia[0-9]*"),))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu_visible() is True
    for hidden in ("", "-1"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert gpu_visible() is False
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert gpu_visible() is True
    node.unlink()
    assert gpu_visible() is False
    assert "torch" not in sys.modules


def test_a_child_environment_is_judged_by_its_own_variables(monkeypatch, tmp_path):
    (tmp_path / "kfd").touch()
    monkeypatch.setattr(threads, "GPU_DEVICE_NODES", (str(tmp_path / "kfd"),))
    assert gpu_visible({}) is True
    assert gpu_visible({"CUDA_VISIBLE_DEVICES": ""}) is False


def test_a_cpu_trainer_on_a_gpu_machine_gets_one_thread(monkeypatch, thread_calls, tmp_path):
    # The machine has a GPU (so main's first call leaves the default), the recipe says accelerator: cpu.
    monkeypatch.setattr(threads, "gpu_visible", lambda env=None: True)
    args = ["--config", TINY, "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}"]
    cli = main([*args, "--trainer.callbacks=[]"], run=False)
    assert type(cli.trainer.accelerator).__name__ == "CPUAccelerator"
    assert os.environ[VARIABLE] == "1" and thread_calls == [1]
