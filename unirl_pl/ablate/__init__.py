"""``python -m unirl_pl ablate``: every training mode (and arm of ``--vary``) over several seeds.

Runs go one per subprocess (:mod:`.runs`); the table of held-out scores as mean ± std per mode
(:mod:`.report`), the paired comparison of modes seed by seed with t intervals (:mod:`.paired`, the math
in :mod:`.stats`) and the pictures (:mod:`.plot`) are rewritten after every run; :mod:`.cli` is the command.
"""

from unirl_pl.ablate.arms import Arm, build_arms, parse_vary
from unirl_pl.ablate.cli import main, parse_args, plan
from unirl_pl.ablate.metrics import read_train_cpu, read_validation
from unirl_pl.ablate.paired import pairs, write_paired
from unirl_pl.ablate.plot import draw_plot, draw_strict_vs_cpu
from unirl_pl.ablate.report import write_cost_csv, write_csv, write_markdown
from unirl_pl.ablate.runs import Run, build_command, execute
from unirl_pl.ablate.stats import Paired, mean_std, paired, t_quantile

__all__ = [
    "Arm",
    "Paired",
    "Run",
    "build_arms",
    "build_command",
    "draw_plot",
    "draw_strict_vs_cpu",
    "execute",
    "main",
    "mean_std",
    "paired",
    "pairs",
    "parse_args",
    "parse_vary",
    "plan",
    "read_train_cpu",
    "read_validation",
    "t_quantile",
    "write_cost_csv",
    "write_csv",
    "write_markdown",
    "write_paired",
]
