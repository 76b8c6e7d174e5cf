"""docs/reproduce.md covers every shipped recipe and algorithm overlay, and backs every "as <reference>" claim.

Fast (text only): lists ``recipes/*.yaml`` and ``recipes/algorithms/*.yaml`` at test time, so an overlay added
later fails here until it has a section. A section is a Markdown heading (``##`` or deeper) naming the file's
path, e.g. ``## `recipes/algorithms/mix_grpo.yaml` ``, up to the next heading; it must hold a table row.

A recipe header line (the leading ``#`` block, before the first YAML key) that says "as <reference>" (or
"<reference> as published") claims a reference's setting: the recipe's section must then have a table row that
names that reference and a commit (7 to 40 hex digits with at least one digit and one letter).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "reproduce.md"

# Reference name in a header -> words a table row may use for it (case-insensitive).
REFERENCES: dict[str, tuple[str, ...]] = {
    "Flow-GRPO": ("Flow-GRPO", "flow_grpo"),
    "DiffusionNFT": ("DiffusionNFT",),
    "MixGRPO": ("MixGRPO",),
    "DAPO": ("DAPO", "verl"),
    "GSPO": ("GSPO", "verl"),
    "GRPO-Guard": ("GRPO-Guard", "verl-omni"),
    "Wan2.1": ("Wan2.1", "flow_grpo"),
    "Wan2.2": ("Wan2.2",),
    "PromptRL": ("PromptRL", "UniRL"),
    "Flow-Factory": ("Flow-Factory", "flow_factory"),
}
_NAMES = "|".join(re.escape(name) for name in sorted(REFERENCES, key=len, reverse=True))
# "as Flow-GRPO ...", "as in MixGRPO", "as DiffusionNFT's ..."; "Flow-GRPO-Fast as published".
CLAIM = re.compile(rf"\b[Aa]s (?:in )?({_NAMES})(?!\w)|\b({_NAMES})[\w-]* as published\b")
COMMIT = re.compile(r"(?<![0-9A-Za-z])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![0-9A-Za-z])")
HEADING = re.compile(r"^(#{2,6})\s+(.*)$")


def recipe_files() -> list[str]:
    files = sorted((ROOT / "recipes").glob("*.yaml"))
    files += sorted((ROOT / "recipes" / "algorithms").glob("*.yaml")) + sorted(
        (ROOT / "recipes" / "overlays").glob("*.yaml")
    )
    return [path.relative_to(ROOT).as_posix() for path in files]


def header_lines(path: Path) -> list[str]:
    """The leading comment block: every line up to the first that is neither a comment nor blank."""
    lines = []
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            lines.append(stripped)
        elif stripped:
            break
    return lines


def sections(text: str) -> dict[str, list[str]]:
    """Heading text -> the lines under it up to the next heading (of any level)."""
    out: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        match = HEADING.match(line)
        if match:
            current = out.setdefault(match.group(2), [])
            continue
        if current is not None:
            current.append(line)
    return out


def section_for(doc: str, rel: str) -> list[str] | None:
    """The lines of the section whose heading names ``rel`` exactly (``recipes/x.yaml`` is not
    ``recipes/algorithms/x.yaml``)."""
    pattern = re.compile(rf"(?<![\w/.-]){re.escape(rel)}(?![\w/.-])")
    for heading, lines in sections(doc).items():
        if pattern.search(heading):
            return lines
    return None


def table_rows(lines: list[str]) -> list[str]:
    """Table rows, without the header's separator line."""
    return [line for line in lines if line.lstrip().startswith("|") and not re.fullmatch(r"[\s|:-]+", line)]


@pytest.fixture(scope="module")
def doc() -> str:
    assert DOC.is_file(), "docs/reproduce.md is missing"
    return DOC.read_text()


def test_there_are_recipes_to_check() -> None:
    files = recipe_files()
    assert "recipes/joint.yaml" in files and any(f.startswith("recipes/algorithms/") for f in files)


@pytest.mark.parametrize("rel", recipe_files())
def test_every_recipe_has_a_section_with_rows(doc: str, rel: str) -> None:
    lines = section_for(doc, rel)
    assert lines is not None, f"docs/reproduce.md has no section heading naming `{rel}` (add one and its table)"
    assert table_rows(lines)[1:], f"docs/reproduce.md's section for {rel} has no table rows"


@pytest.mark.parametrize("rel", recipe_files())
def test_header_claims_are_backed_by_a_row_with_a_commit(doc: str, rel: str) -> None:
    claims = []
    for line in header_lines(ROOT / rel):
        for match in CLAIM.finditer(line):
            claims.append((match.group(1) or match.group(2), line))
    if not claims:
        return
    lines = section_for(doc, rel)
    assert lines is not None, f"{rel} claims a reference's setting but docs/reproduce.md has no section for it"
    rows = table_rows(lines)
    for name, line in claims:
        words = [w.lower() for w in REFERENCES[name]]
        backed = [row for row in rows if any(w in row.lower() for w in words) and COMMIT.search(row)]
        assert backed, (
            f"{rel}: header line {line!r} claims {name}, but its section in docs/reproduce.md has no table row "
            f"naming {name} with a commit; add the row (source file and commit) or reword the header as "
            f"'differs from {name} in X (docs/reproduce.md)'"
        )


def test_claim_pattern() -> None:
    assert CLAIM.search("# as Flow-GRPO decodes FLUX").group(1) == "Flow-GRPO"
    assert CLAIM.search("# Flow-GRPO-Fast as published (yifan123)").group(2) == "Flow-GRPO"
    assert CLAIM.search("# 4.0 and 3.0, as Wan2.2 samples").group(1) == "Wan2.2"
    assert CLAIM.search("# PromptRL as its authors run it; as PromptRL trains FLUX").group(1) == "PromptRL"
    assert CLAIM.search("# As Flow-GRPO's `general_ocr_sd3`").group(1) == "Flow-GRPO"
    assert CLAIM.search("# decodes FLUX in float32, as Flow-GRPO.").group(1) == "Flow-GRPO"
    assert CLAIM.search("# as WanPipeline does") is None
    assert CLAIM.search("# differs from Flow-GRPO in KL (docs/reproduce.md)") is None
    assert COMMIT.search("config/grpo.py @54809b5") and COMMIT.search("e2e729f438668f6f")
    assert not COMMIT.search("decade 1000000 1.0e-4 deadbeefs")


def repeated_blocks(text: str, size: int = 10) -> list[int]:
    """1-based line numbers where a run of ``size`` non-blank lines repeats one seen earlier in ``text``."""
    lines = [line.strip() for line in text.splitlines()]
    seen: dict[tuple[str, ...], int] = {}
    repeats = []
    for i in range(len(lines) - size + 1):
        block = tuple(lines[i : i + size])
        if not all(block):
            continue
        if block in seen:
            repeats.append(i + 1)
        else:
            seen[block] = i + 1
    return repeats


def test_no_block_of_ten_lines_appears_twice(doc: str) -> None:
    repeats = repeated_blocks(doc)
    assert not repeats, f"docs/reproduce.md repeats a block of 10 lines at lines {repeats[:5]} (a merge left a copy)"


def test_repeated_blocks_finds_a_copy() -> None:
    body = "\n".join(f"line {i}" for i in range(12))
    assert repeated_blocks(body + "\n\n" + body) == [14, 15, 16]
    assert repeated_blocks(body) == []
