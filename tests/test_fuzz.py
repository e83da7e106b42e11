"""Fuzzing the decoders with mutated real artifacts: reject cleanly or decode exactly.

Every target (compressed files in each writer mode, rANS / tANS frames with and without
context, rans2d payloads, distribution-rANS frames, KV blobs) is mutated by seeded cases
(``tests/_fuzz.py``); each mutated input must raise ``CorruptDataError`` or decode to
exactly the original, within ``TIME_CAP`` seconds and ``RSS_CAP`` bytes of peak memory
growth, in a worker whose address space is limited (a runaway allocation fails). The
default run gives each target a few seconds; ``-m slow`` runs each for
``ENTROPYKIT_FUZZ_SECONDS`` (default 300) with other seeds.
"""

from __future__ import annotations

import os

import _fuzz
import pytest

# seconds of cases per target in the default run (worker start-up not included)
BUDGET = {"file": 8, "file-fast": 3, "file-gpu": 3, "rans": 4, "tans": 3, "rans2d": 4,
          "dist": 3, "kv": 5}
MINIMUM = 40  # cases run whatever the clock says: a slow machine still fuzzes


def _check(name: str, seed: int, seconds: float) -> None:
    rep = _fuzz.campaign(name, seed, seconds=seconds, minimum=MINIMUM)
    print(f"{name} seed {seed}: {rep.cases} cases, slowest {rep.slowest:.2f} s, "
          f"peak RSS growth {rep.peak_rss >> 20} MiB")
    if rep.failures:
        pytest.fail(rep.summary(name, seed), pytrace=False)
    assert rep.cases >= MINIMUM


def test_harness_reports_every_kind_of_failure():
    rep = _fuzz.campaign("faulty", 0, seconds=0, minimum=40, maximum=40)
    assert rep.cases + sum("died" in f.problem for f in rep.failures) == 40
    problems = "\n".join(f.problem for f in rep.failures)
    for kind in ("builtins.ValueError: not the right type", "WRONG OUTPUT", "MemoryError",
                 "worker died (exit -6)"):
        assert kind in problems
    assert "clean" not in problems


def test_targets_are_all_fuzzed():
    assert set(BUDGET) == set(_fuzz.TARGETS)


@pytest.mark.parametrize("name", sorted(_fuzz.TARGETS))
def test_fuzz(name):
    _check(name, 0, BUDGET[name])


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("name", sorted(_fuzz.TARGETS))
def test_fuzz_long(name, seed):
    _check(name, seed, float(os.environ.get("ENTROPYKIT_FUZZ_SECONDS", "300")))
