"""``recipes/multinode.yaml`` as a cluster runs it, simulated on one machine: two torchrun agents are two nodes.

The torchrun command is read from docs/scaling.md, so the documented command is the tested one. Two
agents run it with one CPU process each (c10d rendezvous on 127.0.0.1 at a free port, gloo) on the main
recipe, and the run must equal the 2-process single-node FSDP2 run bit for bit: the same global ranks get
the same prompts, noise and collectives, so only a multi-node fault makes them differ (measured: ranks
read by ``local_rank``, so both "nodes" take rank 0's prompts, fail at the first step). A recipe whose
``num_nodes`` or data-parallel size does not fit the launcher fails to start. A fast check keeps the
SLURM script, the torchrun command and the recipe in agreement without launching anything.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import yaml

from tests.helpers import JOINT, ROOT, run_cli_subprocess, subprocess_env

DOC = ROOT / "docs" / "scaling.md"
RECIPE = ROOT / "recipes" / "multinode.yaml"
# torchrun options the simulation fills in; the documented command must use exactly these.
TORCHRUN_OPTIONS = {"nnodes", "nproc-per-node", "rdzv-backend", "rdzv-endpoint", "rdzv-id"}
# The main recipe shrunk to about 30 s a run on 2 cores: 3 steps of 2 prompts x 2 samples (one prompt per
# rank), no validation. The recipe's own callbacks stay, C2 and parity included.
SIZES = [
    "--trainer.max_steps=2",
    "--trainer.limit_val_batches=0",
    "--trainer.num_sanity_val_steps=0",
    "--trainer.enable_model_summary=false",
    "--data.prompts_per_step=2",
    "--data.samples_per_prompt=2",
]
# What a CPU node adds to the GPU recipe (docs/scaling.md says the same): one gloo process per node.
CPU_NODE = ["--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.strategy.init_args.data_parallel_size=2"]
# Metrics that must match bit for bit (all of today's; timing metrics, should any appear, are excluded).
COMPARED = ("reward/", "c2/", "parity/", "llm/", "transformer/", "version/", "advantage/", "train/")
RUN_TIMEOUT_S = 300


class RolloutDump(pl.Callback):
    """Test probe: each rank appends its step's per-sample rewards, refinements and behavior log-probs.

    Loaded by class path inside the CLI subprocesses; writes ``<default_root_dir>/rollout_rank<R>.jsonl``.
    JSON writes floats by ``repr``, so equal files mean bit-identical values.
    """

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        dit = batch.records["diffusion_denoise"]
        logp = getattr(dit, "old_logp", None) if dit is not None else None
        row = {
            "step": trainer.global_step,
            "rewards": batch.rewards.tolist(),
            "refined": batch.refined,
            "dit_logp": logp.tolist() if logp is not None else None,
        }
        path = Path(trainer.default_root_dir) / f"rollout_rank{trainer.global_rank}.jsonl"
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")


def _join_continuations(lines: list[str]) -> list[str]:
    """Shell lines with backslash continuations joined into one line each."""
    joined, pending = [], ""
    for line in lines:
        line = line.strip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
        else:
            joined.append(pending + line)
            pending = ""
    return joined


def _options(args: list[str]) -> dict[str, str]:
    """``--key=value`` arguments as a dict; any other form is refused so that nothing is silently skipped."""
    assert all(a.startswith("--") and "=" in a for a in args), f"write options as --key=value: {args}"
    return dict(a[2:].split("=", 1) for a in args)


def documented_launch() -> dict[str, Any]:
    """The SLURM script's ``#SBATCH`` options, its ``srun`` argv and the torchrun command of docs/scaling.md.

    Read from the ``bash`` blocks of the "M nodes" section; torchrun is split into its options and the
    program (``-m unirl_pl fit ...``).
    """
    section = DOC.read_text().split("## M nodes", 1)[1].split("\n## ", 1)[0]
    lines = _join_continuations("\n".join(re.findall(r"```bash\n(.*?)```", section, re.S)).splitlines())
    sbatch = [line.split(None, 1)[1] for line in lines if line.startswith("#SBATCH ")]
    commands = {line.split()[0]: shlex.split(line) for line in lines if line and not line.startswith("#")}
    torchrun = commands["torchrun"]
    cut = torchrun.index("-m")
    return {
        "sbatch": _options(sbatch),
        "srun": commands["srun"],
        "torchrun": _options(torchrun[1:cut]),
        "program": torchrun[cut:],
    }


def _recipe_torchrun() -> list[str]:
    """The torchrun command in the recipe's header comment."""
    comments = [line[1:] for line in RECIPE.read_text().splitlines() if line.startswith("#")]
    lines = _join_continuations(comments)
    (line,) = [line for line in lines if line.startswith("torchrun ")]
    return shlex.split(line)


def test_launch_commands_agree_with_the_recipe():
    """Nodes, processes per node, data-parallel size and the fit command agree across docs, recipe and test."""
    doc = documented_launch()
    recipe = yaml.safe_load(RECIPE.read_text())
    trainer, strategy = recipe["trainer"], recipe["trainer"]["strategy"]["init_args"]
    nodes, devices = trainer["num_nodes"], trainer["devices"]
    assert int(doc["sbatch"]["nodes"]) == int(doc["torchrun"]["nnodes"]) == nodes
    per_node = [doc["sbatch"]["ntasks-per-node"], doc["sbatch"]["gpus-per-node"], doc["torchrun"]["nproc-per-node"]]
    assert [int(n) for n in per_node] == [devices] * 3
    assert strategy["data_parallel_size"] == nodes * devices and strategy["tensor_parallel_size"] == 1
    assert recipe["data"]["init_args"]["prompts_per_step"] % strategy["data_parallel_size"] == 0
    assert set(doc["torchrun"]) == TORCHRUN_OPTIONS and doc["torchrun"]["rdzv-backend"] == "c10d"
    # One fit command everywhere: the recipe's first line, srun's and torchrun's program.
    first = shlex.split(RECIPE.read_text().splitlines()[0][1:])
    fit = ["python", *doc["program"]]
    assert doc["srun"] == first == ["srun", *fit]
    assert fit[3:] == ["fit", "--config", "recipes/joint.yaml", "--config", "recipes/multinode.yaml"]
    assert _recipe_torchrun() == ["torchrun", *[f"--{k}={v}" for k, v in doc["torchrun"].items()], *doc["program"]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _outputs(out: Path) -> list[str]:
    """Overrides that keep a run's files in ``out`` and add the rollout probe."""
    return [
        f"--trainer.default_root_dir={out}",
        f"--trainer.logger.init_args.save_dir={out}",
        f"--trainer.callbacks.dirpath={out / 'checkpoints'}",  # the recipe's last callback: ModelCheckpoint
        "--trainer.callbacks+=tests.test_multinode.RolloutDump",  # importable: PYTHONPATH has the root
    ]


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux ``/proc``): torchrun starts its workers in their own sessions."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM each live agent (torchrun then stops its workers), SIGKILL whatever is left after 30 s."""
    tree = {p.pid: _descendants(p.pid) for p in procs if p.poll() is None}
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for pid in [q for kids in tree.values() for q in kids]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _run_two_nodes(out: Path) -> None:
    """The documented torchrun command as two agents (nodes) of one CPU process each; no hang on failure."""
    doc = documented_launch()
    options = {
        **doc["torchrun"],
        "nproc-per-node": "1",
        "rdzv-endpoint": f"127.0.0.1:{_free_port()}",
        "rdzv-id": f"unirl-test-{uuid.uuid4().hex[:8]}",
    }
    # `python -m torch.distributed.run` is the torchrun script, found without PATH.
    cmd = [sys.executable, "-m", "torch.distributed.run", *[f"--{k}={v}" for k, v in options.items()]]
    cmd += [*doc["program"], *CPU_NODE, *SIZES, *_outputs(out)]
    out.mkdir(parents=True)
    logs = [(out / f"node{n}.log").open("w") for n in range(2)]
    procs = [
        subprocess.Popen(
            cmd, cwd=ROOT, env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        for log in logs
    ]
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        # A failed agent leaves its peer waiting in a rendezvous or a collective: stop both at once.
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.5)
    finally:
        _stop(procs)
        for log in logs:
            log.close()
    tails = "\n".join(f"--- node{n} ---\n" + (out / f"node{n}.log").read_text()[-3000:] for n in range(2))
    assert [p.returncode for p in procs] == [0, 0], tails


def _run_single_node(out: Path) -> None:
    """The 2-process single-node FSDP2 run (Lightning starts the second process) with the same overrides."""
    fsdp = str(ROOT / "recipes" / "fsdp.yaml")
    run_cli_subprocess("fit", "--config", JOINT, "--config", fsdp, *SIZES, *_outputs(out), timeout=RUN_TIMEOUT_S)


def _metrics(out: Path) -> list[dict[str, str]]:
    (path,) = out.glob("joint/version_*/metrics.csv")
    with path.open() as f:
        return [{k: v for k, v in row.items() if k == "step" or k.startswith(COMPARED)} for row in csv.DictReader(f)]


def _first_difference(a: list[dict[str, str]], b: list[dict[str, str]]) -> str:
    """Where two metric tables first differ (row, key, both values), for the failure message."""
    if len(a) != len(b):
        return f"{len(a)} rows vs {len(b)}"
    for i, (ra, rb) in enumerate(zip(a, b, strict=True)):
        for key in sorted(ra.keys() | rb.keys()):
            if ra.get(key) != rb.get(key):
                return f"row {i} (step {ra.get('step', rb.get('step'))}) {key}: {ra.get(key)!r} vs {rb.get(key)!r}"
    return "no difference"


def _adapters(out: Path) -> dict[str, torch.Tensor]:
    state = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)
    return {k: v for k, v in state["state_dict"].items() if "lora_" in k}


def _c2_tolerance() -> float:
    callbacks = yaml.safe_load(Path(JOINT).read_text())["trainer"]["callbacks"]
    (c2,) = [c for c in callbacks if c["class_path"].endswith("LogProbIdentityCheck")]
    return float(c2["init_args"]["tolerance"])


@pytest.mark.integration
def test_two_nodes_equal_one_node_of_two_processes(tmp_path):
    """Two torchrun "nodes" x 1 process == 1 node x 2 processes: metrics, per-sample rollouts, adapters."""
    start = time.monotonic()
    _run_single_node(tmp_path / "single")
    _run_two_nodes(tmp_path / "nodes")
    print(f"single node + two nodes: {time.monotonic() - start:.1f} s")
    single, nodes = _metrics(tmp_path / "single"), _metrics(tmp_path / "nodes")
    rewards = [r["reward/mean"] for r in nodes if r.get("reward/mean")]
    assert len(rewards) == 2, rewards
    assert nodes == single, f"metrics.csv, 2 nodes vs 1 node: {_first_difference(nodes, single)}"
    for rank in range(2):
        name = f"rollout_rank{rank}.jsonl"
        rows = (tmp_path / "nodes" / name).read_text().splitlines()
        twin = (tmp_path / "single" / name).read_text().splitlines()
        assert len(rows) == 2, rows
        for node_row, single_row in zip(rows, twin, strict=True):
            assert node_row == single_row, f"{name}, 2 nodes vs 1 node:\n{node_row}\n{single_row}"
    a, b = _adapters(tmp_path / "single"), _adapters(tmp_path / "nodes")
    assert a and a.keys() == b.keys()
    assert not (moved := [k for k in a if not torch.equal(a[k], b[k])]), f"adapters differ: {moved[:3]}"
    # C2 green on the two nodes: the LM under the recipe's tolerance, the DiT bitwise (its exact tier).
    llm = [float(r["c2/llm_max_abs_diff"]) for r in nodes if r.get("c2/llm_max_abs_diff")]
    dit = [float(r["c2/transformer_max_abs_diff"]) for r in nodes if r.get("c2/transformer_max_abs_diff")]
    assert len(llm) == 2 and max(llm) <= _c2_tolerance()
    assert dit == [0.0, 0.0]
