"""A plan as a rich table (what ``python -m unirl_pl plan`` prints) and as JSON (``--json PATH``)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from unirl_pl.plan.planner import PHASE_NOTES, Candidate, Plan
from unirl_pl.plan.tracker import GiB, Usage

CATEGORIES = ("weights", "trainable", "activations", "temporaries", "experience")
HEADERS = ("weights", "trained+grad+opt", "activations", "temporaries", "experience")


def gib(value: int) -> str:
    """Bytes as GiB with one decimal."""
    return f"{value / GiB:.1f}"


def unit(plan: Plan) -> tuple[str, float]:
    """GiB, or MiB when every traced peak is under 1 GiB (tiny models)."""
    top = max((c.peak[1].total for c in plan.candidates), default=0)
    return ("GiB", GiB) if top >= GiB else ("MiB", float(2**20))


def amount(value: int, plan: Plan) -> str:
    """Bytes in the plan's unit with one decimal."""
    return f"{value / unit(plan)[1]:.1f}"


def _setting(micro_batch: int, checkpointing: bool) -> str:
    return f"micro_batch_size {micro_batch}, gradient checkpointing {'on' if checkpointing else 'off'}"


def phase_table(plan: Plan, candidate: Candidate, title: str) -> Table:
    """Per phase, the peak's bytes by category (GiB) at one traced setting."""
    table = Table(title=title, title_justify="left")
    table.add_column("phase")
    for header in (*HEADERS, "peak"):
        table.add_column(header, justify="right")
    table.add_column("fits")
    for name, usage in candidate.phases.items():
        fits = usage.total <= plan.budget
        table.add_row(
            name,
            *(amount(getattr(usage, c), plan) for c in CATEGORIES),
            amount(usage.total, plan),
            "yes" if fits else "[bold red]no[/]",
        )
    return table


def candidates_table(plan: Plan) -> Table:
    """Every traced (micro-batch, checkpointing) setting: its peak phase and whether it fits."""
    table = Table(title="traced settings", title_justify="left")
    peak = f"peak {unit(plan)[0]}"
    for header in ("micro_batch_size", "checkpointing", "peak phase", peak, "fits"):
        table.add_column(header, justify="right" if header in ("micro_batch_size", peak) else "left")
    for c in sorted(plan.candidates, key=lambda c: (c.checkpointing, c.micro_batch)):
        name, usage = c.peak
        fits = plan.fits(c)
        table.add_row(
            str(c.micro_batch),
            "on" if c.checkpointing else "off",
            name,
            amount(usage.total, plan),
            "yes" if fits else "no",
        )
    return table


def verdict_lines(plan: Plan) -> list[str]:
    """The answers: the recipe's own setting, the largest fitting micro-batch per checkpointing setting."""
    mb, ckpt = plan.recipe_setting
    own = plan.recipe_candidate
    name, peak = own.peak
    u = unit(plan)[0]
    lines = [
        f"recipe setting ({_setting(mb, ckpt)}): "
        + ("fits" if plan.fits(own) else "does not fit")
        + f" (peak {amount(peak.total, plan)} {u} in {name}, budget {amount(plan.budget, plan)} {u} per device)"
    ]
    over = [n for n, u in own.phases.items() if u.total > plan.budget]
    if over:
        listed = ", ".join(f"{n} {amount(own.phases[n].total, plan)}" for n in over)
        lines.append(f"over budget at the recipe setting ({u}): {listed}")
    if plan.held_lm_graph and plan.lm_micro_batch is None:
        lines.append(
            f"dit_update includes the refiner's loss graph, {amount(plan.held_lm_graph, plan)} {u}: training_step runs "
            "the refiner's backward after the DiT's updates (rollout.lm_micro_batch_size backpropagates it first)"
        )
    elif plan.held_lm_graph:
        lines.append(
            f"dit_update holds the refiner's gradients, {amount(plan.held_lm_graph, plan)} {u}: its loss was "
            f"backpropagated {plan.lm_micro_batch} refinements at a time before the DiT's updates"
        )
    for checkpointing in (False, True):
        if checkpointing not in plan.largest:
            continue
        largest = plan.largest[checkpointing]
        what = "nothing fits" if largest is None else f"largest micro_batch_size that fits: {largest}"
        lines.append(f"gradient checkpointing {'on' if checkpointing else 'off'}: {what}")
    if not plan.searched:
        lines.append("only the recipe's setting was traced (--no-search): no search of the largest micro-batch")
        return lines
    needs = plan.needs_checkpointing
    if needs is None:
        lines.append(
            "no micro-batch fits with or without gradient checkpointing: a phase that does not depend on it "
            "exceeds the budget (see the table)"
        )
    else:
        lines.append(f"gradient checkpointing needed: {'yes' if needs else 'no'}")
    return lines


def print_plan(plan: Plan, console: Console | None = None) -> None:
    """Print the plan's header, its phase table at the recipe's setting (and at the suggested one when
    they differ), the traced settings and the verdict."""
    console = console or Console(width=140)
    sizes = plan.sizes
    shard = f", FSDP2 over {plan.devices} ranks" if plan.fsdp else f", {plan.devices} rank(s)"
    console.print(f"[bold]plan[/] {plan.title}{shard}")
    console.print(
        f"per rank: {sizes.prompts} prompts, {sizes.texts} texts, {sizes.refined} refined, {sizes.images} images, "
        f"{sizes.sde_steps} SDE steps; configs: " + ", ".join(f"{k} {v}" for k, v in plan.configs.items())
    )
    mb, ckpt = plan.recipe_setting
    name = unit(plan)[0]
    console.print(phase_table(plan, plan.recipe_candidate, f"recipe setting: {_setting(mb, ckpt)} ({name})"))
    best = suggested(plan)
    if best is not None and (best.micro_batch, best.checkpointing) != (mb, ckpt):
        console.print(phase_table(plan, best, f"suggested: {_setting(best.micro_batch, best.checkpointing)} ({name})"))
    console.print(candidates_table(plan))
    for line in reward_lines(plan):
        console.print(line)
    for line in verdict_lines(plan):
        console.print(line)
    traced = {name for c in plan.candidates for name in c.phases}
    for name, note in PHASE_NOTES.items():
        if name in traced:
            console.print(f"  {name}: {note}", style="dim")
    for note in plan.notes:
        console.print(f"  note: {note}", style="dim")
    console.print(f"  traced in {plan.seconds:.0f} s", style="dim")


def reward_lines(plan: Plan) -> list[str]:
    """One line per reward term: its model on the device (weights, in every phase; the reward phase's peak),
    or where it scores instead."""
    lines = [term.line() for term in plan.rewards]
    phase = plan.recipe_candidate.phases.get("reward")
    if phase is not None:
        lines.append(
            f"reward phase at the recipe setting: peak {amount(phase.total, plan)} {unit(plan)[0]} "
            f"({'fits' if phase.total <= plan.budget else 'over budget'})"
        )
    return lines


def suggested(plan: Plan) -> Candidate | None:
    """The setting to use: the largest fitting micro-batch without checkpointing, else with it."""
    for checkpointing in (False, True):
        largest = plan.largest.get(checkpointing)
        if largest is not None:
            return plan.candidate(largest, checkpointing)
    return None


def _usage(usage: Usage) -> dict[str, int]:
    return usage.as_dict()


def plan_json(plan: Plan) -> dict[str, Any]:
    """The plan as plain JSON data (bytes throughout)."""
    best = suggested(plan)
    return {
        "title": plan.title,
        "budget_bytes": plan.budget,
        "devices": plan.devices,
        "fsdp": plan.fsdp,
        "sizes": vars(plan.sizes),
        "configs": plan.configs,
        "recipe": {
            "micro_batch_size": plan.recipe_setting[0],
            "gradient_checkpointing": plan.recipe_setting[1],
            "fits": plan.fits(plan.recipe_candidate),
            "phases": {k: _usage(v) for k, v in plan.recipe_candidate.phases.items()},
        },
        "largest_micro_batch_size": {
            ("with" if k else "without") + "_checkpointing": v for k, v in plan.largest.items()
        },
        "needs_gradient_checkpointing": plan.needs_checkpointing,
        "held_lm_graph_bytes": plan.held_lm_graph,
        "rewards": [
            {
                "name": term.name,
                "on_device": term.on_device,
                "where": term.where,
                "model": term.architecture or None,
                "parameters": term.parameters,
                "weight_bytes": term.weight_bytes,
                "batch_size": term.batch_size or None,
            }
            for term in plan.rewards
        ],
        "searched": plan.searched,
        "suggested": None
        if best is None
        else {"micro_batch_size": best.micro_batch, "gradient_checkpointing": best.checkpointing},
        "candidates": [
            {
                "micro_batch_size": c.micro_batch,
                "gradient_checkpointing": c.checkpointing,
                "fits": plan.fits(c),
                "peak_phase": c.peak[0],
                "phases": {k: _usage(v) for k, v in c.phases.items()},
            }
            for c in plan.candidates
        ],
        "notes": plan.notes,
        "seconds": round(plan.seconds, 1),
    }
