"""How many intra-op threads a process of the project uses: the one place that decides it.

Tiny and CPU-bound models gain little from intra-op threads, and OpenMP workers spin-wait when the
cores are shared (other processes, DDP ranks): the main job took 30 min instead of 3 with torch's
default on a loaded 2-core machine. So every entry point (the CLI, ``python -m unirl_pl``, the
ablation's subprocesses, the benchmark) runs one thread per process unless ``OMP_NUM_THREADS`` says
otherwise, and a pretraining recipe may name its own count. This module imports nothing heavy, so
``__main__`` can call it before torch loads (torch then starts its pools with that count).
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

VARIABLE = "OMP_NUM_THREADS"


def set_threads(count: int | None = None, env: MutableMapping[str, str] | None = None) -> None:
    """Set the intra-op thread count: ``count`` when given, else one unless ``OMP_NUM_THREADS`` is set.

    With ``count`` (a recipe's ``num_threads``) torch uses that many threads in this process. Without
    it, ``OMP_NUM_THREADS=1`` is written into ``env`` unless it is already there: ``None`` means this
    process's environment (inherited by DDP ranks and data workers, and torch, if already imported,
    is set to one thread too); a dict is a child process's environment and changes nothing here. A
    value the user set is left alone: torch read it when it loaded.
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
    target[VARIABLE] = "1"
    torch_module = sys.modules.get("torch")
    if env is None and torch_module is not None:
        torch_module.set_num_threads(1)
