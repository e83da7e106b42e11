"""The documentation's references resolve: every relative link and every repository file
cited in README.md, docs/*.md, bench/*.md and gpu/README.md exists, and no file in the
repository cites a design document that is not in it."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", ROOT / "gpu" / "README.md",
               *(ROOT / "docs").glob("*.md"), *(ROOT / "bench").glob("*.md")])
# A cited file: a backquoted path ending in one of the repository's file kinds.
_CITED = re.compile(r"`([\w./-]+\.(?:py|md|cu|sh|ipynb|toml))(?::\d+)?`")
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _repo_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / p for p in out.splitlines() if (ROOT / p).exists()]


def _resolves(doc: Path, ref: str, names: set[str]) -> bool:
    """A path relative to the document, the root or the package (``coding/frame.py``), or
    a bare file name in the repository."""
    if any((base / ref).exists() for base in (doc.parent, ROOT, ROOT / "entropykit")):
        return True
    return "/" not in ref and ref in names


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_and_cited_files_exist(doc: Path) -> None:
    text = doc.read_text("utf-8")
    names = {p.name for p in _repo_files()}
    links = [m for m in _LINK.findall(text) if "://" not in m and not m.startswith("mailto:")]
    missing = [r for r in links + _CITED.findall(text) if not _resolves(doc, r, names)]
    assert missing == []


def test_no_file_cites_a_design_document_outside_the_repository() -> None:
    citing = [str(p.relative_to(ROOT)) for p in _repo_files()
              if p.suffix in (".py", ".md", ".ipynb", ".cu", ".sh", ".toml")
              and p.name != "test_docs.py" and "DESIGN" in p.read_text("utf-8", "replace")]
    assert citing == []


@pytest.mark.parametrize("nb", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.name)
def test_notebooks_open_with_their_question(nb: Path) -> None:
    first = json.loads(nb.read_text("utf-8"))["cells"][0]
    assert first["cell_type"] == "markdown"
    title, paragraph = "".join(first["source"]).split("\n\n")[:2]
    assert title.startswith("# ") and "?" in paragraph
