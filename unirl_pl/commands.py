"""The subcommands of ``python -m unirl_pl``, and what runs before Lightning is imported.

``fit``, ``validate`` and ``predict`` are LightningCLI's (:mod:`unirl_pl.cli`). The tools each parse
their own arguments and are dispatched here, as is ``--help``, which lists every subcommand; this module
imports neither torch nor Lightning, so the overview and a tool's own ``--help`` start fast.
"""

from __future__ import annotations

import importlib

PROG = "python -m unirl_pl"
LIGHTNING_SUBCOMMANDS = {
    "fit": "train a recipe (python -m unirl_pl fit --config recipes/joint.yaml)",
    "validate": "score held-out prompts with a recipe's weights or a checkpoint (--ckpt_path)",
    "predict": "write images of the predict prompts (greedy refinement, ODE sampler)",
}
# Each tool: (the module whose main(argv) runs it, what it does). `python -m <module>` stays an alias.
TOOLS = {
    "ablate": ("unirl_pl.ablate", "every training mode over several seeds, held-out scores as mean ± std"),
    "bench": ("unirl_pl.bench", "CPU time per phase of one RL step, against a bare-torch floor"),
    "export": ("unirl_pl.export", "a checkpoint's adapters in peft and diffusers LoRA formats"),
    "plan": ("unirl_pl.plan", "the memory plan of a recipe's real-size experts, traced on fake tensors"),
    "rewards": ("unirl_pl.rewards.catalog", "the rewards a recipe can name, or one reward's init_args"),
    "serve-reward": ("unirl_pl.rewards.server_cli", "serve a registered or dotted-path reward over HTTP (http reward)"),
}


def subcommands() -> list[str]:
    """Every subcommand, Lightning's first."""
    return [*LIGHTNING_SUBCOMMANDS, *TOOLS]


def overview() -> str:
    """The text of ``python -m unirl_pl --help``: a usage line and one line per subcommand."""
    names = subcommands()
    width = max(map(len, names)) + 2
    described = {**LIGHTNING_SUBCOMMANDS, **{name: text for name, (_, text) in TOOLS.items()}}
    lines = [f"usage: {PROG} {{{','.join(names)}}} ...", "", "subcommands:"]
    lines += [f"  {name:<{width}}{described[name]}" for name in names]
    lines += ["", f"Each subcommand has its own --help, e.g. {PROG} fit --help."]
    return "\n".join(lines)


def run_tool(name: str, argv: list[str]) -> int:
    """Run tool ``name``'s ``main(argv)``; its exit status (0 when it returns something else, such as paths)."""
    result = importlib.import_module(TOOLS[name][0]).main(argv)
    return result if isinstance(result, int) and not isinstance(result, bool) else 0


def run_before_lightning(argv: list[str]) -> int | None:
    """Handle ``--help`` and the tools; the exit status, or None when LightningCLI is to parse ``argv``."""
    if argv and argv[0] in ("-h", "--help"):
        print(overview())
        return 0
    if argv and argv[0] in TOOLS:
        return run_tool(argv[0], list(argv[1:]))
    return None
