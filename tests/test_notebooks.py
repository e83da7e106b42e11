"""The analysis notebooks run top to bottom, offline, and their committed outputs are current.

Slow (excluded from the default run); run them with

    python -m pytest -m slow tests/test_notebooks.py

They need the ``notebooks`` extra (nbclient, nbformat, ipykernel, matplotlib), the ``kv``
extra (torch, transformers: 03_kv_cache_entropy runs SmolLM2-135M) and the benchmark cache
filled once (``python bench/data.py``). ``python tests/test_notebooks.py [NOTEBOOK ...]``
re-executes the notebooks (all, or those named) and writes their outputs back (do that
after changing one).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def _execute(path: Path):
    import nbclient
    import nbformat

    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=1800, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    return nb


def _outputs(nb, kind: str) -> list:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if o.output_type == kind]


def _first_stream(nb) -> str:
    return next(o.text for o in _outputs(nb, "stream") if o.get("name") == "stdout")


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_and_outputs_are_current(path):
    import nbformat

    committed = nbformat.read(path, as_version=4)
    assert _outputs(committed, "stream"), f"{path.name} is committed without outputs"
    nb = _execute(path)  # raises CellExecutionError on the first failing cell
    images = [o for kind in ("display_data", "execute_result") for o in _outputs(nb, kind)
              if "image/png" in o.get("data", {})]
    assert images and not _outputs(nb, "error")
    # The first printed table is exact counts of pinned data: deterministic.
    assert _first_stream(nb) == _first_stream(committed)


def test_there_are_notebooks():
    # (a) weights across formats, (b) coders vs the bound, (c) KV-cache entropy.
    assert [p.name[:3] for p in NOTEBOOKS[:3]] == ["01_", "02_", "03_"]


if __name__ == "__main__":
    import nbformat

    for p in [Path(a).resolve() for a in sys.argv[1:]] or NOTEBOOKS:
        nbformat.write(_execute(p), p)
        print(f"executed {p}", file=sys.stderr)
