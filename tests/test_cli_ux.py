"""The command line as zstd users expect it, each behaviour run as a subprocess (exit code,
stdout and stderr): several inputs, ``-`` and ``-c``, ``-q``/``-v``, ``--rm``, a closed
pipe, names that round-trip, the summary's direction, no temporary names in errors, a
directory holding a compressed file, ``analyze``'s width, ``--json`` and legends; plus
``save_file``'s options and the progress line, in process."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import save_file

import entropykit as ek
from entropykit import _jit
from entropykit.container import checkpoint, files
from entropykit.container.progress import Bar


def _ek(*argv: object, stdin: bytes | None = None, cwd: Path | None = None
        ) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "entropykit.cli", *map(str, argv)],
                          input=stdin, capture_output=True, cwd=cwd, timeout=300)


def _text(b: bytes) -> str:
    return b.decode("utf-8", "replace")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("models")
    g = torch.Generator().manual_seed(0)
    for name in ("a", "b"):
        w = (torch.randn(96, 128, generator=g) * 0.02).to(torch.bfloat16)
        save_file({"w": w, "b": torch.randn(128, generator=g)}, d / f"{name}.safetensors",
                  metadata={"format": "pt"})
    return d


@pytest.fixture()
def work(models: Path, tmp_path: Path) -> Path:
    for p in models.iterdir():
        (tmp_path / p.name).write_bytes(p.read_bytes())
    return tmp_path


# --- several inputs, standard input and output --------------------------------------


def test_several_inputs_each_get_their_default_name(work: Path) -> None:
    r = _ek("compress", work / "a.safetensors", work / "b.safetensors", "-q")
    assert (r.returncode, r.stdout, r.stderr) == (0, b"", b"")
    for n in ("a", "b"):
        assert ek.load_file(work / f"{n}.ek.safetensors").keys() == {"w", "b"}


def test_a_failing_input_does_not_stop_the_others(work: Path) -> None:
    r = _ek("compress", work / "missing.safetensors", work / "b.safetensors", "-q")
    assert r.returncode == 2 and r.stdout == b""
    assert _text(r.stderr) == f"entropykit: error: {work}/missing.safetensors: no such file " \
                              f"or directory\n"
    assert (work / "b.ek.safetensors").exists()


def test_several_inputs_with_one_output_are_refused(work: Path) -> None:
    r = _ek("compress", work / "a.safetensors", work / "b.safetensors", "-o", work / "x")
    assert r.returncode == 2 and b"-o/-c name one output" in r.stderr
    assert not (work / "x").exists() and not (work / "a.ek.safetensors").exists()


def test_stdin_to_file_and_file_to_stdout(work: Path) -> None:
    original = (work / "a.safetensors").read_bytes()
    r = _ek("compress", "-", "-o", work / "x.ek.safetensors", "-q", stdin=original)
    assert (r.returncode, r.stdout, r.stderr) == (0, b"", b"")
    r = _ek("decompress", work / "x.ek.safetensors", "-o", "-")
    assert r.returncode == 0 and r.stdout == original
    # The summary moved to stderr: stdout carries the data only.
    assert b"decompress " in r.stderr and b"-> <stdout>" in r.stderr
    r = _ek("decompress", work / "x.ek.safetensors", "-c", "-q")
    assert (r.returncode, r.stdout, r.stderr) == (0, original, b"")


def test_stdin_to_stdout_both_ways(work: Path) -> None:
    original = (work / "a.safetensors").read_bytes()
    packed = _ek("compress", "-", "-q", stdin=original)
    assert packed.returncode == 0 and packed.stderr == b""
    assert packed.stdout == (_ek("compress", work / "a.safetensors", "-c", "-q")).stdout
    back = _ek("decompress", "-", "-q", stdin=packed.stdout)
    assert (back.returncode, back.stdout, back.stderr) == (0, original, b"")


def test_stdin_errors_name_stdin_never_the_spool(work: Path) -> None:
    r = _ek("compress", "-", "-o", work / "x", stdin=b"not a safetensors file at all")
    assert r.returncode == 1
    assert _text(r.stderr).startswith("entropykit: error: <stdin>: not a valid safetensors")
    assert b"/proc/self" not in r.stderr and b"/tmp" not in r.stderr
    assert not (work / "x").exists()


def test_binary_data_is_not_written_to_a_terminal(work: Path) -> None:
    controller, terminal = os.openpty()
    try:
        r = subprocess.run([sys.executable, "-m", "entropykit.cli", "compress",
                            work / "a.safetensors", "-c"], stdout=terminal,
                           stderr=subprocess.PIPE, timeout=300)
    finally:
        os.close(terminal)
        os.close(controller)
    assert r.returncode == 2 and b"refusing to write binary data to a terminal" in r.stderr


# --- quiet, verbose, --rm --------------------------------------------------------------


def test_quiet_prints_nothing_on_success_and_errors_still(work: Path) -> None:
    for verb, path in (("compress", "a.safetensors"), ("verify", "a.ek.safetensors"),
                       ("decompress", "a.ek.safetensors")):
        extra = ("-o", work / "back.safetensors") if verb == "decompress" else ()
        r = _ek(verb, work / path, *extra, "-q")
        assert (r.returncode, r.stdout, r.stderr) == (0, b"", b""), verb
    r = _ek("compress", work / "a.safetensors", "-q")  # the output exists now
    assert r.returncode == 2 and r.stdout == b"" and b"output exists" in r.stderr


def test_verbose_lists_a_directorys_files(work: Path) -> None:
    d = work / "ckpt"
    d.mkdir()
    for n in ("a", "b"):
        (work / f"{n}.safetensors").rename(d / f"{n}.safetensors")
    r = _ek("compress", d, "-v")
    assert r.returncode == 0
    lines = _text(r.stdout).splitlines()
    assert [x.split()[0] for x in lines[-4:]] == ["file", "-------------", "a.safetensors",
                                                   "b.safetensors"]


def test_rm_removes_the_input_after_a_verified_success(work: Path) -> None:
    original = (work / "a.safetensors").read_bytes()
    r = _ek("compress", work / "a.safetensors", "--rm", "-v")
    assert r.returncode == 0 and not (work / "a.safetensors").exists()
    assert b"removed" in r.stderr and b"verified against it" in r.stderr
    r = _ek("decompress", work / "a.ek.safetensors", "--rm", "-q")
    assert (r.returncode, r.stdout, r.stderr) == (0, b"", b"")
    assert not (work / "a.ek.safetensors").exists()
    assert (work / "a.safetensors").read_bytes() == original


def test_rm_is_refused_where_nothing_could_be_checked(work: Path) -> None:
    for argv in (["-c"], ["--keep"]):
        r = _ek("compress", work / "a.safetensors", "--rm", *argv, "-q")
        assert r.returncode == 2 and (work / "a.safetensors").exists(), argv
    r = _ek("compress", work, "--rm", "-q")
    assert r.returncode == 2 and b"--rm removes files only" in r.stderr


def test_rm_keeps_the_input_when_the_run_fails(work: Path) -> None:
    (work / "a.ek.safetensors").write_bytes(b"in the way")
    r = _ek("compress", work / "a.safetensors", "--rm", "-q")
    assert r.returncode == 2 and (work / "a.safetensors").exists()


# --- a reader that leaves ---------------------------------------------------------------


def test_info_into_a_closed_pipe_is_quiet(tmp_path: Path) -> None:
    # Enough tensors that the listing overflows the pipe's buffer.
    many = {f"layer.{i}.weight": np.zeros(2, np.float32) for i in range(4000)}
    save_numpy(many, tmp_path / "many.safetensors")
    p = subprocess.Popen([sys.executable, "-m", "entropykit.cli", "info",
                          tmp_path / "many.safetensors"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None and p.stderr is not None
    assert p.stdout.readline().startswith(b"tensor")
    p.stdout.close()  # like `| head -1`
    err = p.stderr.read()
    assert p.wait(timeout=300) == 141 and err == b""


# --- names, the summary, errors ---------------------------------------------------------


@pytest.mark.parametrize("name, packed, back", [
    ("weights.bin", "weights.bin.ek.safetensors", "weights.bin"),
    ("model.safetensors", "model.ek.safetensors", "model.safetensors"),
    ("model.fp16.safetensors", "model.fp16.ek.safetensors", "model.fp16.safetensors"),
    ("llama-3.1-8b.safetensors", "llama-3.1-8b.ek.safetensors", "llama-3.1-8b.safetensors"),
])
def test_default_names_round_trip(work: Path, name: str, packed: str, back: str) -> None:
    original = (work / "a.safetensors").read_bytes()
    (work / "a.safetensors").rename(work / name)
    r = _ek("compress", work / name, "-q")
    assert (r.returncode, r.stderr) == (0, b"")
    assert (work / packed).exists()
    (work / name).unlink()
    assert _ek("decompress", work / packed, "-q").returncode == 0
    assert (work / back).read_bytes() == original


def test_a_name_that_does_not_round_trip_is_warned_about(work: Path) -> None:
    (work / "a.safetensors").rename(work / "weights")
    r = _ek("compress", work / "weights", "-q")
    assert r.returncode == 0 and _text(r.stderr) == (
        f"entropykit: warning: {work}/weights.ek.safetensors: decompresses to "
        f"weights.safetensors by default, not weights (give -o then)\n")


def test_default_output_rules(tmp_path: Path) -> None:
    name = lambda s, c: files.default_output(tmp_path / s, c).name  # noqa: E731
    assert name("w.pt", True) == "w.pt.ek.safetensors"
    assert name("w.pt.ek.safetensors", False) == "w.pt"
    assert name("w.ek.safetensors", False) == "w.safetensors"
    assert name("w.safetensors", False) == "w.restored.safetensors"
    assert name(".ek.safetensors", False) == ".ek.restored.safetensors"


def test_decompress_summary_reads_in_then_out(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(2)
    save_file({"w": (torch.randn(1024, 1024, generator=g) * 0.02).to(torch.bfloat16)},
              tmp_path / "big.safetensors")
    assert _ek("compress", tmp_path / "big.safetensors", "-q").returncode == 0
    r = _ek("decompress", tmp_path / "big.ek.safetensors", "-o", tmp_path / "back")
    assert r.returncode == 0
    head, _, bf16 = _text(r.stdout).splitlines()[:3]
    assert head.split()[:7] == ["dtype", "tensors", "values", "MB", "in", "MB", "out"]
    mb_in, mb_out = map(float, bf16.split()[3:5])
    assert mb_out == 2.1 and mb_in < 0.8 * mb_out  # compressed in, original out


def test_errors_never_name_temporaries(work: Path) -> None:
    (work / "outdir").mkdir()
    r = _ek("compress", work / "a.safetensors", "-o", work / "outdir", "--force")
    assert r.returncode == 2 and b".ek-tmp" not in r.stderr
    assert _text(r.stderr).startswith(f"entropykit: error: {work}/outdir: output exists")


def test_a_directory_with_a_compressed_file_compresses_the_rest(work: Path) -> None:
    d = work / "ckpt"
    d.mkdir()
    (work / "a.safetensors").rename(d / "a.safetensors")
    assert _ek("compress", work / "b.safetensors", "-o", d / "b.ek.safetensors",
               "-q").returncode == 0
    r = _ek("compress", d, "-q")
    assert r.returncode == 0 and r.stdout == b""
    assert _text(r.stderr) == (f"entropykit: warning: {d}: already entropykit-compressed, "
                               f"copied unchanged: b.ek.safetensors\n")
    out = work / "ckpt.ek"
    assert (out / "b.ek.safetensors").read_bytes() == (d / "b.ek.safetensors").read_bytes()
    assert files.is_compressed_file(out / "a.safetensors")


# --- save_file --------------------------------------------------------------------------


def test_save_file_refuses_to_overwrite_without_force(tmp_path: Path) -> None:
    p = tmp_path / "x.safetensors"
    ek.save_file({"a": torch.ones(3)}, p)
    with pytest.raises(FileExistsError, match="output exists"):
        ek.save_file({"a": torch.zeros(3)}, p)
    assert ek.load_file(p)["a"].equal(torch.ones(3))
    ek.save_file({"a": torch.zeros(3)}, p, force=True)
    assert ek.load_file(p)["a"].equal(torch.zeros(3))


def test_save_file_fast_and_gpu_target(tmp_path: Path) -> None:
    t = {"w": (torch.randn(64, 64) * 0.02).to(torch.bfloat16)}
    for i, kw in enumerate(({"fast": True}, {"target": "gpu"})):
        p = tmp_path / f"{i}.safetensors"
        ek.save_file(t, p, **kw)
        assert ek.load_file(p)["w"].equal(t["w"])
        assert p.read_bytes() == _ek_compressed(t, tmp_path, **kw)
    with pytest.raises(ValueError, match="target"):
        ek.save_file(t, tmp_path / "bad.safetensors", target="tpu")


def _ek_compressed(t: dict, tmp_path: Path, **kw: object) -> bytes:
    save_file(t, tmp_path / "plain.safetensors")
    ek.compress_file(tmp_path / "plain.safetensors", tmp_path / "ref.safetensors", force=True,
                     **kw)
    return (tmp_path / "ref.safetensors").read_bytes()


def test_save_file_refuses_tied_tensors(tmp_path: Path) -> None:
    w = torch.randn(8, 4)
    for tied in ({"embed": w, "lm_head": w}, {"all": w, "half": w[4:]},
                 {"t": w, "view": w.t()}):
        with pytest.raises(ValueError, match="share memory"):
            ek.save_file(tied, tmp_path / "x.safetensors")
        assert not (tmp_path / "x.safetensors").exists()
    ek.save_file({"top": w[:4], "bottom": w[4:]}, tmp_path / "x.safetensors")  # disjoint


# --- progress ---------------------------------------------------------------------------


def test_progress_rate_and_eta_start_at_the_first_report() -> None:
    s = io.StringIO()
    bar = Bar("compress d", stream=s, interval=0)
    assert "MB/s" not in bar.line(0, 100, 5.0)
    # The first segment done at t=10 s (compiling before it), nothing compiled since.
    bar._first = (10.0, 10_000_000, _jit.compile_seconds())
    line = bar.line(30_000_000, 110_000_000, 12.0)
    assert "10 MB/s" in line and "ETA 0:08" in line


def test_progress_rate_leaves_out_compiling_after_the_first_report(
        monkeypatch: pytest.MonkeyPatch) -> None:
    s = io.StringIO()
    bar = Bar("compress d", stream=s, interval=0)
    bar(10_000_000, 110_000_000)
    t0 = bar._first[0]
    compiled = _jit.compile_seconds()
    # A kernel compiled for 100 s meanwhile (a dtype met later): 2 s of work remain.
    monkeypatch.setattr(_jit, "compile_seconds", lambda: compiled + 100.0)
    line = bar.line(30_000_000, 110_000_000, t0 + 102.0)
    assert "10 MB/s" in line and "ETA 0:08" in line


def test_progress_of_a_directory_names_each_file(models: Path, tmp_path: Path) -> None:
    s = io.StringIO()
    bar = Bar("compress models", stream=s, interval=0)
    checkpoint.compress_dir(models, tmp_path / "out", progress=bar, threads=1)
    bar.close()
    text = s.getvalue()
    assert "[file 1 a.safetensors" in text and "[file 2 b.safetensors 100%]" in text
    assert text.rstrip("\n").split("\r")[-1].startswith("compress models  100%")


def test_progress_line_on_a_terminal_for_a_directory(models: Path, tmp_path: Path) -> None:
    # The line is drawn only where stderr is a terminal: give the command one.
    controller, terminal = os.openpty()
    try:
        p = subprocess.Popen([sys.executable, "-m", "entropykit.cli", "compress", models,
                              "-o", tmp_path / "out"], stdout=subprocess.PIPE,
                             stderr=terminal)
        os.close(terminal)
        seen = b""
        while True:
            try:
                chunk = os.read(controller, 1 << 16)
            except OSError:  # the terminal's other side closed
                break
            if not chunk:
                break
            seen += chunk
        assert p.wait(timeout=300) == 0
    finally:
        os.close(controller)
    text = _text(seen)
    last = text.rstrip("\r\n").split("\r")[-1]
    assert last.startswith(f"compress {models.name}  100%") and "MB/s  ETA 0:00" in last
    assert "[file 1 a.safetensors" in text and "[file 2 b.safetensors 100%]" in last
    assert b"compress " in p.stdout.read()  # the summary still goes to stdout


# --- analyze ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def long_names(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("an") / "m.safetensors"
    g = torch.Generator().manual_seed(1)
    save_file({f"model.language_model.layers.{i}.self_attn.q_proj.weight_packed_blocks":
               torch.randn(64, 64, generator=g).to(torch.bfloat16) for i in range(3)}, p)
    return p


def test_analyze_table_fits_100_columns_unless_wide(long_names: Path) -> None:
    r = _ek("analyze", long_names)
    assert r.returncode == 0
    lines = _text(r.stdout).splitlines()
    assert max(map(len, lines)) <= 100 and "exponent" not in _text(r.stdout)
    wide = _ek("analyze", long_names, "--wide")
    assert wide.returncode == 0 and max(map(len, _text(wide.stdout).splitlines())) > 100
    assert "sign_mantissa" in _text(wide.stdout)


def test_analyze_json_refuses_to_overwrite(long_names: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    out.write_text("mine")
    r = _ek("analyze", long_names, "--json", out, "-q")
    assert r.returncode == 2 and r.stdout == b"" and b"output exists" in r.stderr
    assert out.read_text() == "mine"
    r = _ek("analyze", long_names, "--json", out, "--force", "-q")
    assert (r.returncode, r.stdout, r.stderr) == (0, b"", b"")  # -q: nothing on success
    assert out.read_text().startswith("{")
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temporary left


def test_analyze_legends_lie_outside_every_panel(long_names: Path) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from entropykit.analysis import analyze
    from entropykit.analysis.plots import figure

    fig = figure(analyze(long_names))
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    panels = [ax.get_window_extent(renderer) for ax in fig.axes]
    for ax in fig.axes:
        legend = ax.get_legend()
        assert legend is not None
        box = legend.get_window_extent(renderer)
        assert not any(box.overlaps(p) for p in panels)
        assert 0 <= box.x0 and box.x1 <= fig.bbox.width  # inside the figure


def test_decompress_into_a_closed_pipe_is_quiet(work: Path) -> None:
    g = torch.Generator().manual_seed(3)
    save_file({"w": torch.randn(512, 512, generator=g)}, work / "big.safetensors")
    assert _ek("compress", work / "big.safetensors", "-q").returncode == 0
    p = subprocess.Popen([sys.executable, "-m", "entropykit.cli", "decompress",
                          work / "big.ek.safetensors", "-c", "-q"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None and p.stderr is not None
    assert len(p.stdout.read(10)) == 10
    p.stdout.close()  # like `| head -c 10`
    err = p.stderr.read()
    assert p.wait(timeout=300) == 141 and err == b""


def test_error_lines_show_outputs_not_their_temporaries() -> None:
    from entropykit import cli

    e = OSError(28, "No space left on device", "/data/out/.model.ek.safetensors.k3j_x9a1.ek-tmp")
    assert cli._one_line(e) == "/data/out/model.ek.safetensors: No space left on device"
    assert cli._one_line(ValueError(".d.ek.abcdefgh.ek-tmp/x: bad")) == "d.ek/x: bad"
