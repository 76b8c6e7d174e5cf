"""Every package ``unirl_pl`` imports is declared in pyproject.toml, the ``rewards`` extra installs every
package a reward imports, and the ``serve`` extra every package the reward server imports.

The imports are read from the source (``ast``), those inside functions included: an optional package is
imported where it is used (the OCR reward's ``rapidocr_onnxruntime``), and an undeclared one there fails
only for the user who reaches that line (``hpsv2``'s ``huggingface_hub`` did). An import name maps to its
distribution through the installed packages' metadata, or, for a package not installed here, through
:data:`NOT_INSTALLED`.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "unirl_pl"
PROJECT = "unirl_pl"

# Import name -> distribution for packages an environment may lack (optional extras, reward models'
# own packages); the installed metadata wins where it has the name.
NOT_INSTALLED = {
    "rapidocr_onnxruntime": "rapidocr-onnxruntime",
    "onnxruntime": "onnxruntime",
    "open_clip": "open_clip_torch",
    "hpsv2": "hpsv2",
    "tensorboard": "tensorboard",
    "PIL": "pillow",
    "yaml": "pyyaml",
    "litserve": "litserve",
    "uvicorn": "uvicorn",
    "h11": "h11",
}
# The reward server's modules: what they import comes with the ``serve`` extra, not the ``rewards`` one (the
# server is not a reward; a reward serves through it by name).
SERVER_MODULES = {"unirl_pl/rewards/server.py", "unirl_pl/rewards/server_front.py", "unirl_pl/rewards/server_worker.py"}


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares them (``PyYAML`` is ``pyyaml``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> tuple[str, list[str]]:
    """The distribution a requirement string names and the extras it asks for (``a[b,c]>=1`` -> a, [b, c])."""
    found = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?", requirement)
    assert found, f"unreadable requirement {requirement!r}"
    extras = [e.strip() for e in (found.group(2) or "").split(",") if e.strip()]
    return normalize(found.group(1)), extras


def top_level_imports(folder: Path) -> dict[str, set[str]]:
    """Top-level module name -> the files under ``folder`` importing it, without the standard library,
    relative imports and the project itself."""
    found: dict[str, set[str]] = {}
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != PROJECT:
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def distributions(import_name: str) -> set[str]:
    """The distributions that provide ``import_name`` (empty when neither the metadata nor the table knows)."""
    installed = importlib.metadata.packages_distributions().get(import_name)
    if installed:
        return {normalize(d) for d in installed}
    return {normalize(NOT_INSTALLED[import_name])} if import_name in NOT_INSTALLED else set()


def declared() -> tuple[set[str], dict[str, set[str]]]:
    """The core dependencies and each extra's distributions, with the project's own extras (``unirl_pl[ocr]``)
    expanded in place."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    raw = {name: list(reqs) for name, reqs in project.get("optional-dependencies", {}).items()}

    def expand(requirements: list[str], seen: frozenset[str] = frozenset()) -> set[str]:
        out: set[str] = set()
        for requirement in requirements:
            name, extras = requirement_name(requirement)
            if name != normalize(PROJECT):
                out.add(name)
                continue
            for extra in extras:
                assert extra in raw, f"{requirement!r} names an extra pyproject.toml does not have"
                if extra not in seen:
                    out |= expand(raw[extra], seen | {extra})
        return out

    return expand(project["dependencies"]), {name: expand(reqs, frozenset({name})) for name, reqs in raw.items()}


def test_every_imported_package_is_declared():
    core, extras = declared()
    anywhere = core.union(*extras.values())
    imports = top_level_imports(PACKAGE)
    assert {"torch", "lightning", "rapidocr_onnxruntime"} <= set(imports), "the scan missed known imports"
    unknown = {name: sorted(files) for name, files in imports.items() if not distributions(name)}
    assert not unknown, f"imports with no known distribution (install it, or add it to NOT_INSTALLED): {unknown}"
    missing = {
        f"{name} ({', '.join(sorted(distributions(name)))})": sorted(files)
        for name, files in imports.items()
        if not distributions(name) & anywhere
    }
    assert not missing, f"imported but not declared in pyproject.toml's dependencies or extras: {missing}"


def test_the_rewards_extra_installs_every_package_a_reward_imports():
    core, extras = declared()
    assert extras["ocr"] <= extras["rewards"], "the rewards extra is the union of the reward extras"
    needed = {
        name: files - SERVER_MODULES
        for name, files in top_level_imports(PACKAGE / "rewards").items()
        if files - SERVER_MODULES
    }
    missing = {
        name: sorted(files) for name, files in needed.items() if not distributions(name) & (core | extras["rewards"])
    }
    assert not missing, f"a reward imports a package that neither the core nor the rewards extra installs: {missing}"


def test_the_serve_extra_installs_every_package_the_reward_server_imports():
    core, extras = declared()
    needed = {
        name: files & SERVER_MODULES for name, files in top_level_imports(PACKAGE).items() if files & SERVER_MODULES
    }
    assert {"litserve", "uvicorn", "h11", "torch"} <= set(needed), "the scan missed the server's imports"
    missing = {
        name: sorted(files) for name, files in needed.items() if not distributions(name) & (core | extras["serve"])
    }
    assert not missing, (
        f"the reward server imports a package that neither the core nor the serve extra installs: {missing}"
    )
    assert extras["serve"] <= extras["dev"], "the development install runs the server's tests"


def test_the_reader_expands_extras_and_normalizes_names():
    assert requirement_name("jsonargparse[signatures]>=4.35") == ("jsonargparse", ["signatures"])
    assert requirement_name("unirl_pl[ocr, tb]") == ("unirl-pl", ["ocr", "tb"])
    assert normalize("PyYAML") == "pyyaml" and normalize("huggingface_hub") == "huggingface-hub"
    assert distributions("yaml") == {"pyyaml"}


def test_ci_pins_every_dependency_at_its_declared_floor(tmp_path):
    """.ci/run installs the floors scripts/floor_constraints.py prints: one per dependency, its '>=' bound."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("floor_constraints", ROOT / "scripts" / "floor_constraints.py")
    assert spec is not None and spec.loader is not None
    floor_constraints = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(floor_constraints)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pinned = floor_constraints.floors()
    assert [normalize(requirement_name(r)[0]) for r in project["dependencies"]] == [normalize(n) for n in pinned]
    assert pinned["torch"] == "2.13" and pinned["transformers"] == "5.24"
    assert "floor_constraints.py" in (ROOT / ".ci" / "run").read_text()
    unbounded = tmp_path / "pyproject.toml"
    unbounded.write_text('[project]\nname = "x"\ndependencies = ["torch>=2.13", "rich"]\n')
    with pytest.raises(ValueError, match="'rich': every dependency needs exactly one '>=' lower bound"):
        floor_constraints.floors(unbounded)
