"""Check the plan's block stand-ins on every shipped GPU recipe: plan each one twice, with the stand-ins and with
``--trace-every-block``, and print each recipe's seconds both ways and whether every phase's bytes are equal.

    python scripts/plan_stand_ins.py [--recipes sd35 flux ...] [--json OUT]

Each recipe is planned as ``tests/test_plan_fits.py`` plans it (``--no-search``, the GPU its comments name, its plan
command's ``--pipeline-path``), in a fresh process per plan, one thread. Exits 1 when a plan differs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.test_plan_fits import gpu_recipes, named_gpu, plan_command_extras  # noqa: E402


def plan(name: str, every_block: bool, out: Path) -> float:
    """Seconds of one ``plan`` of recipe ``name`` writing its JSON to ``out``."""
    devices, gb = named_gpu(name)
    command = [sys.executable, "-m", "unirl_pl", "plan", "--config", str(ROOT / "recipes" / f"{name}.yaml")]
    command += ["--no-search", "--quiet", "--devices", str(devices), "--gpu-memory-gb", str(gb), "--json", str(out)]
    command += plan_command_extras(name) + (["--trace-every-block"] if every_block else [])
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    start = time.monotonic()
    subprocess.run(command, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    return time.monotonic() - start


def phases(path: Path) -> dict:
    """Every traced candidate's phases (bytes by category) of a plan's JSON."""
    return json.loads(path.read_text())["candidates"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", nargs="*", default=None, help="recipe names (default: every GPU recipe)")
    parser.add_argument("--json", default=None, help="also write the rows as JSON to this path")
    args = parser.parse_args()
    names = args.recipes or gpu_recipes()
    rows, differ = [], 0
    print(f"{'recipe':<22} {'stand-ins s':>11} {'every block s':>13}  equal")
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            fast, full = Path(tmp) / f"{name}.fast.json", Path(tmp) / f"{name}.full.json"
            seconds = (plan(name, False, fast), plan(name, True, full))
            equal = phases(fast) == phases(full)
            differ += not equal
            rows.append({"recipe": name, "stand_ins_s": round(seconds[0], 1), "every_block_s": round(seconds[1], 1),
                         "equal": equal})  # fmt: skip
            print(f"{name:<22} {seconds[0]:>11.1f} {seconds[1]:>13.1f}  {'yes' if equal else 'NO'}", flush=True)
    total = [sum(r[k] for r in rows) for k in ("stand_ins_s", "every_block_s")]
    print(f"{'total':<22} {total[0]:>11.1f} {total[1]:>13.1f}  {len(rows) - differ} of {len(rows)} equal")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
