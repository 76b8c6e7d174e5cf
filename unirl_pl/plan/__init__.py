"""``python -m unirl_pl plan``: the memory plan of a recipe, computed by tracing one RL step of its
real-size experts on fake tensors under torch's memory tracker (no weights, no GPU).

    python -m unirl_pl plan --config recipes/sd35.yaml [--config OVERLAY] [--devices N] [--gpu-memory-gb 80]
        [--pipeline-path DIR] [--llm-path DIR] [--json PATH] [--model.rollout.micro_batch_size=4 ...]

It prints, per phase of the step, the peak device memory by category (frozen weights; LoRA, gradients and
optimizer state; activations; temporaries; the step's resident experience), whether the recipe's own
``micro_batch_size`` and ``gradient_checkpointing`` fit, and the largest micro-batch that fits with and
without checkpointing. Models come from ``--pipeline-path``/``--llm-path`` (local folders; their
``config.json`` files are enough), else from the recipe's paths (a local folder, or a hub id or another
machine's folder named as a shipped config), and from the family's config shipped under
``unirl_pl/assets/configs`` only when no path is set: a path that is set and found nowhere is refused. The
recipes and dotted overrides are parsed by ``fit``'s own parser (every default a constructor's; a setting
``fit`` refuses is refused with ``fit``'s message). See :mod:`unirl_pl.plan.planner` for what is traced.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

from unirl_pl.cli import config_refusal
from unirl_pl.errors import ConfigError
from unirl_pl.plan.planner import Plan, plan_step
from unirl_pl.plan.recipe import RecipeError, parsed_recipe, step_recipe
from unirl_pl.plan.report import plan_json, print_plan
from unirl_pl.plan.tracker import GiB

PROG = "python -m unirl_pl plan"


def parser() -> argparse.ArgumentParser:
    """The ``plan`` subcommand's arguments (dotted recipe overrides are taken apart from these)."""
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--config", action="append", required=True, help="recipe YAML (repeat for overlays; later wins)")
    p.add_argument("--devices", type=int, default=None, help="ranks (default: the recipe's trainer.devices)")
    p.add_argument("--gpu-memory-gb", type=float, default=80.0, help="memory of one device in GiB (default 80)")
    p.add_argument(
        "--reserve-gb",
        type=float,
        default=4.0,
        help="GiB of each device kept for what no tensor holds: CUDA context, cuBLAS/NCCL workspaces, allocator "
        "fragmentation (default 4)",
    )
    p.add_argument("--pipeline-path", default=None, help="diffusers pipeline folder, or a shipped config name")
    p.add_argument("--llm-path", default=None, help="causal LM folder, or a shipped config name")
    p.add_argument("--prompt-tokens", type=int, default=128, help="tokens of one refiner request (default 128)")
    p.add_argument("--json", default=None, help="also write the plan as JSON to this path")
    p.add_argument("--quiet", action="store_true", help="no per-trace progress lines")
    p.add_argument(
        "--no-search",
        action="store_true",
        help="trace the recipe's own micro_batch_size and checkpointing only (does it fit?), not the largest that fits",
    )
    p.add_argument(
        "--trace-every-block",
        action="store_true",
        help="trace every call of a repeated block instead of standing in for the "
        "copies of the first (the same peak, several times slower; a check of the stand-ins)",
    )
    return p


def split_overrides(argv: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """Separate dotted recipe overrides (``--model.rollout.micro_batch_size=4`` or ``... 4``), which go to the
    CLI's parser with the recipes, from the subcommand's own arguments."""
    own: list[str] = []
    overrides: list[tuple[str, str]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        key = arg[2:].split("=", 1)[0] if arg.startswith("--") else ""
        if "." in key and key.split(".")[0] in ("model", "data", "trainer"):
            if "=" in arg:
                overrides.append((key, arg.split("=", 1)[1]))
            elif i + 1 < len(argv):
                overrides.append((key, argv[i + 1]))
                i += 1
            else:
                raise RecipeError(f"--{key} needs a value")
        else:
            own.append(arg)
        i += 1
    return own, overrides


def run(argv: list[str]) -> Plan:
    """Parse ``argv``, plan the recipe, print the table (and write ``--json``); returns the plan."""
    own, overrides = split_overrides(argv)
    args = parser().parse_args(own)
    # The recipes first, then the overrides, each in its order: as fit reads the same command line.
    cli_args = [*(a for path in args.config for a in ("--config", path)), *(f"--{k}={v}" for k, v in overrides)]
    recipe = step_recipe(parsed_recipe(cli_args), devices=args.devices)
    if args.gpu_memory_gb <= args.reserve_gb:
        raise RecipeError(f"--gpu-memory-gb ({args.gpu_memory_gb}) must exceed --reserve-gb ({args.reserve_gb})")
    budget = int((args.gpu_memory_gb - args.reserve_gb) * GiB)
    title = " + ".join(args.config) + "".join(f" --{k}={v}" for k, v in overrides)
    log = (lambda _: None) if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecation chatter of the model classes, not the user's concern
        plan = plan_step(
            recipe,
            budget=budget,
            title=title,
            pipeline_path=args.pipeline_path,
            llm_path=args.llm_path,
            prompt_tokens=args.prompt_tokens,
            log=log,
            search=not args.no_search,
            every_block=args.trace_every_block,
        )
    print_plan(plan)
    if args.json:
        Path(args.json).write_text(json.dumps(plan_json(plan), indent=2) + "\n")
    return plan


def main(argv: list[str] | None = None) -> int:
    """Entry point: 0 after printing a plan, 2 with a one-line ``error:`` for a configuration mistake (one that
    ``fit`` refuses in ``fit``'s words)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        run(argv)
    except ConfigError as err:
        print(config_refusal(err, argv, PROG), file=sys.stderr)
        return 2
    except (RecipeError, FileNotFoundError, ValueError, NotImplementedError) as err:
        print(f"error: {' '.join(str(err).split())}\nThe options: {PROG} --help", file=sys.stderr)
        return 2
    return 0


__all__ = ["main", "run"]
