"""No source file of the package over 400 lines: the project keeps one concept per file
(docs/architecture.md), and a file past 400 lines has been found to hold more than one, so it is split along
its seam instead of growing."""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "unirl_pl"
MAX_LINES = 400


def test_no_package_file_exceeds_the_line_limit():
    lengths = {path.relative_to(PACKAGE.parent): len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")}
    assert len(lengths) > 50, "the package's files were not found"
    over = {str(path): n for path, n in sorted(lengths.items()) if n > MAX_LINES}
    assert not over, f"files over {MAX_LINES} lines (split each along a natural seam): {over}"
