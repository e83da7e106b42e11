"""Tests of bench/thread_model.py, the many-thread prediction of ``bench_threads.py
--model``: its critical path, its one-GIL simulation and its what-if on made-up units, and
its record of a real pool run (units, nesting, kernel calls)."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from numba import njit

from entropykit.coding import parallel

_BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(_BENCH))  # thread_model imports its sibling gil.py
_SPEC = importlib.util.spec_from_file_location("bench_thread_model", _BENCH / "thread_model.py")
tm = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = tm  # its dataclasses look their module up
_SPEC.loader.exec_module(tm)
Unit, Record = tm.Unit, tm.Record


def _tree() -> list:
    # 0 (1 s) opened 1 (2 s) and 2 (3 s); 2 opened 3 (4 s); 4 (5 s) is outer alone.
    units = [Unit(1.0), Unit(2.0, parent=0), Unit(3.0, parent=0), Unit(4.0, parent=2),
             Unit(5.0)]
    units[0].children += [1, 2]
    units[2].children.append(3)
    return units


def test_critical_path_is_the_longest_chain_of_nested_units():
    assert tm.critical_path(_tree()) == pytest.approx(1.0 + 3.0 + 4.0)


def test_free_units_share_the_threads():
    # Six units of 1 s, all in kernels: 3 rounds on 2 threads, 2 on 3, 1 on 6 or more.
    rec = Record([Unit(1.0, [1.0]) for _ in range(6)], Unit(), 2)
    assert [tm.simulate(rec, n) for n in (2, 3, 6, 16)] == pytest.approx([3, 2, 1, 1])


def test_held_units_run_one_at_a_time_whatever_the_count():
    rec = Record([Unit(1.0) for _ in range(6)], Unit(), 2)
    assert [tm.simulate(rec, n) for n in (1, 4, 16)] == pytest.approx([6, 6, 6])


def test_each_handoff_to_a_waiting_thread_idles_the_gil():
    # Two units each held 1 s: the second thread waits for the GIL, then wakes late.
    rec = Record([Unit(1.0), Unit(1.0)], Unit(), 2)
    assert tm.simulate(rec, 2, handoff=0.25) == pytest.approx(2.25)
    assert tm.simulate(rec, 1, handoff=0.25) == pytest.approx(2.0)  # one thread: no wait


def test_calling_thread_competes_for_the_gil():
    rec = Record([Unit(1.0, [1.0]) for _ in range(4)], Unit(2.0), 2)
    assert tm.simulate(rec, 4) == pytest.approx(2.0)  # its 2 s held, workers' 1 s free


def test_holding_moves_short_kernel_calls_into_the_held_time():
    u = Unit(1.0, [0.1, 0.001, 0.3, 0.002])
    h = u.holding(0.01)
    assert (h.releases, h.kernel, h.held) == (2, pytest.approx(0.4), pytest.approx(0.6))
    assert (u.releases, u.held) == (4, pytest.approx(1.0 - 0.403))
    rec = tm.holding(Record([u], Unit(0.5, [0.001]), 2), 0.01)
    assert rec.caller.releases == 0 and rec.units[0].releases == 2


def test_predict_names_the_bounds():
    text = tm.predict(Record(_tree(), Unit(1.0), 2), [1, 16], [0.0, 20e-6])
    assert "critical path 8000.0 ms" in text and "GIL bound 1.0x" in text
    assert text.count("\n| 16 | 16x |") == 1


@njit(nogil=True, cache=False)
def _busy(x):
    s = 0
    for i in range(x.size):
        s += x[i]
    return s


def test_record_times_a_real_pool_run_with_its_nesting_and_kernel_calls():
    mod = types.ModuleType("tm_probe")
    mod._busy = _busy
    x = np.arange(1000, dtype=np.int64)
    _busy(x)  # compiled before the wrappers go in

    def item(k: int) -> int:
        inner = parallel.run(lambda j: int(mod._busy(x)) + j, 3, None)  # nested on the pool
        return sum(inner) + k

    def op(n: int) -> list:
        return list(parallel.imap(item, range(4), n))

    rec = tm.record(op, 2, [mod])
    outer = [u for u in rec.units if u.parent < 0]
    assert len(outer) == 4 and len(rec.units) == 16
    assert all(len(u.children) == 3 for u in outer)
    assert sum(u.releases for u in rec.units) == 12 and rec.caller.releases == 0
    assert mod._busy is _busy  # put back
    assert parallel._Pool._execute.__name__ == "_execute"


def test_handoff_is_zero_on_one_thread_and_measured_on_two():
    assert tm.handoff(1, rounds=20) == 0.0
    assert 0.0 <= tm.handoff(2, rounds=50) < 0.05  # idle seconds per hand-off: small
