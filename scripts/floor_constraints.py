"""Print pip constraints that pin every dependency of pyproject.toml at its declared lower bound.

``.ci/run`` installs the package with them (``pip install -c <these> -e .[dev]``) and runs the fast tier, so
each ``>=`` in pyproject.toml is a version the suite has passed on, not a guess. A dependency without a
lower bound is an error: it could not be tested at its floor.

    python scripts/floor_constraints.py > floors.txt
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# name[extras] >=floor[,<upper]
_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*(.*)$")


def floors(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, str]:
    """Each dependency's name -> its ``>=`` lower bound, in pyproject's order."""
    out: dict[str, str] = {}
    for requirement in tomllib.loads(pyproject.read_text())["project"]["dependencies"]:
        match = _REQUIREMENT.match(requirement)
        if match is None:
            raise ValueError(f"cannot read the requirement {requirement!r}")
        name, _, spec = match.groups()
        lower = [part.strip()[2:].strip() for part in spec.split(",") if part.strip().startswith(">=")]
        if len(lower) != 1:
            raise ValueError(f"{requirement!r}: every dependency needs exactly one '>=' lower bound")
        out[name] = lower[0]
    return out


def main() -> int:
    for name, version in floors().items():
        print(f"{name}=={version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
