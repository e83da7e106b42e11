"""The ``entropykit`` command: every verb, exit codes (0 ok, 1 bad data, 2 bad usage),
one-line errors naming the file, no partial output, the summary table, --help."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_container import all_dtypes, write_raw

from entropykit.cli import main
from entropykit.container.progress import Bar


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "m.safetensors"
    save_file(all_dtypes(), path, metadata={"format": "pt"})
    return path


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_compress_verify_decompress(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = model.read_bytes()
    code, out, err = _run(capsys, "compress", model, "--keep", "--threads", "2")
    packed = model.with_name("m.ek.safetensors")
    assert code == 0 and err == "" and packed.exists()
    header = out.splitlines()[0].split()
    assert header == ["dtype", "tensors", "values", "MB", "in", "MB", "out", "ratio",
                      "bits/value", "order-0", "bound"]
    assert "BF16" in out and "total" in out and "MB/s" in out
    ratio = packed.stat().st_size / model.stat().st_size
    assert f"ratio {ratio:.4f}" in out
    assert model.read_bytes() == before  # --keep or not, the input is never touched

    code, out, _ = _run(capsys, "verify", packed, "--against", model)
    assert code == 0 and "restores" in out and "byte for byte" in out
    code, out, _ = _run(capsys, "verify", packed)
    assert code == 0 and "every checksum matches" in out

    model.rename(model.with_name("orig.safetensors"))
    code, out, _ = _run(capsys, "decompress", packed)
    assert code == 0 and model.read_bytes() == before


def test_fast_flag(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import entropykit

    code, _, err = _run(capsys, "compress", model, "--fast", "-o", tmp_path / "f.ek")
    assert code == 0 and err == ""
    entropykit.compress_file(model, tmp_path / "api.ek", fast=True)
    entropykit.compress_file(model, tmp_path / "slow.ek")
    fast = (tmp_path / "f.ek").read_bytes()
    assert fast == (tmp_path / "api.ek").read_bytes() != (tmp_path / "slow.ek").read_bytes()
    code, _, _ = _run(capsys, "decompress", tmp_path / "f.ek", "-o", tmp_path / "back")
    assert code == 0 and (tmp_path / "back").read_bytes() == model.read_bytes()


def test_refuses_to_overwrite(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = model.with_name("o.safetensors")
    out.write_bytes(b"precious")
    code, _, err = _run(capsys, "compress", model, "-o", out)
    assert code == 2 and err.count("\n") == 1 and "output exists" in err and str(out) in err
    assert out.read_bytes() == b"precious"
    assert _run(capsys, "compress", model, "-o", out, "--force")[0] == 0
    assert out.read_bytes() != b"precious"


def test_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "compress", tmp_path / "nope.safetensors")
    assert code == 2 and "nope.safetensors: no such file or directory" in err
    (tmp_path / "m.safetensors").write_bytes(b"x")
    code, _, err = _run(capsys, "compress", tmp_path / "m.safetensors", "-o",
                        tmp_path / "no" / "o.safetensors")
    assert code == 2 and f"output directory {tmp_path / 'no'} does not exist" in err
    for argv in (["frobnicate"], [], ["compress"], ["compress", "x", "--threads", "0"],
                 ["verify", "x", "--bogus"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
    capsys.readouterr()


@pytest.mark.parametrize("verb", ["compress", "decompress", "verify", "info", None])
def test_help(verb: str | None, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main([verb, "--help"] if verb else ["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith("usage: entropykit") and "exit codes" in out


def test_corrupt_input_exit_1_no_output(model: Path, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    packed = tmp_path / "p.safetensors"
    assert _run(capsys, "compress", model, "-o", packed)[0] == 0
    blob = bytearray(packed.read_bytes())
    blob[-100] ^= 0xFF
    packed.write_bytes(bytes(blob))
    listing = _files(tmp_path)
    for argv in (["decompress", packed, "-o", tmp_path / "out"], ["verify", packed]):
        code, out, err = _run(capsys, *argv)
        assert code == 1 and err.startswith(f"entropykit: error: {packed}: ")
        assert err.count("\n") == 1
    assert _files(tmp_path) == listing
    packed.write_bytes(bytes(blob[:1000]))
    code, _, err = _run(capsys, "decompress", packed, "-o", tmp_path / "out")
    assert code == 1 and "not a valid safetensors file" in err
    assert _files(tmp_path) == listing


def test_bad_inputs_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "notes.safetensors"
    text.write_text("just some text\n")
    code, _, err = _run(capsys, "compress", text)
    assert code == 1 and f"{text}: not a valid safetensors file" in err
    head = json.dumps({"z": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}).encode()
    c64 = write_raw(tmp_path / "c64.safetensors", head, bytes(8))
    code, _, err = _run(capsys, "compress", c64)
    assert code == 1 and f"{c64}: tensor 'z': unsupported dtype C64" in err
    code, _, err = _run(capsys, "info", text)
    assert code == 1 and str(text) in err
    assert _files(tmp_path) == ["c64.safetensors", "notes.safetensors"]


def test_verify_mismatch(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
                         ) -> None:
    packed = tmp_path / "p.safetensors"
    _run(capsys, "compress", model, "-o", packed)
    other = tmp_path / "other.safetensors"
    tensors = all_dtypes()
    tensors["w.bf16"] = tensors["w.bf16"].clone()
    tensors["w.bf16"][3, 3] += 1
    save_file(tensors, other, metadata={"format": "pt"})
    code, _, err = _run(capsys, "verify", packed, "--against", other)
    assert code == 1 and "differs from" in err and "at byte" in err
    code, _, err = _run(capsys, "verify", packed, "--against", tmp_path)
    assert code == 2 and "--against must be a file" in err


def test_directory_and_missing_shard(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                     ) -> None:
    d = tmp_path / "ckpt"
    d.mkdir()
    save_file({"a": torch.randn(100)}, d / "model-00001-of-00002.safetensors")
    save_file({"b": torch.randn(100)}, d / "model-00002-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                            "b": "model-00002-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    code, out, _ = _run(capsys, "compress", d)
    assert code == 0 and "2 files" in out
    assert _run(capsys, "verify", tmp_path / "ckpt.ek", "--against", d)[0] == 0
    code, out, _ = _run(capsys, "info", tmp_path / "ckpt.ek")
    assert code == 0 and out.count("entropykit record v3") == 2
    (d / "model-00002-of-00002.safetensors").unlink()
    code, _, err = _run(capsys, "compress", d, "-o", tmp_path / "again")
    assert code == 1 and err.count("\n") == 1
    assert "shard model-00002-of-00002.safetensors is missing" in err
    assert not (tmp_path / "again").exists()


def test_info(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "info", model)
    assert code == 0 and "not compressed" in out and "w.bf16" in out
    _run(capsys, "compress", model)
    code, out, _ = _run(capsys, "info", model.with_name("m.ek.safetensors"))
    assert code == 0 and "mxfp4" in out and "entropykit record v3" in out


def test_analyze_is_handed_on(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "analyze", model, "--top", "3")
    assert code == 0 and str(model) in out
    with pytest.raises(SystemExit) as e:
        main(["analyze", "--help"])
    assert e.value.code == 0 and "usage: entropykit analyze" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "analyze" in capsys.readouterr().out


def test_progress_line() -> None:
    s = io.StringIO()
    bar = Bar("compress x", stream=s, interval=0)
    bar(50, 100)
    bar(100, 100)
    bar.close()
    lines = s.getvalue().split("\r")
    assert lines[1].startswith("compress x   50%") and lines[2].startswith("compress x  100%")
    assert s.getvalue().endswith("\n")


def test_runs_as_a_module() -> None:
    r = subprocess.run([sys.executable, "-m", "entropykit.cli", "info", "--help"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "usage: entropykit info" in r.stdout


def test_gpu_target(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import entropykit
    from entropykit.container.reader import Compressed

    code, _, err = _run(capsys, "compress", model, "--target", "gpu", "-o", tmp_path / "g.ek")
    assert code == 0 and err == ""
    entropykit.compress_file(model, tmp_path / "api.ek", target="gpu")
    gpu = (tmp_path / "g.ek").read_bytes()
    assert gpu == (tmp_path / "api.ek").read_bytes()
    used = {c for t in Compressed(gpu).record.tensors.values() for seg in t.codecs for c in seg}
    assert "rans" in used and "tans" not in used  # the GPU kernel decodes rANS only
    code, _, _ = _run(capsys, "decompress", tmp_path / "g.ek", "-o", tmp_path / "back")
    assert code == 0 and (tmp_path / "back").read_bytes() == model.read_bytes()
    with pytest.raises(ValueError, match="target must be one of"):
        entropykit.compress_file(model, tmp_path / "x.ek", target="tpu")
    assert not (tmp_path / "x.ek").exists()
    with pytest.raises(SystemExit) as exc:  # argparse rejects the choice: usage error
        _run(capsys, "compress", model, "--target", "tpu", "-o", tmp_path / "y.ek")
    assert exc.value.code == 2 and not (tmp_path / "y.ek").exists()
