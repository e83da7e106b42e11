"""bench/RESULTS.md sections: replace one benchmark's section, keep every other one; and
the machine and source facts every section states (CPU model, git commit)."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
REPO = RESULTS.parent.parent


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what ``platform`` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str:
    """The short commit of HEAD, "+ uncommitted changes" when entropykit/ differs from it."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True,
                                  cwd=REPO).stdout.strip()
        except OSError:
            return ""

    commit = git("rev-parse", "--short", "HEAD") or "?"
    if git("status", "--porcelain", "--untracked-files=all", "entropykit"):
        commit += " + uncommitted changes"
    return commit


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
