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


def test_table_has_a_row_per_run_and_old_over_new_per_setting(capsys):
    row = {"torch_threads": 2, "file_bytes": 1234, "fingerprint": "0x1"}
    rows = [("old", "1", row | {"cpu_s": 9.0, "wall_s": 10.0}),
            ("new", "1", row | {"cpu_s": 3.0, "wall_s": 4.0, "fit_threads": 1,
                                "forwards_cpu_s": 1.0, "forwards_wall_s": 1.5,
                                "fits_cpu_s": 2.0, "fits_wall_s": 2.5}),
            ("new", "default", row | {"cpu_s": 3.5, "wall_s": 1.0})]
    bench._table(rows)
    out = capsys.readouterr().out
    assert "| new | 1 | 1 | 2 | 3.00 | 4.00 | 1.00 / 1.50 | 2.00 / 2.50 | 1,234 | 0x1 |" in out
    assert "| old / new | 1 | | | 3.00x | 2.50x |" in out
    assert "| old / new | default" not in out  # no old run at that setting
