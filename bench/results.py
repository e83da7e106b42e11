"""bench/RESULTS.md sections: replace one benchmark's section, keep every other one."""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def write_section(text: str, section: str, path: Path = RESULTS) -> None:
    """Replace (or append) the section headed ``section`` (a ``## ...`` line) with ``text``."""
    old = path.read_text() if path.exists() else "# Benchmark results\n"
    lines = old.splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if ln.rstrip() == section), None)
    if start is None:
        new = old.rstrip("\n") + "\n\n" + text
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")),
                   len(lines))
        rest = "".join(lines[end:])
        new = "".join(lines[:start]) + text + ("\n" + rest if rest else "")
    path.write_text(new)
