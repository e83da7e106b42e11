"""Filesystem safety of the command line and API: --force replaces only what the run
writes, outputs overlapping the input are refused, FIFOs and devices are written into and
never replaced, SIGTERM/SIGHUP/SIGKILL leave nothing behind for long, an input that shrinks
while read fails cleanly (no SIGBUS), and checkpoint directories keep links inside, refuse
links outside, special files and escaping shard names."""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import entropykit
from entropykit import CorruptDataError
from entropykit.cli import main
from entropykit.container import checkpoint

ROOT = Path(entropykit.__file__).resolve().parents[1]  # the entropykit under test


_CHANGED = r"file changed (or truncated )?while being read"  # either check may fire first

def _run(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _tree(d: Path) -> dict[str, bytes | str]:
    """Relative path -> bytes of each file, or the text of each symbolic link."""
    out: dict[str, bytes | str] = {}
    for top, dirs, names in os.walk(d):
        for n in dirs + names:
            p = Path(top) / n
            if p.is_symlink():
                out[str(p.relative_to(d))] = os.readlink(p)
            elif p.is_file():
                out[str(p.relative_to(d))] = p.read_bytes()
    return out


def _temps(*dirs: Path) -> list[str]:
    return [str(p) for d in dirs for p in d.rglob("*.ek-tmp")]


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    d = tmp_path / "ck"
    (d / "sub").mkdir(parents=True)
    save_file({"a": torch.randn(64, 32).to(torch.bfloat16)}, d / "model.safetensors")
    save_file({"b": torch.randn(100)}, d / "sub" / "extra.safetensors")
    (d / "config.json").write_text('{"model_type": "llama"}\n')
    return d


# 1. --force on a directory output replaces only what the run writes.

def test_force_into_an_existing_directory_keeps_every_other_file(
        ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    packed = tmp_path / "ck.ek"
    assert _run(capsys, "compress", ckpt, "-q")[0] == 0
    restore = tmp_path / "restore"
    (restore / "optimizer").mkdir(parents=True)
    (restore / "optimizer" / "state.pt").write_bytes(b"optimizer state")
    (restore / "train_log.txt").write_text("step 1\n")
    (restore / "config.json").write_text("old config")
    code, _, err = _run(capsys, "decompress", packed, "-o", restore, "-q")
    assert code == 2 and "output exists" in err and err.count("\n") == 1
    assert (restore / "config.json").read_text() == "old config"
    assert _run(capsys, "decompress", packed, "-o", restore, "-q", "--force")[0] == 0
    tree = _tree(restore)
    assert tree.pop("optimizer/state.pt") == b"optimizer state"
    assert tree.pop("train_log.txt") == b"step 1\n"
    assert tree == _tree(ckpt)  # every produced file replaced, byte for byte
    assert _temps(tmp_path) == []
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert _run(capsys, "compress", ckpt, "-o", other, "-q", "--force")[0] == 0
    assert (other / "notes.txt").read_text() == "mine"
    assert _tree(other) == {**_tree(packed), "notes.txt": b"mine"}


def test_force_into_a_directory_refuses_to_replace_a_non_file(
        ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    (out / "config.json").mkdir(parents=True)  # a directory where the run writes a file
    (out / "config.json" / "keep").write_text("k")
    (out / "model.safetensors").write_text("old")
    code, _, err = _run(capsys, "compress", ckpt, "-o", out, "-q", "--force")
    assert code == 2 and "config.json" in err and "refusing" in err
    assert _tree(out) == {"config.json/keep": b"k", "model.safetensors": b"old"}
    assert _temps(tmp_path) == []


def test_force_help_says_what_it_replaces(capsys: pytest.CaptureFixture[str]) -> None:
    for verb in ("compress", "decompress"):
        with pytest.raises(SystemExit):
            main([verb, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "only the files this run writes are replaced" in text
        assert "every other file in it is kept" in text


# 2. An output that equals, contains or lies inside the input is refused.

def test_output_overlapping_the_input_is_refused(
        ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inner = ckpt / "in"
    inner.mkdir()
    save_file({"x": torch.ones(8)}, inner / "m.safetensors")
    before = _tree(ckpt)
    for argv, what in [((inner, "-o", ckpt), "contain"), ((ckpt, "-o", ckpt), "overwrite"),
                       ((ckpt, "-o", ckpt / "sub" / "x"), "lie inside"),
                       ((inner / "m.safetensors", "-o", inner / "m.safetensors"), "overwrite"),
                       ((inner / "m.safetensors", "-o", ckpt), "contain")]:
        code, _, err = _run(capsys, "compress", *argv, "-q", "--force")
        assert code == 2 and f"output would {what} the input" in err, (argv, err)
        assert _tree(ckpt) == before
    link = tmp_path / "link.safetensors"
    link.symlink_to(inner / "m.safetensors")
    code, _, err = _run(capsys, "compress", inner / "m.safetensors", "-o", link, "--force")
    assert code == 2 and "overwrite the input" in err and link.is_symlink()
    assert _tree(ckpt) == before


# 3. FIFOs and character devices are written into, never replaced.

def _compressed_bytes(model: Path, tmp_path: Path) -> bytes:
    ref = tmp_path / "ref.ek"
    entropykit.compress_file(model, ref)
    data = ref.read_bytes()
    ref.unlink()
    return data


@pytest.mark.parametrize("force", [False, True])
def test_fifo_output_is_streamed_into(ckpt: Path, tmp_path: Path, force: bool,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    model = ckpt / "model.safetensors"
    want = _compressed_bytes(model, tmp_path)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    flags = ["--force"] if force else []
    code, _, err = _run(capsys, "compress", model, "-o", fifo, "-q", *flags)
    reader.join(30)
    assert code == 0, err
    assert got == [want] and stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "pipe"]


@pytest.fixture
def no_replacing_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the code under test does, never let it rename over a device node."""
    real = os.replace

    def guarded(src: object, dst: object, *a: object, **k: object) -> None:
        if os.path.exists(dst) and stat.S_ISCHR(os.stat(dst).st_mode):  # type: ignore[arg-type]
            raise AssertionError(f"tried to replace device {dst}")
        real(src, dst, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "replace", guarded)
    monkeypatch.setattr(os, "rename", guarded)


def test_dev_null_is_written_into(ckpt: Path, tmp_path: Path, no_replacing_devices: None,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    null = Path(os.devnull)
    for force in ([], ["--force"]):
        code, out, err = _run(capsys, "compress", ckpt / "model.safetensors", "-o", null,
                              "-q", *force)
        assert code == 0 and err == "" and out == ""  # -q: nothing on success
        assert stat.S_ISCHR(os.lstat(null).st_mode)
    code, _, err = _run(capsys, "compress", ckpt, "-o", null, "-q", "--force")
    assert code == 2 and "not a directory" in err and stat.S_ISCHR(os.lstat(null).st_mode)
    (tmp_path / "adir").mkdir()
    code, _, err = _run(capsys, "compress", ckpt / "model.safetensors", "-o", tmp_path / "adir",
                        "-q", "--force")
    assert code == 2 and "not a regular file (a directory)" in err
    assert _temps(tmp_path, null.parent) == []


# 4. Signals: SIGTERM and SIGHUP like SIGINT; a SIGKILLed run's temporaries removed later.

# Each child run starts as from a terminal: a parent under nohup passes SIGHUP ignored,
# and the command line keeps an ignored SIGHUP ignored (nohup's choice).
_FROM_TERMINAL = """
import signal
signal.signal(signal.SIGHUP, signal.SIG_DFL)
"""

_SLOW_RUN = _FROM_TERMINAL + """
import sys, time
from pathlib import Path
import entropykit.cli as cli
ready = Path(sys.argv[1])

def hook(done, total):
    ready.touch()
    time.sleep(0.05)

class Bar:
    def __call__(self, done, total): hook(done, total)
    def close(self): pass

cli._progress = lambda args, label: Bar()
sys.exit(cli.main(sys.argv[2:]))
"""


def _cli(argv: list[object]) -> subprocess.CompletedProcess:
    """The command line in a child process (a hang fails the test instead of the run)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "entropykit.cli", *map(str, argv)],
                           capture_output=True, text=True, env=env, timeout=60)


def _slow_child(tmp_path: Path, *argv: object) -> tuple[subprocess.Popen, Path]:
    ready = tmp_path / "ready"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen([sys.executable, "-c", _SLOW_RUN, str(ready), *map(str, argv)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert p.poll() is None, p.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return p, ready


@pytest.fixture
def big(tmp_path: Path) -> Path:
    """A file of many small segments (the progress hook runs after each one)."""
    path = tmp_path / "big.safetensors"
    save_file({f"t{i}": torch.randn(256, 64).to(torch.bfloat16) for i in range(200)}, path)
    return path


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_remove_temporaries(big: Path, ckpt: Path, tmp_path: Path,
                                               sig: signal.Signals) -> None:
    (ckpt / "sub" / "big.safetensors").write_bytes(big.read_bytes())
    for src, out in ((big, tmp_path / "o.ek"), (ckpt, tmp_path / "dir.ek")):
        listing = sorted(os.listdir(tmp_path))
        p, ready = _slow_child(tmp_path, "compress", src, "-o", out, "--threads", "1")
        assert _temps(tmp_path)  # mid-run: the temporary exists
        p.send_signal(sig)
        _, err = p.communicate(timeout=60)
        ready.unlink()
        assert p.returncode == 128 + sig, err  # stderr shows where a signal went
        assert err == f"entropykit: terminated by {sig.name}\n"
        assert sorted(os.listdir(tmp_path)) == listing and _temps(tmp_path) == []


# The handler's raise lost where the main thread was when the signal came: inside a
# finalizer (printed as "Exception ignored" and dropped), or turned into another error (as
# a C extension may do). The handler ignores later signals, so only its record stops the
# run: at the next segment or file, or ("at the end") before the output is renamed.
_LOST_RUN = _FROM_TERMINAL + """
import os, signal, sys
import entropykit.cli as cli
how, sig = sys.argv[1], int(sys.argv[2])
sent = []

def signalled():
    os.kill(os.getpid(), sig)
    while signal.getsignal(sig) is not signal.SIG_IGN:  # until the handler has run
        pass

class Finalized:
    def __del__(self):
        signalled()

class Bar:
    def __call__(self, done, total):
        if sent or (how.endswith("at the end") and done < total):
            return
        sent.append(True)
        if how.startswith("finalizer"):
            Finalized()
        else:
            try:
                signalled()
            except cli._Signalled as e:
                raise ValueError("an extension's own error") from e
    def start_file(self, name, size): pass
    def close(self): pass

cli._progress = lambda args, label: Bar()
sys.exit(cli.main(sys.argv[3:]))
"""


@pytest.mark.parametrize(("how", "sig", "directory"), [
    ("finalizer", signal.SIGHUP, False), ("finalizer", signal.SIGTERM, True),
    ("finalizer at the end", signal.SIGHUP, False),
    ("finalizer at the end", signal.SIGTERM, True), ("error", signal.SIGHUP, False)])
def test_a_signal_whose_raise_is_lost_still_stops_the_run(
        big: Path, ckpt: Path, tmp_path: Path, how: str, sig: signal.Signals,
        directory: bool) -> None:
    src, out = (ckpt, tmp_path / "dir.ek") if directory else (big, tmp_path / "o.ek")
    listing = sorted(os.listdir(tmp_path))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", _LOST_RUN, how, str(int(sig)), "compress",
                        str(src), "-o", str(out), "--threads", "1"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 128 + sig, p.stderr
    assert p.stderr == f"entropykit: terminated by {sig.name}\n"
    assert sorted(os.listdir(tmp_path)) == listing and _temps(tmp_path) == []


def test_sigkilled_run_temporaries_removed_by_the_next_run(
        big: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "o.ek"
    p, _ = _slow_child(tmp_path, "compress", big, "-o", out, "--threads", "1")
    p.kill()
    p.communicate(timeout=60)
    (left,) = _temps(tmp_path)
    old = time.time() - 3600  # well past the age a stale temporary must have
    os.utime(left, (old, old))
    # Another run's temporaries: one too young, one old but locked (a run still writing),
    # one of another output; all kept.
    young = tmp_path / ".o.ek.abcdefgh.ek-tmp"
    young.write_bytes(b"y")
    held = tmp_path / ".o.ek.zzzzzzzz.ek-tmp"
    held.write_bytes(b"h")
    foreign = tmp_path / ".other.ek.abcdefgh.ek-tmp"
    foreign.write_bytes(b"f")
    for q in (held, foreign):
        os.utime(q, (old, old))
    with open(held, "rb") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        assert _run(capsys, "compress", big, "-o", out, "-q")[0] == 0
    assert not os.path.exists(left)
    assert young.exists() and held.exists() and foreign.exists()
    assert _run(capsys, "verify", out, "--against", big, "-q")[0] == 0


def test_info_and_verify_never_read_temporaries(ckpt: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    packed = tmp_path / "ck.ek"
    assert _run(capsys, "compress", ckpt, "-o", packed, "-q")[0] == 0
    stale = packed / ".ck.ek.abcdefgh.ek-tmp"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half-written garbage")
    code, out, err = _run(capsys, "verify", packed, "--against", ckpt)
    assert code == 0 and "OK" in out
    assert err == f"entropykit: warning: {packed}: skipped entropykit temporaries: " \
                  f"{stale.name}\n"
    code, out, _ = _run(capsys, "info", packed)
    assert code == 0 and out.count("entropykit record v3") == 2


# 5. An input that shrinks while read: one line, exit 1, no output, no SIGBUS.

_SHRINK_RUN = """
import functools, os, sys
import entropykit.cli as cli
from entropykit.container import files
src = sys.argv[1]

class Bar:
    def __call__(self, done, total):
        os.truncate(src, 4096)  # from "another program": the input shrinks mid-run
    def close(self): pass

cli._progress = lambda args, label: Bar()
files.compress_file = functools.partial(files.compress_file, segment_bytes=1 << 16)
sys.exit(cli.main(["compress", src, "-o", sys.argv[2], "--threads", "1"]))
"""


def test_input_shrinking_mid_run_fails_cleanly(tmp_path: Path) -> None:
    src = tmp_path / "m.safetensors"
    save_file({"w": torch.randn(1024, 1024).to(torch.bfloat16)}, src)
    out = tmp_path / "m.ek"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", _SHRINK_RUN, str(src), str(out)],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1, (r.returncode, r.stderr)  # not -SIGBUS
    assert re.match(re.escape(f"entropykit: error: {src}: ") + _CHANGED, r.stderr), r.stderr
    assert r.stderr.count("\n") == 1
    assert sorted(os.listdir(tmp_path)) == ["m.safetensors"]


def test_input_changed_before_the_rename_leaves_no_output(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from entropykit.container import files, writer

    src = tmp_path / "m.safetensors"
    save_file({"w": torch.randn(64, 64)}, src)
    real = writer.write

    def write_then_grow(*a: object, **k: object) -> object:
        summary = real(*a, **k)
        with open(src, "ab") as f:
            f.write(b"appended")
        return summary

    monkeypatch.setattr(files, "write", write_then_grow)
    with pytest.raises(CorruptDataError, match="file changed while being read"):
        files.compress_file(src, tmp_path / "o.ek")
    assert sorted(os.listdir(tmp_path)) == ["m.safetensors"]


_SHRINK_READ = """
import os, sys
import entropykit.cli as cli
victim = sys.argv[1]

class Bar:
    def __call__(self, done, total):
        os.truncate(victim, 4096)  # from "another program": the file shrinks mid-run
    def close(self): pass

cli._progress = lambda args, label: Bar()
sys.exit(cli.main(sys.argv[2:]))
"""


@pytest.fixture
def packed(tmp_path: Path) -> tuple[Path, Path]:
    """(original, compressed) with many small segments, so the run reads after the cut."""
    from entropykit.container import files

    src = tmp_path / "m.safetensors"
    save_file({"w": torch.randn(1024, 1024).to(torch.bfloat16)}, src)
    ek = tmp_path / "m.ek.safetensors"
    files.compress_file(src, ek, threads=1, segment_bytes=1 << 16)
    return src, ek


@pytest.mark.parametrize("verb", ["decompress", "verify", "verify --against"])
def test_compressed_input_shrinking_mid_run_fails_cleanly(packed: tuple[Path, Path],
                                                          verb: str) -> None:
    """decompress / verify of a compressed file cut short while it is read (and the
    original that verify --against compares with): one line, exit 1, nothing written, not
    killed by SIGBUS (as when the file was mapped)."""
    src, ek = packed
    out = src.with_name("out.safetensors")
    victim, argv = {
        "decompress": (ek, ["decompress", ek, "-o", out]),
        "verify": (ek, ["verify", ek]),
        "verify --against": (src, ["verify", ek, "--against", src]),
    }[verb]
    before = sorted(os.listdir(src.parent))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", _SHRINK_READ, str(victim),
                        *map(str, argv), "--threads", "1"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1, (r.returncode, r.stderr)  # not -SIGBUS
    lead = f"entropykit: error: {ek}: " + (f"{src}: " if victim == src else "")
    # a short read or the end-of-run check, whichever the timing reaches first
    assert re.match(re.escape(lead) + _CHANGED, r.stderr), r.stderr
    assert r.stderr.count("\n") == 1
    assert sorted(os.listdir(src.parent)) == before


_SHRINK_LOAD = """
import os, sys
import entropykit
from entropykit.container.reader import Compressed
victim, how = sys.argv[1], sys.argv[2]

def cut_then(decode):
    def run(self, *a, **k):
        os.truncate(victim, 4096)  # from "another program": the file shrinks mid-run
        return decode(self, *a, **k)
    return run

Compressed.tensor = cut_then(Compressed.tensor)  # safe_open's
Compressed.tensors = cut_then(Compressed.tensors)  # load_file's
try:
    if how == "load_file":
        entropykit.load_file(victim, threads=1)
    else:
        with entropykit.safe_open(victim, framework="np", threads=1) as f:
            f.get_tensor("w")
except Exception as e:
    print(type(e).__name__, e, file=sys.stderr)
    sys.exit(1)
"""


@pytest.mark.parametrize("how", ["load_file", "safe_open"])
def test_load_of_a_file_shrinking_mid_run_raises(packed: tuple[Path, Path], how: str) -> None:
    """load_file / safe_open of a compressed file cut short while read: CorruptDataError
    with one line, not SIGBUS."""
    _, ek = packed
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", _SHRINK_LOAD, str(ek), how],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1, (r.returncode, r.stderr)  # not -SIGBUS
    assert r.stderr.startswith(f"CorruptDataError {ek}: file changed or truncated while "
                               "being read: it ends at byte 4096"), r.stderr
    assert r.stderr.count("\n") == 1


@pytest.mark.parametrize("verb", ["decompress", "verify", "load_file"])
def test_compressed_input_changed_before_the_end_fails(packed: tuple[Path, Path], verb: str,
                                                       monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    """A compressed file that changes after its last read but before the run ends (the
    output renamed, the tensors returned): CorruptDataError, no output."""
    from entropykit.container import files
    from entropykit.container.reader import Compressed

    src, ek = packed
    real = Compressed.tensors if verb == "load_file" else Compressed.verify
    name = "tensors" if verb == "load_file" else "verify"
    if verb == "decompress":
        real, name = Compressed.restore, "restore"

    def append() -> None:
        with open(ek, "ab") as f:
            f.write(b"appended")

    def then_append(*a: object, **k: object) -> object:
        got = real(*a, **k)
        if name == "tensors":  # a generator: the change comes after its last tensor
            def drained() -> Iterator[object]:
                yield from got
                append()
            return drained()
        append()
        return got

    monkeypatch.setattr(Compressed, name, then_append)
    before = sorted(os.listdir(src.parent))
    run = {"decompress": lambda: files.decompress_file(ek, src.with_name("o.safetensors")),
           "verify": lambda: files.verify_file(ek),
           "load_file": lambda: entropykit.load_file(ek)}[verb]
    with pytest.raises(CorruptDataError, match="file changed while being read"):
        run()
    assert sorted(os.listdir(src.parent)) == before


_VERIFY_RSS = """
import sys
from entropykit.container import files

def status(key):  # this process's own, in bytes (ru_maxrss is inherited across exec)
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith(key + ":")) << 10

files.verify_file(sys.argv[2], threads=2)  # warm: compiled code loaded, pools made
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak restarts from here
before = status("VmRSS")
files.verify_file(sys.argv[1], threads=2)
print(status("VmHWM") - before)
"""


def test_verify_holds_segments_not_the_file(tmp_path: Path) -> None:
    """verify reads a segment at a time: its peak memory grows by far less than the
    compressed file (a mapped file's touched pages all counted)."""
    from entropykit.container import files

    src, small = tmp_path / "m.safetensors", tmp_path / "s.safetensors"
    save_file({"w": torch.randn(6144, 4096).to(torch.bfloat16)}, src)
    save_file({"w": torch.randn(512, 512).to(torch.bfloat16)}, small)
    ek, ek_small = tmp_path / "m.ek", tmp_path / "s.ek"
    files.compress_file(src, ek, segment_bytes=1 << 20)
    files.compress_file(small, ek_small, segment_bytes=1 << 20)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", _VERIFY_RSS, str(ek), str(ek_small)],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) < ek.stat().st_size // 2, (int(r.stdout), ek.stat().st_size)


def test_info_reads_only_the_header(packed: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    """``info`` reads the header and nothing of the payloads, plain or compressed."""
    from entropykit.container import header as hdr
    from entropykit.container.source import FileBytes

    reads: list[tuple[int, int]] = []
    real = FileBytes.read

    def logged(self: FileBytes, offset: int, n: int) -> object:
        reads.append((offset, n))
        return real(self, offset, n)

    monkeypatch.setattr(FileBytes, "read", logged)
    for path in packed:
        reads.clear()
        assert _run(capsys, "info", path)[0] == 0
        end = hdr.parse_file(path.read_bytes()).data_start
        assert reads and max(o + n for o, n in reads) == end


def test_a_short_read_is_an_error_never_data(tmp_path: Path) -> None:
    from entropykit.container.source import FileBytes

    p = tmp_path / "f"
    p.write_bytes(bytes(range(200)))
    with FileBytes(p) as f:
        assert f.read(10, 5).tobytes() == bytes(range(10, 15))
        os.truncate(p, 100)
        assert f.read(90, 10).tobytes() == bytes(range(90, 100))
        with pytest.raises(CorruptDataError, match="truncated while being read: it ends at "
                                                   "byte 100, it had 200 bytes"):
            f.read(95, 10)
        with pytest.raises(CorruptDataError, match="outside the 200 bytes"):
            f.read(195, 10)  # past what the file had: refused before any read
        with pytest.raises(CorruptDataError, match="changed while being read"):
            f.check()


def test_non_regular_input_is_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "in.safetensors"
    os.mkfifo(fifo)
    r = _cli(["compress", fifo, "-o", tmp_path / "o.ek"])  # the old code hung here
    assert r.returncode == 1 and "not a regular file" in r.stderr
    assert sorted(os.listdir(tmp_path)) == ["in.safetensors"]


# 6. Checkpoint directories: links, special files, shard names, nothing to do.

def test_links_inside_are_kept_as_links(ckpt: Path, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    (ckpt / "tokenizer.json").symlink_to("sub/../config.json")
    (ckpt / "shared").symlink_to("sub")  # a directory
    (ckpt / "loop_a").symlink_to("loop_b")  # a loop: kept, never followed
    (ckpt / "loop_b").symlink_to("loop_a")
    (ckpt / "dangling").symlink_to("nothing-here")
    before = _tree(ckpt)
    code, out, err = _run(capsys, "compress", ckpt, "-o", tmp_path / "p")
    assert code == 0 and "2 files" in out and err == ""
    packed = _tree(tmp_path / "p")
    for link in ("tokenizer.json", "shared", "loop_a", "loop_b", "dangling"):
        assert (tmp_path / "p" / link).is_symlink() and packed[link] == before[link]
    assert _run(capsys, "verify", tmp_path / "p", "--against", ckpt, "-q")[0] == 0
    assert _run(capsys, "decompress", tmp_path / "p", "-o", tmp_path / "back", "-q")[0] == 0
    assert _tree(tmp_path / "back") == before


@pytest.mark.parametrize("target", ["../secret.txt", "ABS", "ABS_INSIDE"])
def test_link_outside_is_refused(ckpt: Path, tmp_path: Path, target: str,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("password")
    # An absolute link, even to a file inside, would point from the copy into the input.
    links = {"ABS": secret, "ABS_INSIDE": ckpt / "config.json"}
    (ckpt / "tokenizer.json").symlink_to(links.get(target, target))
    code, _, err = _run(capsys, "compress", ckpt, "-o", tmp_path / "p", "-q")
    assert code == 1 and f"{ckpt / 'tokenizer.json'}: symbolic link" in err
    assert "outside" in err and err.count("\n") == 1
    assert not (tmp_path / "p").exists() and _temps(tmp_path) == []


def test_link_to_a_directory_outside_is_refused(ckpt: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "elsewhere").mkdir()
    save_file({"z": torch.ones(4)}, tmp_path / "elsewhere" / "z.safetensors")
    (ckpt / "more").symlink_to(tmp_path / "elsewhere")
    code, _, err = _run(capsys, "compress", ckpt, "-o", tmp_path / "p", "-q")
    assert code == 1 and "more: symbolic link" in err
    assert not (tmp_path / "p").exists()


def test_special_files_are_refused_never_opened(ckpt: Path, tmp_path: Path) -> None:
    os.mkfifo(ckpt / "sub" / "pipe.safetensors")
    for verb in ("compress", "info", "verify"):
        argv = [verb, ckpt] + (["-o", tmp_path / "p"] if verb == "compress" else [])
        r = _cli(argv)  # the old code hung here
        assert r.returncode == 1, (verb, r.stderr)
        assert "pipe.safetensors: not a regular file" in r.stderr
        assert r.stderr.count("\n") == 1
    assert sorted(os.listdir(tmp_path)) == ["ck"]


@pytest.mark.parametrize("shard", ["../outside.safetensors", "ABS",
                                   "sub/../../outside.safetensors"])
def test_shard_names_outside_are_refused(ckpt: Path, tmp_path: Path, shard: str,
                                         capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    outside = tmp_path / "outside.safetensors"
    save_file({"o": torch.ones(4)}, outside)
    name = str(outside) if shard == "ABS" else shard
    (ckpt / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model.safetensors", "o": name}}))
    probed: list[str] = []
    real = Path.is_file
    monkeypatch.setattr(Path, "is_file", lambda p: (probed.append(str(p)), real(p))[1])
    for argv in (["compress", ckpt, "-o", tmp_path / "p"], ["info", ckpt]):
        code, _, err = _run(capsys, *argv)
        assert code == 1 and f"shard {name} lies outside" in err and err.count("\n") == 1
    assert not any("outside" in p for p in probed)
    assert not (tmp_path / "p").exists()


def test_nothing_to_compress_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                     ) -> None:
    d = tmp_path / "d"
    d.mkdir()
    (d / "config.json").write_text("{}")
    for argv in (["compress", d], ["verify", d], ["decompress", d, "-o", tmp_path / "r"],
                 ["info", d]):
        code, out, err = _run(capsys, *argv)
        assert code == 1 and "no *.safetensors files" in err and out == ""
    assert sorted(os.listdir(tmp_path)) == ["d"]


def test_scan_classifies_every_entry(ckpt: Path) -> None:
    (ckpt / "l").symlink_to("config.json")
    (ckpt / ".x.abcdefgh.ek-tmp").write_bytes(b"t")
    tree = checkpoint.scan(ckpt)
    assert tree.safetensors == [Path("model.safetensors"), Path("sub/extra.safetensors")]
    assert tree.other == [Path("config.json")] and tree.links == [Path("l")]
    assert tree.skipped == [Path(".x.abcdefgh.ek-tmp")]
    assert checkpoint.walk(ckpt) == (tree.safetensors, tree.other)


def test_compress_input_reads_like_an_array(tmp_path: Path) -> None:
    """What compress reads a tensor through (pread, never a mapping) slices like the
    array of its bytes."""
    from entropykit.container import files

    src = tmp_path / "m.safetensors"
    save_file({"a": torch.arange(10, dtype=torch.int32), "b": torch.ones(3)}, src)
    blob = src.read_bytes()
    with files.opened(src) as f:
        s = files._read_source(f)
        for e in s.header.entries:
            span, want = s.read(e), blob[s.header.data_start + e.begin:][: e.nbytes]
            assert span.size == len(span) == e.nbytes
            for sl in (slice(None), slice(3, 7), slice(-4, None), slice(5, 2)):
                assert span[sl].tobytes() == want[sl]
