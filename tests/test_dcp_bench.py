"""The storage model of bench/bench_dcp.py's rate-limited saves (``_Bucket``): one device
per rank at ``rate`` bytes/s that every stream of the rank shares, with no credit for
time it stood idle, on a made-up clock. (The writers themselves: test_dcp*.py.)"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch.distributed.checkpoint")

_BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(_BENCH))
    try:
        spec = importlib.util.spec_from_file_location("bench_dcp_model", _BENCH / "bench_dcp.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(_BENCH))
    return mod


class _Clock:
    """``time.perf_counter`` and ``time.sleep`` of a made-up clock: sleeping moves it."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


@pytest.fixture
def clock(bench, monkeypatch) -> _Clock:
    c = _Clock()
    monkeypatch.setattr(bench, "time", c)
    return c


def test_a_write_takes_its_bytes_over_the_rate(bench, clock):
    b = bench._Bucket(1e6)
    b.take(250_000)
    assert clock.slept == [pytest.approx(0.25)]
    b.take(500_000)  # right after: queued behind nothing, the device is free again
    assert clock.slept[-1] == pytest.approx(0.5)
    assert b.sent == 750_000


def test_idle_time_is_not_banked(bench, clock):
    # A writer that codes for a second and then writes 1 MB at once still waits 1 s for
    # it (the old bucket let it through at once: 1 MB in 1 s since the first write).
    b = bench._Bucket(1e6)
    b.take(1)
    clock.now += 1.0
    b.take(1_000_000)
    assert clock.slept[-1] == pytest.approx(1.0)


def test_streams_of_a_rank_share_the_device(bench, clock):
    # Two writes handed over at the same instant (two streams' threads): the second
    # queues behind the first, as on one device.
    b = bench._Bucket(1e6)
    real_sleep = clock.sleep
    clock.sleep = lambda s: clock.slept.append(s)  # both threads sleep from one instant
    b.take(300_000)
    b.take(300_000)
    assert clock.slept == [pytest.approx(0.3), pytest.approx(0.6)]
    clock.sleep = real_sleep


def test_no_rate_counts_bytes_and_never_sleeps(bench, clock):
    b = bench._Bucket(None)
    b.take(10 << 20)
    assert clock.slept == [] and b.sent == 10 << 20
