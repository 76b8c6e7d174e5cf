"""``python -m unirl_pl bench``: parse the arguments, run each gate setting, print the report."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

from unirl_pl.bench.report import BenchResult, format_report
from unirl_pl.threads import set_threads

DESCRIPTION = "CPU-time benchmark of one RL step: the project (Lightning, loops, gates) against a bare-torch floor."


def parser() -> argparse.ArgumentParser:
    """The bench's arguments; unknown ``--key=value`` ones are CLI overrides of the recipe."""
    p = argparse.ArgumentParser(prog="python -m unirl_pl bench", description=DESCRIPTION)
    p.add_argument("--config", required=True, help="the recipe (e.g. recipes/joint.yaml)")
    p.add_argument("--prompts-per-step", type=int, default=None, help="P (default: the recipe's)")
    p.add_argument("--samples-per-prompt", type=int, default=None, help="K (default: the recipe's)")
    p.add_argument("--repeats", type=int, default=5, help="timed steps (the medians' sample)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--gates", choices=("on", "off", "both"), default="on")
    return p


def run(argv: Sequence[str] | None = None) -> BenchResult:
    """Parse ``argv`` (unknown ``--key=value`` arguments go to the CLI as overrides) and run the bench."""
    p = parser()
    args, overrides = p.parse_known_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        p.error("need --repeats >= 1 and --warmup >= 0")
    # The bench measures CPU time: one thread on any machine, as its documented numbers were measured.
    set_threads(cpu=True)
    from unirl_pl.bench.project import run_project  # torch and Lightning load here, after the thread count

    settings = ("on", "off") if args.gates == "both" else (args.gates,)
    runs = {
        setting: run_project(
            args.config,
            setting == "on",
            args.prompts_per_step,
            args.samples_per_prompt,
            args.repeats,
            args.warmup,
            overrides,
        )
        for setting in settings
    }
    return format_report(runs, args.config, args.repeats, args.warmup)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the bench and print its report; exit 1 when a total ratio is not a positive number."""
    result = run(argv)
    print(result.report)
    return 0 if all(math.isfinite(r.ratio) and r.ratio > 0 for r in result.runs.values()) else 1
