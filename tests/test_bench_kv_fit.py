"""Tests of bench/bench_kv_fit.py's whole-run plumbing: which folder a child puts first on
its path for ``--old``, and that a child that fails says why (its exit status and
stderr) instead of stopping the run with a bare status."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location(
    "bench_kv_fit", Path(__file__).resolve().parent.parent / "bench" / "bench_kv_fit.py")
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)


def test_old_tree_from_residual_py_package_or_its_folder(tmp_path):
    pkg = tmp_path / "entropykit" / "predictive"
    pkg.mkdir(parents=True)
    (pkg / "residual.py").write_text("")
    for given in (pkg / "residual.py", tmp_path / "entropykit", tmp_path):
        assert bench._tree(given) == tmp_path.resolve()


def test_failed_child_prints_its_status_and_stderr(tmp_path, capsys, monkeypatch):
    # A folder holding only a package (as a copy of an old tree's entropykit/ is), one
    # that fails to import: the row is None and the child's error is shown.
    (tmp_path / "entropykit").mkdir()
    (tmp_path / "entropykit" / "__init__.py").write_text(
        'raise ImportError("this tree is broken on purpose")\n')
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    args = argparse.Namespace(seqs=1, tokens=8, predictor="none")
    row = bench._run_child("old", tmp_path, "1", str(tmp_path / "out.safetensors"), args)
    out = capsys.readouterr().out
    assert row is None
    assert "old threads 1: the child exited with status 1" in out
    assert f"PYTHONPATH={tmp_path}:/elsewhere" in out  # the tree first, the caller's kept
    assert "ImportError: this tree is broken on purpose" in out
