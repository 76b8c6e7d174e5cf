"""Built-in gates (callbacks that enforce an invariant every step) and the prediction writer."""

from unirl_pl.callbacks.adapter_off import AdapterOff
from unirl_pl.callbacks.c2 import LogProbIdentityCheck
from unirl_pl.callbacks.cpu_clock import TrainCPUClock
from unirl_pl.callbacks.ema import EMA
from unirl_pl.callbacks.export import AdapterExport
from unirl_pl.callbacks.hacking import RewardHackingMonitor
from unirl_pl.callbacks.ledger import WeightVersionLedger
from unirl_pl.callbacks.parity import InterleaveParityCheck
from unirl_pl.callbacks.preemption import PreemptionCheckpoint
from unirl_pl.callbacks.progress import RLProgressBar
from unirl_pl.callbacks.run_checkpoint import RunCheckpoint
from unirl_pl.callbacks.summary import RunSummary
from unirl_pl.callbacks.writer import ImageWriter, ValidationImages

__all__ = [
    "AdapterOff",
    "AdapterExport",
    "EMA",
    "ImageWriter",
    "InterleaveParityCheck",
    "LogProbIdentityCheck",
    "PreemptionCheckpoint",
    "RLProgressBar",
    "RewardHackingMonitor",
    "RunCheckpoint",
    "RunSummary",
    "TrainCPUClock",
    "ValidationImages",
    "WeightVersionLedger",
]
