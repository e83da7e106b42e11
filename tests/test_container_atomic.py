"""Atomic output with a background writer and writeback (container/_atomic.py): the bytes
written through ``output_file`` (writes, seeks back, truncation) are exactly the file that
appears, with a small or large write queue; writeback runs while writing; a failing write,
writeback or block raises its error and leaves no output."""

from __future__ import annotations

import os
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


def test_a_file_below_sync_bytes_starts_no_writeback_thread(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    """Only the writer thread starts for a small file (a thread's start and join cost
    more than writing it); a file past ``SYNC_BYTES`` starts the writeback thread once."""
    import threading

    started = []
    real = threading.Thread

    class Counted(real):
        def start(self) -> None:
            started.append(self.name)
            super().start()

    monkeypatch.setattr(_atomic.threading, "Thread", Counted)
    monkeypatch.setattr(_atomic, "SYNC_BYTES", 1000)
    with _atomic.output_file(tmp_path / "small.bin") as out:
        out.write(b"x" * 999)
    assert started == ["entropykit-writer"]
    started.clear()
    with _atomic.output_file(tmp_path / "large.bin") as out:
        for _ in range(10):
            out.write(b"y" * 1000)
            out.flush()  # each write reaches the writer thread: ten kicks
    assert sorted(started) == ["entropykit-writeback", "entropykit-writer"]
    assert (tmp_path / "small.bin").read_bytes() == b"x" * 999
    assert (tmp_path / "large.bin").read_bytes() == b"y" * 10_000


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
