"""Atomic output with a background writer and writeback (container/_atomic.py): the bytes
written through ``output_file`` (writes, seeks back, truncation) are exactly the file that
appears, with a small or large write queue; writeback runs while writing; a failing write,
writeback or block raises its error and leaves no output."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import numpy as np
import pytest

from entropykit.container import _atomic


def _write_pattern(out, blob: bytes) -> None:
    # Forward writes in pieces, a seek back to patch the start, and a truncation: what the
    # container writer does (payload index and header are written after the data).
    out.seek(16)
    for i in range(0, len(blob), 700):
        out.write(blob[i : i + 700])
    end = out.tell()
    out.write(b"junk past the end")
    out.seek(0)
    out.write(b"H" * 16)
    out.seek(end)
    out.truncate()


@pytest.mark.parametrize("queue", [1000, 64 << 20])
def test_writes_seeks_and_truncation_give_the_exact_file(tmp_path: Path, queue: int,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_atomic, "SYNC_BYTES", 1000)
    monkeypatch.setattr(_atomic, "QUEUE_BYTES", queue)
    synced = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(fd), real(fd)))
    blob = np.random.default_rng(0).integers(0, 256, 10_000, dtype=np.uint8).tobytes()
    dst = tmp_path / "out.bin"
    with _atomic.output_file(dst) as out:
        _write_pattern(out, blob)
        assert out.tell() == 16 + len(blob)
        assert not dst.exists()
        with pytest.raises(ValueError, match="absolute"):
            out.seek(0, os.SEEK_END)
    assert dst.read_bytes() == b"H" * 16 + blob
    assert synced  # writeback started before the end (10 kicks, coalesced)
    assert os.listdir(tmp_path) == ["out.bin"]


def test_failing_writeback_raises_and_leaves_nothing(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_atomic, "SYNC_BYTES", 100)

    def broken(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", broken)
    with pytest.raises(OSError, match="Input/output error"):
        with _atomic.output_file(tmp_path / "out.bin") as out:
            out.write(b"x" * 1000)
    assert os.listdir(tmp_path) == []


def test_error_in_the_block_wins_over_writeback_and_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_atomic, "SYNC_BYTES", 100)
    monkeypatch.setattr(os, "fdatasync", lambda fd: (_ for _ in ()).throw(OSError("sync")))
    with pytest.raises(KeyboardInterrupt):
        with _atomic.output_file(tmp_path / "out.bin") as out:
            out.write(b"x" * 1000)
            raise KeyboardInterrupt
    assert os.listdir(tmp_path) == []


def test_existing_target_kept_without_force(tmp_path: Path) -> None:
    dst = tmp_path / "out.bin"
    dst.write_bytes(b"keep")
    with pytest.raises(FileExistsError):
        with _atomic.output_file(dst) as out:
            out.write(b"new")
    assert dst.read_bytes() == b"keep"
    with _atomic.output_file(dst, force=True) as out:
        out.write(b"new")
    assert dst.read_bytes() == b"new"


class _FullDisk:
    """A file whose writes fail once ``room`` bytes are written (like ENOSPC)."""

    def __init__(self, f, room: int) -> None:
        self._f, self._room = f, room

    def write(self, data) -> int:
        self._room -= memoryview(data).nbytes
        if self._room < 0:
            raise OSError(28, "No space left on device")
        return self._f.write(data)

    def __getattr__(self, name: str):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()


def test_failing_write_raises_in_the_caller_and_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.fdopen
    monkeypatch.setattr(os, "fdopen", lambda fd, mode: _FullDisk(real(fd, mode), 5000))
    with pytest.raises(OSError, match="No space left"):
        with _atomic.output_file(tmp_path / "out.bin") as out:
            for _ in range(100):  # the error surfaces in a later call or at the end
                out.write(b"y" * 1000)
    assert os.listdir(tmp_path) == []


def test_output_dir_into_an_existing_directory(tmp_path: Path) -> None:
    """Only the block's files replace their namesakes; other files, and a live run's
    temporary, stay; a killed run's stale temporary goes; a link to a directory is
    written through, and stays a link."""
    real = tmp_path / "real"
    (real / "sub").mkdir(parents=True)
    (real / "keep.txt").write_text("keep")
    (real / "sub" / "a.bin").write_text("old a")
    stale = real / ".real.abcdefgh.ek-tmp"
    stale.mkdir()
    (stale / "half").write_text("x")
    young = real / ".real.zzzzzzzz.ek-tmp"
    young.write_text("y")
    os.utime(stale, (0, 0))
    (tmp_path / "out").symlink_to(real)
    ran = []
    with pytest.raises(FileExistsError):
        with _atomic.output_dir(tmp_path / "out", names=[Path("sub/a.bin")]):
            ran.append(1)
    with _atomic.output_dir(tmp_path / "out", force=True, names=[Path("sub/a.bin")]) as tmp:
        assert tmp.parent == real and not stale.exists()
        (tmp / "sub").mkdir()
        (tmp / "sub" / "a.bin").write_text("new a")
        (tmp / "b.bin").write_text("new b")
    assert (tmp_path / "out").is_symlink() and ran == []
    assert sorted(str(p.relative_to(real)) for p in real.rglob("*")) == [
        ".real.zzzzzzzz.ek-tmp", "b.bin", "keep.txt", "sub", "sub/a.bin"]
    assert (real / "sub" / "a.bin").read_text() == "new a"


def test_output_dir_refuses_before_the_block_runs(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "sub").symlink_to(tmp_path)  # writing sub/x would land outside out
    (out / "dev").mkdir()
    for name in ("sub/x", "dev"):
        with pytest.raises(_atomic.OutputRefused, match="refusing"):
            with _atomic.output_dir(out, force=True, names=[Path(name)]):
                raise AssertionError("the block must not run")
    assert sorted(os.listdir(out)) == ["dev", "sub"]


def test_writelines_queues_buffers_in_order_between_seeks(tmp_path: Path) -> None:
    dst = tmp_path / "lines.bin"
    with _atomic.output_file(dst) as out:
        out.write(b"\0" * 4)
        out.writelines([b"ab", memoryview(np.arange(3, dtype=np.uint8)), b""])
        assert out.tell() == 9
        out.seek(0)
        out.writelines([b"HEAD"])
        out.seek(9)
        out.writelines([])
        assert out.tell() == 9
    assert dst.read_bytes() == b"HEADab\x00\x01\x02"


def test_many_outputs_stale_temporaries_cleared_in_one_listing(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    """``remove_stale_in``: of 300 outputs' temporaries, in one listing, the stale ones of
    the outputs asked for go; a young one, one of another output and a locked one stay.
    ``output_file(sweep=False)`` lists nothing (the caller swept once)."""
    import fcntl

    old = 1.0
    for i in range(300):
        p = tmp_path / f".f{i:03d}.bin.abcd{i % 10:04d}.ek-tmp"
        p.write_bytes(b"partial")
        os.utime(p, (old, old))
    young = tmp_path / ".f000.bin.zzzzzzzz.ek-tmp"
    young.write_bytes(b"live")
    other = tmp_path / ".notes.txt.abcdefgh.ek-tmp"
    other.write_bytes(b"x")
    os.utime(other, (old, old))
    locked = tmp_path / ".f001.bin.lockedxx.ek-tmp"
    locked.write_bytes(b"x")
    os.utime(locked, (old, old))
    listings = []
    real = os.listdir
    monkeypatch.setattr(os, "listdir", lambda d: (listings.append(d), real(d))[1])
    with open(locked, "rb") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        removed = _atomic.remove_stale_in(tmp_path, lambda t: t.startswith("f"))
    assert listings == [tmp_path] and len(removed) == 300
    assert sorted(os.listdir(tmp_path)) == sorted([young.name, other.name, locked.name])
    assert _atomic.temp_target(".a.b.bin.abcd1234.ek-tmp") == "a.b.bin"
    assert _atomic.temp_target(".a.bin.abc1234.ek-tmp") is None  # 7 characters, not 8
    listings.clear()
    stale = tmp_path / ".out.bin.abcd1234.ek-tmp"
    stale.write_bytes(b"x")
    os.utime(stale, (old, old))
    with _atomic.output_file(tmp_path / "out.bin", sweep=False) as out:
        out.write(b"new")
    assert listings == [] and stale.exists()
    with _atomic.output_file(tmp_path / "out.bin", force=True) as out:
        out.write(b"new")
    assert listings == [tmp_path] and not stale.exists()


def test_a_file_below_sync_bytes_runs_no_writeback(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the writer runs for a small file; a file past ``SYNC_BYTES`` runs the
    writeback once (its kicks coalesce into that one task)."""
    tasks = []
    real = _atomic._POOL.run

    def run(task, done) -> None:
        tasks.append(task.__qualname__)
        real(task, done)

    monkeypatch.setattr(_atomic._POOL, "run", run)
    monkeypatch.setattr(_atomic, "SYNC_BYTES", 1000)
    with _atomic.output_file(tmp_path / "small.bin") as out:
        out.write(b"x" * 999)
    assert tasks == ["_OutputFile._run"]
    tasks.clear()
    with _atomic.output_file(tmp_path / "large.bin") as out:
        for _ in range(10):
            out.write(b"y" * 1000)
            out.flush()  # each write reaches the writer thread: ten kicks
    assert sorted(tasks) == ["_OutputFile._run", "_Writeback._run"]
    assert (tmp_path / "small.bin").read_bytes() == b"x" * 999
    assert (tmp_path / "large.bin").read_bytes() == b"y" * 10_000


def _started_threads(monkeypatch: pytest.MonkeyPatch) -> list:
    """The threads that ``_atomic`` starts from now on."""
    import threading

    started: list[threading.Thread] = []
    real = threading.Thread

    class Counted(real):  # type: ignore[valid-type, misc]
        def start(self) -> None:
            started.append(self)
            super().start()

    monkeypatch.setattr(_atomic.threading, "Thread", Counted)
    return started


def test_files_written_in_a_row_reuse_two_threads(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank's shard files, one after another, each with a writer and writeback: the
    threads come back to a pool after each file, so 40 files start at most two threads
    (none where an earlier test left the pool two idle ones), and between files no
    thread of ``_atomic`` is doing anything."""
    import threading

    monkeypatch.setattr(_atomic, "SYNC_BYTES", 1000)
    started = _started_threads(monkeypatch)
    before = set(threading.enumerate())
    seen: set[threading.Thread] = set()
    for i in range(40):
        with _atomic.output_file(tmp_path / f"shard{i}.bin", sweep=False) as out:
            out.write(bytes([i]) * 3000)
            out.flush()  # past SYNC_BYTES: the writeback runs too
            seen.update(set(threading.enumerate()) - before)
    assert len(started) <= 2 and len(seen) <= 2, (started, seen)
    assert all(t.daemon for t in seen)  # idle ones never hold up the interpreter's exit
    for i in range(40):
        assert (tmp_path / f"shard{i}.bin").read_bytes() == bytes([i]) * 3000
    assert len(os.listdir(tmp_path)) == 40


def test_files_written_at_once_each_get_a_thread_and_the_idle_ones_are_capped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Files open at once never wait for one another's writer (each gets its own
    thread); once they are closed, at most the pool's cap of threads stays, idle."""

    monkeypatch.setattr(_atomic, "_POOL", _atomic._Pool())
    monkeypatch.setattr(_atomic, "_POOL_IDLE", 3)
    started = _started_threads(monkeypatch)
    with contextlib.ExitStack() as stack:
        outs = [stack.enter_context(_atomic.output_file(tmp_path / f"f{i}.bin"))
                for i in range(6)]
        for i, out in enumerate(outs):
            out.write(bytes([i]) * 100)
        for out in outs:
            out.flush()  # every writer runs at once
        assert len(started) == 6
    for _ in range(500):  # the surplus threads exit once their file is done
        if sum(t.is_alive() for t in started) == 3:
            break
        time.sleep(0.01)
    assert sum(t.is_alive() for t in started) == 3
    assert len(_atomic._POOL._idle) == 3
    assert all(t.daemon for t in started)
    for i in range(6):
        assert (tmp_path / f"f{i}.bin").read_bytes() == bytes([i]) * 100


def test_a_failing_write_on_a_reused_thread_surfaces_as_before(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that fails on a pool thread that wrote earlier files: the caller's next
    call raises the error itself, nothing is left, and the thread writes the next file."""
    for i in range(3):
        with _atomic.output_file(tmp_path / f"ok{i}.bin") as out:
            out.write(b"fine")
    real = os.fdopen
    monkeypatch.setattr(os, "fdopen", lambda fd, mode: _FullDisk(real(fd, mode), 5000))
    started = _started_threads(monkeypatch)
    with pytest.raises(OSError, match="No space left") as err:
        with _atomic.output_file(tmp_path / "full.bin") as out:
            for _ in range(100):
                out.write(b"y" * 1000)
                out.flush()  # the error is raised by the call after the failed write
            pytest.fail("the failed write was not reported")
    assert err.value.errno == 28
    assert started == []  # the file's writer was one of the earlier files' threads
    monkeypatch.setattr(os, "fdopen", real)
    with _atomic.output_file(tmp_path / "after.bin") as out:
        out.write(b"again")
    assert sorted(os.listdir(tmp_path)) == ["after.bin", "ok0.bin", "ok1.bin", "ok2.bin"]
    assert (tmp_path / "after.bin").read_bytes() == b"again"


def test_outputs_written_at_once_get_the_umask_mode(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Each output reads the umask by setting it for an instant; threads writing at once
    (a rank's shard files) must not read one another's stand-in (old: files of 0644
    under a umask of 077). The instant is widened here so that reads overlap."""
    import threading
    import time

    real = os.umask

    def slow(mask: int) -> int:
        old = real(mask)
        time.sleep(0.01)
        return old

    before = real(0o077)
    try:
        monkeypatch.setattr(os, "umask", slow)
        barrier = threading.Barrier(6)

        def one(i: int) -> None:
            barrier.wait()
            with _atomic.output_file(tmp_path / f"f{i}.bin") as out:
                out.write(b"x")

        threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        real(before)
    assert sorted(oct(os.stat(tmp_path / f"f{i}.bin").st_mode & 0o777) for i in range(6)) == [
        "0o600"] * 6


def test_a_forked_child_writes_with_its_own_threads(tmp_path: Path) -> None:
    """The parent's idle pool threads do not exist in a forked child: its files get
    new ones (a task handed to a parent's thread would never run)."""
    with _atomic.output_file(tmp_path / "parent.bin") as out:
        out.write(b"p")  # the parent's pool now holds an idle thread
    assert _atomic._POOL._idle
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 only if its file is written
        import signal

        signal.alarm(20)  # a hang ends the child, not the test run
        try:
            with _atomic.output_file(tmp_path / "child.bin") as out:
                out.write(b"c")
            os._exit(0)
        except BaseException:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert (tmp_path / "child.bin").read_bytes() == b"c"


def test_a_stopped_pool_ends_its_idle_threads_and_keeps_none(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``stop`` (run as the interpreter begins to shut down) joins every idle thread;
    files written after it still get their writer, on a thread that ends with the file."""
    monkeypatch.setattr(_atomic, "_POOL", _atomic._Pool())
    started = _started_threads(monkeypatch)
    for i in range(3):
        with _atomic.output_file(tmp_path / f"a{i}.bin") as out:
            out.write(b"a")
    assert len(started) == 1 and started[0].is_alive()  # one thread, idle, kept
    _atomic._POOL.stop()
    assert not started[0].is_alive() and not _atomic._POOL._idle
    for i in range(2):
        with _atomic.output_file(tmp_path / f"b{i}.bin") as out:
            out.write(b"b")
    assert len(started) == 3
    for _ in range(500):
        if not any(t.is_alive() for t in started):
            break
        time.sleep(0.01)
    assert not any(t.is_alive() for t in started) and not _atomic._POOL._idle
    assert sorted(os.listdir(tmp_path)) == ["a0.bin", "a1.bin", "a2.bin", "b0.bin", "b1.bin"]


_EXIT_CHECK = """
import atexit, os, sys, threading
from pathlib import Path
from entropykit.container import _atomic

_atomic.SYNC_BYTES = 1000  # writeback tasks too
for i in range(20):
    with _atomic.output_file(Path(sys.argv[1]) / f"f{i}", sweep=False) as out:
        out.write(bytes([i]) * 3000)
        out.flush()
assert _atomic._POOL._idle, "no idle thread to stop"

def check():  # atexit runs after the interpreter joined its threads, before teardown
    if any(t.name == "entropykit-io" and t.is_alive() for t in threading.enumerate()):
        os._exit(7)

atexit.register(check)
"""


def test_a_process_ends_with_no_pool_thread_left(tmp_path: Path) -> None:
    """A process that wrote files through the pool exits with status 0, and by the time
    the interpreter tears down no pool thread is alive (the exit status would be 7)."""
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(Path(_atomic.__file__).parents[2]))
    for round_ in range(2):
        out = tmp_path / str(round_)
        out.mkdir()
        done = subprocess.run([sys.executable, "-c", _EXIT_CHECK, str(out)], env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert len(os.listdir(out)) == 20


def test_small_writes_wake_the_writer_once_a_wake_bytes_is_queued(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file of many small writes (a shard of small tensors) hands them to the writer
    thread in a few batches, not one wake-up each; past ``_WAKE_BYTES`` queued the writer
    goes on by itself, and ``flush`` wakes it for less."""
    batches = []
    real = _atomic._OutputFile._write_all

    def counted(self, bufs) -> None:
        batches.append(len(bufs))
        real(self, bufs)

    monkeypatch.setattr(_atomic._OutputFile, "_write_all", counted)
    monkeypatch.setattr(_atomic, "_WAKE_BYTES", 100_000)

    def left_queued(out) -> bool:
        """Once the writer waits: whether writes are queued (too few to wake it)."""
        for _ in range(1000):
            with out._cv:
                if out._idle and (not out._ops or out._queued < _atomic._WAKE_BYTES):
                    return bool(out._ops)
            time.sleep(0.005)
        raise AssertionError("the writer never went idle")

    dst = tmp_path / "many.bin"
    with _atomic.output_file(dst) as out:
        for i in range(40):  # 40 kB: below the wake-up, nothing written yet
            out.write(bytes([i]) * 1000)
            assert left_queued(out) and batches == []
        out.flush()  # a caller that waits wakes the writer
        assert batches == [40] and os.pread(out.fileno(), 1000, 39_000) == bytes([39]) * 1000
        for i in range(3):  # 120 kB: the writer takes the first 100 kB by itself
            out.write(bytes([100 + i]) * 40_000)
        assert not left_queued(out) and batches == [40, 3]
        out.write(b"end")
    assert batches == [40, 3, 1]
    want = b"".join(bytes([i]) * 1000 for i in range(40)) + b"".join(
        bytes([100 + i]) * 40_000 for i in range(3)) + b"end"
    assert dst.read_bytes() == want
