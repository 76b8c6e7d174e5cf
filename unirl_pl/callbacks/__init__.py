"""Built-in gates (callbacks that enforce an invariant every step) and the prediction writer."""

from unirl_pl.callbacks.c2 import LogProbIdentityCheck
from unirl_pl.callbacks.ledger import WeightVersionLedger
from unirl_pl.callbacks.writer import ImageWriter

__all__ = ["ImageWriter", "LogProbIdentityCheck", "WeightVersionLedger"]
