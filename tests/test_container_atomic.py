"""Atomic output with background writeback (container/_atomic.py): the bytes written
through ``output_file`` (writes, seeks back, truncation) are exactly the file that
appears; writeback runs while writing; a failing writeback or block leaves no output."""

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


def test_writes_seeks_and_truncation_give_the_exact_file(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_atomic, "SYNC_BYTES", 1000)
    synced = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(fd), real(fd)))
    blob = np.random.default_rng(0).integers(0, 256, 10_000, dtype=np.uint8).tobytes()
    dst = tmp_path / "out.bin"
    with _atomic.output_file(dst) as out:
        _write_pattern(out, blob)
        assert not dst.exists()
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
