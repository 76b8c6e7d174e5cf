"""How many intra-op threads a process of the project uses: the one place that decides it.

Tiny and CPU-bound models gain little from intra-op threads, and OpenMP workers spin-wait when the
cores are shared (other processes, DDP ranks): the main job took 30 min instead of 3 with torch's
default on a loaded 2-core machine. So on a CPU run every entry point (the CLI, ``python -m unirl_pl``,
the ablation's subprocesses, the benchmark) runs one thread per process unless ``OMP_NUM_THREADS`` says
otherwise, and a pretraining recipe may name its own count.

A run on a GPU keeps torch's default: the models run on the device, and the host's threads prepare its
work (tokenization, CPU-side rewards, data); Lightning's DDP divides the cores among its ranks itself.
Which kind of run it is must be known before torch loads (``__main__`` calls :func:`set_threads` first, so
torch starts its pools with the count), so :func:`gpu_visible` asks torch only when torch is already
imported and otherwise looks for a GPU driver's device nodes. The CLI corrects the one case neither can
see: a recipe with ``trainer.accelerator: cpu`` on a machine with a GPU gets one thread once the trainer
is built (:class:`unirl_pl.cli.UniRLCLI`). This module imports nothing heavy.
"""

from __future__ import annotations

import glob
import os
import sys
from collections.abc import Mapping, MutableMapping

VARIABLE = "OMP_NUM_THREADS"
# Nodes a GPU driver creates: NVIDIA's one per device, ROCm's kernel driver (torch.cuda runs on both).
GPU_DEVICE_NODES = ("/dev/nvidia[0-9]*", "/dev/kfd")


def gpu_visible(env: Mapping[str, str] | None = None) -> bool:
    """Whether a process with environment ``env`` (None: this one) would see a CUDA or ROCm device.

    With torch already imported, and for this process, torch answers (``torch.cuda.is_available()``: it
    knows a CPU-only build and ``CUDA_VISIBLE_DEVICES``, and does not initialize CUDA). Before torch loads,
    or for a child's environment, the answer is cheap and without torch: no device when
    ``CUDA_VISIBLE_DEVICES`` is empty or ``-1``, else whether a GPU driver's device node exists. A CPU-only
    torch on a machine with a GPU is then taken for a GPU run until torch loads and the CLI asks again.
    """
    torch_module = sys.modules.get("torch")
    if env is None and torch_module is not None:
        return bool(torch_module.cuda.is_available())
    visible = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    return any(glob.glob(pattern) for pattern in GPU_DEVICE_NODES)


def set_threads(
    count: int | None = None, env: MutableMapping[str, str] | None = None, *, cpu: bool | None = None
) -> None:
    """Set the intra-op thread count: ``count`` when given, else one on a CPU run unless ``OMP_NUM_THREADS`` is set.

    With ``count`` (a recipe's ``num_threads``) torch uses that many threads in this process. Without
    it, on a CPU run ``OMP_NUM_THREADS=1`` is written into ``env`` unless it is already there: ``None``
    means this process's environment (inherited by DDP ranks and data workers, and torch, if already
    imported, is set to one thread too); a dict is a child process's environment and changes nothing
    here. A value the user set is left alone: torch read it when it loaded. ``cpu`` says whether the run
    is on CPU; None asks :func:`gpu_visible` (for ``env``). A GPU run is left at torch's default.
    """
    if count is not None:
        if count < 1:
            raise ValueError(f"num_threads must be >= 1, got {count}")
        import torch

        torch.set_num_threads(count)
        return
    target = os.environ if env is None else env
    if VARIABLE in target:
        return
    if cpu is None:
        cpu = not gpu_visible(env)
    if not cpu:
        return
    target[VARIABLE] = "1"
    torch_module = sys.modules.get("torch")
    if env is None and torch_module is not None:
        torch_module.set_num_threads(1)
