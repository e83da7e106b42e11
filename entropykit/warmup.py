"""Compile the kernels ahead, so that the first real call runs at full speed.

``python -m entropykit.warmup`` (for instance a ``RUN`` line of a Dockerfile, after the
install, as the user that will run entropykit) compresses, verifies, decompresses and
loads a small synthetic file holding a tensor of every dtype numpy can hold, in each
compression mode, and, where torch and transformers are installed, codes the KV cache of
a tiny random Llama with every residual model in bf16 and fp8. Numba caches what that
compiles (``entropykit._jit`` says where), so later processes load it instead. With
``--portable`` the same runs compile, once for each tier of CPUs this one belongs to
(x86-64-v3 and a baseline on x86-64), into the package's portable cache
(``entropykit._portable``), which a wheel (its build hook runs this) or an image can ship.

What it is not: a benchmark or a test; nothing here checks results beyond what the calls
themselves check.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from . import _jit, _portable, dtypes
from .container import files

PARTS = ("weights", "kv")
_ROWS, _COLS = 256, 384  # enough rows and columns for the row/column context codec to bid


def _tensors() -> dict[str, np.ndarray]:
    """A weight-like matrix of every dtype numpy holds (floats: small normal values with
    some exact zeros; integers: small values), fixed by a seed."""
    rng = np.random.default_rng(0)
    out = {}
    for name, kind in dtypes.NUMPY.items():
        dt = np.dtype(kind)
        if dt.kind in "fV" or name.startswith(("BF", "F8")):
            x = (rng.standard_t(3, (_ROWS, _COLS)) * np.geomspace(1e-3, 1.0, _ROWS)[:, None]
                 * np.geomspace(0.01, 0.1, _COLS))
            x[::5, ::7] = 0.0
            a = x.astype(kind)
        elif dt.kind == "b":
            a = rng.random((_ROWS, _COLS)) < 0.1
        else:
            a = rng.integers(0, 100, (_ROWS, _COLS)).astype(kind)
        out[name.lower()] = a
    return out


def warm_weights() -> None:
    """Compile what compressing (default, fast, GPU target), verifying, decompressing and
    loading a safetensors file (on the CPU, and the GPU loader's host plan) compiles."""
    from safetensors.numpy import save_file

    with tempfile.TemporaryDirectory(prefix="entropykit-warmup-") as tmp:
        d = Path(tmp)
        save_file(_tensors(), str(d / "w.safetensors"))
        for mode, opts in (("default", {}), ("fast", {"fast": True}),
                           ("gpu", {"target": "gpu"})):
            out = d / f"w.{mode}.ek.safetensors"
            files.compress_file(d / "w.safetensors", out, threads=1, **opts)
            files.verify_file(out, threads=1)
            files.decompress_file(out, d / f"w.{mode}.safetensors", threads=1)
        try:
            from .api import load_file

            load_file(d / "w.default.ek.safetensors", threads=1)
        except ImportError:  # torch is optional: only load_file needs it
            pass
        # The GPU loader's host plan (numpy alone): what it compiles, needing no GPU.
        from .container import reader, source
        from .container.cuda import fileplan

        for mode in ("default", "gpu"):
            with source.FileBytes(d / f"w.{mode}.ek.safetensors") as f:
                list(fileplan.groups(reader.Compressed(f), 1))


def tiny_llama(*, vocab: int = 64, hidden: int = 32, layers: int = 1, heads: int = 2,
               kv_heads: int = 1, positions: int = 64, seed: int = 0) -> Any:
    """A small random bf16 Llama in eval mode (needs torch and transformers): the model the
    KV warm-up codes caches of, also used by the first-run benchmark and tests."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=positions)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


def tiny_kv(model: Any, *, seed: int = 0, prompts: int = 4, prompt_len: int = 48,
            batch: int = 1, tokens: int = 24) -> tuple[Any, Any, Any, Any]:
    """(cache, ids, predictor, calibration) for ``model`` (``tiny_llama``'s): random
    ``ids`` [batch, tokens] and their KV cache, an ``FP8Predictor`` and its calibration on
    ``prompts`` random prompts of ``prompt_len`` tokens, all drawn from ``seed``: what the
    KV warm-up codes, also set up by the first-run benchmark and tests."""
    import torch

    from . import predictive as P

    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    texts = [torch.randint(0, vocab, (prompt_len,), generator=gen) for _ in range(prompts)]
    ids = torch.randint(0, vocab, (batch, tokens), generator=gen)
    with torch.inference_mode():
        cache = P.from_transformers(model(ids, use_cache=True).past_key_values)
    predictor = P.FP8Predictor(model)
    return cache, ids, predictor, P.calibrate(model, predictor, texts)


def warm_kv() -> None:
    """Compile what ``compress_kv`` / ``decompress_kv`` compile, with every residual model,
    in bf16 and fp8 (needs torch and transformers: nothing to do without them)."""
    try:
        import torch  # noqa: F401 - tiny_llama and tiny_kv need torch and transformers
        import transformers  # noqa: F401

        from . import predictive as P
    except ImportError:
        return
    cache, ids, predictor, cal = tiny_kv(tiny_llama())
    for c in (cache, P.to_fp8(cache)):
        for kind in P.KINDS:
            blob = P.compress_kv(c, ids, predictor, cal, model=kind, threads=1)
            P.decompress_kv(blob, predictor, cal, threads=1)


_WARM = {"weights": warm_weights, "kv": warm_kv}


def warm(parts: Sequence[str] = PARTS, *, jobs: int = 1) -> float:
    """Compile the kernels ``parts`` use (each of ``PARTS``); seconds it took.

    ``jobs`` > 1 compiles up to that many parts at once, the others in child processes
    (Numba compiles on one core), then runs those parts here too, which loads what the
    children cached and compiles anything they did not leave there.
    """
    if any(p not in _WARM for p in parts):
        raise ValueError(f"parts must be among {PARTS}, got {list(parts)}")
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-m", "entropykit.warmup", "--quiet",
                               "--part", p]) for p in parts[1:max(1, jobs)]]
    _WARM[parts[0]]()
    for proc in procs:
        proc.wait()
    for p in parts[1:]:
        _WARM[p]()
    return time.perf_counter() - t0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m entropykit.warmup",
        description="Compile entropykit's kernels into Numba's cache, so that the first "
                    "compress, load or KV call of every later process runs at full speed.")
    ap.add_argument("--part", action="append", choices=PARTS,
                    help="only these parts (repeatable; default: all)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="compile the parts in this many processes at once (default 1)")
    ap.add_argument("--quiet", action="store_true", help="print nothing")
    ap.add_argument("--portable", nargs="?", const="", metavar="DIR",
                    help="instead, compile for portable CPUs (each tier this one runs) "
                         "into the package's portable cache (or DIR), which every later "
                         "process of any user on any machine with the same Python, Numba "
                         "and llvmlite can load: for wheels and images")
    args = ap.parse_args(argv)
    _jit.set_notice(False)
    if args.portable is not None:
        t0 = time.perf_counter()
        child = ["-m", "entropykit.warmup", "--quiet", "--jobs", str(args.jobs)]
        for p in args.part or ():
            child += ["--part", p]
        try:
            where = _portable.build(child, args.portable or None)
        except (OSError, subprocess.CalledProcessError) as e:
            print(f"entropykit: portable build failed: {e}", file=sys.stderr)
            return 1
        if not args.quiet:
            print(f"entropykit: portable kernels ready in {where} "
                  f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
        return 0
    seconds = warm(args.part or PARTS, jobs=args.jobs)
    if not args.quiet:
        print(f"entropykit: kernels ready ({seconds:.1f} s, "
              f"{_jit.compile_seconds():.1f} s compiling)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
