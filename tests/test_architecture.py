"""docs/ARCHITECTURE.md's import table holds: every import inside the package is allowed.

The table is read from the document itself, so the document stays the one source.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "entropykit"
DOC = ROOT / "docs" / "ARCHITECTURE.md"


def _table() -> dict[str, set[str]]:
    rows: dict[str, set[str]] = {}
    for line in DOC.read_text("utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and re.fullmatch(r"`\w+`", cells[0]):
            rows[cells[0].strip("`")] = set(re.findall(r"`(\w+)`", cells[2]))
    return rows


def _unit(parts: list[str]) -> str:
    """The top-level unit a dotted path inside the package belongs to."""
    if not parts:
        return "__init__"
    first = parts[0]
    if (PACKAGE / first).is_dir() or (PACKAGE / f"{first}.py").is_file():
        return first
    return "__init__"  # a name defined in entropykit/__init__.py (e.g. __version__)


def _imports(path: Path) -> set[str]:
    rel = path.relative_to(PACKAGE).with_suffix("").parts
    package = list(rel[:-1]) if rel[-1] != "__init__" else list(rel[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "entropykit":
                    found.add(_unit(a.name.split(".")[1:]))
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                if not (node.module or "").startswith("entropykit"):
                    continue
                base = node.module.split(".")[1:]
            else:
                up = node.level - 1
                base = package[: len(package) - up] if up else list(package)
                base = base + (node.module.split(".") if node.module else [])
            if base:
                found.add(_unit(base))
            else:  # from entropykit import a, b: each name is a unit or __init__'s
                found.update(_unit([a.name]) for a in node.names)
    return found


def test_table_covers_every_unit() -> None:
    table = _table()
    units = {p.stem for p in PACKAGE.glob("*.py")} | {
        p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert units == set(table), (
        f"docs/ARCHITECTURE.md lists {sorted(set(table) - units)} that do not exist and "
        f"misses {sorted(units - set(table))}")


def test_every_import_is_allowed() -> None:
    table = _table()
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        unit = _unit(list(path.relative_to(PACKAGE).parts[:1])
                     if path.parent != PACKAGE else [path.stem])
        for other in sorted(_imports(path) - {unit} - table.get(unit, set())):
            bad.append(f"{path.relative_to(ROOT)}: {unit} imports {other}")
    assert not bad, "imports not allowed by docs/ARCHITECTURE.md:\n" + "\n".join(bad)


def test_the_checker_sees_imports() -> None:
    # The checker must find relative, absolute and function-level imports.
    found = _imports(PACKAGE / "container" / "checkpoint.py")
    assert {"container", "_errors"} <= found
    assert "container" in _imports(PACKAGE / "api.py")
    assert "__init__" in _imports(PACKAGE / "cli.py")  # from . import __version__
