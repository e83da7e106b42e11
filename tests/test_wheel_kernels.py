"""The wheel ships its compiled kernels: built by the build hook, loaded by a fresh install.

Builds the wheel of this tree (the warm-up's weights part only, to keep it short), installs
it into a new virtual environment that borrows this one's packages (nothing downloads),
then runs its first ``entropykit compress`` and ``decompress`` on an empty Numba cache.
Slow: ``python -m pytest -m slow tests/test_wheel_kernels.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("hatchling")

ROOT = Path(__file__).resolve().parent.parent

_FIRST = """
import sys
from entropykit import _jit, _portable
from entropykit.cli import main
code = main(sys.argv[1:])
tiers = ",".join(sorted(set(_portable.tiers_loaded())))
print(code, _jit.compile_seconds(), _portable.loads(), tiers)
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "ENTROPYKIT_PORTABLE_KERNELS", "NUMBA_CACHE_DIR")}
    return {**env, "ENTROPYKIT_BACKGROUND_COMPILE": "0", **extra}


def _venv(tmp_path: Path, wheel: Path) -> Path:
    """A new environment with the wheel installed, this one's packages visible after it."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)], check=True, env=_env())
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], capture_output=True, text=True, check=True)
    borrowed = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    Path(site.stdout.strip(), "zz_borrowed.pth").write_text("\n".join(sorted(borrowed)) + "\n")
    return venv


@pytest.mark.slow
def test_the_wheel_runs_its_first_compress_without_compiling(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    from entropykit import _portable
    from entropykit.warmup import _tensors

    dist = tmp_path / "dist"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                        "--no-build-isolation", "--no-index", "-w", str(dist), str(ROOT)],
                       capture_output=True, text=True, timeout=1200,
                       env=_env(ENTROPYKIT_PORTABLE_PARTS="weights",
                                ENTROPYKIT_PORTABLE_BUILD="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = dist.glob("entropykit-*.whl")
    assert "-none-any" not in wheel.name  # machine code: tagged for this Python and platform
    names = zipfile.ZipFile(wheel).namelist()
    assert "entropykit/_portable_kernels/manifest.json" in names
    for tier in _portable.TIERS:
        assert any(n.startswith(f"entropykit/_portable_kernels/{tier.name}/") for n in names)

    venv = _venv(tmp_path, wheel)
    work = tmp_path / "work"
    work.mkdir()
    t = _tensors()
    src = work / "w.safetensors"
    save_file({k: t[k] for k in ("bf16", "f32", "i64")}, str(src))
    python, cli = str(venv / "bin" / "python"), str(venv / "bin" / "entropykit")
    where = subprocess.run([python, "-c", "import entropykit; print(entropykit.__file__)"],
                           capture_output=True, text=True, cwd=work, env=_env())
    assert where.stdout.startswith(str(venv)), where.stdout + where.stderr

    # The installed command, as a user runs it: nothing compiled, so Numba cached nothing.
    cache = tmp_path / "numba-a"
    r = subprocess.run([cli, "compress", "w.safetensors", "-o", "a.ek.safetensors"],
                       capture_output=True, text=True, cwd=work,
                       env=_env(NUMBA_CACHE_DIR=str(cache)))
    assert r.returncode == 0, r.stderr
    assert not [p for p in cache.rglob("*") if p.is_file()]
    # The same first run, asked what it compiled and where its kernels came from.
    best = _portable.host_tiers()[0].name
    for argv, cache in ((["compress", "w.safetensors", "-o", "b.ek.safetensors"], "b"),
                        (["decompress", "b.ek.safetensors", "-o", "back.safetensors"], "c")):
        r = subprocess.run([python, "-c", _FIRST, *argv], capture_output=True, text=True,
                           cwd=work, env=_env(NUMBA_CACHE_DIR=str(tmp_path / f"numba-{cache}")))
        assert r.returncode == 0, r.stderr
        code, compiling, loads, tiers = r.stdout.splitlines()[-1].split()  # after the table
        assert (code, float(compiling), tiers) == ("0", 0.0, best) and int(loads) > 0
        assert "compiling kernels" not in r.stderr
    assert (work / "a.ek.safetensors").read_bytes() == (work / "b.ek.safetensors").read_bytes()
    assert (work / "back.safetensors").read_bytes() == src.read_bytes()


def test_sdist_and_editable_builds_compile_nothing(tmp_path: Path) -> None:
    # The hook only acts on a regular wheel: an sdist ships sources, an editable install
    # compiles at first use like any checkout.
    r = subprocess.run([sys.executable, "-m", "hatchling", "build", "-t", "sdist", "-d",
                        str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env=_env(ENTROPYKIT_PORTABLE_BUILD="1"))
    assert r.returncode == 0, r.stderr
    (sdist,) = tmp_path.glob("entropykit-*.tar.gz")
    import tarfile

    names = tarfile.open(sdist).getnames()
    assert any(n.endswith("/hatch_build.py") for n in names)
    assert not any("_portable_kernels" in n for n in names)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                        "--no-build-isolation", "--no-index", "-w", str(tmp_path / "off"),
                        str(ROOT)], capture_output=True, text=True, timeout=300,
                       env=_env(ENTROPYKIT_PORTABLE_BUILD="0"))
    assert r.returncode == 0, r.stderr
    (wheel,) = (tmp_path / "off").glob("*.whl")
    assert wheel.name.endswith("-py3-none-any.whl")
    assert not any("_portable_kernels" in n for n in zipfile.ZipFile(wheel).namelist())
