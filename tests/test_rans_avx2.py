"""The static rANS decoder compiled for an AVX2-only x86 target (no AVX-512): its own
vector step (``simd._decode_step_avx2``), exact round trips, the same bytes as the host's
build, and every damaged payload refused. The target is emulated in a subprocess with
``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES`` and a cache of its own."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import llvmlite.binding as ll
import pytest

_ROOT = Path(__file__).resolve().parent.parent
_SPEC = importlib.util.spec_from_file_location("rans_isa", _ROOT / "bench" / "rans_isa.py")
rans_isa = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(rans_isa)

pytestmark = pytest.mark.skipif("+avx2" not in ll.get_host_cpu_features().flatten().split(","),
                                reason="needs an x86 host with AVX2")

# Run in both processes: every frame's bytes and every kernel status, as JSON.
_CASES = r'''
import hashlib, json, os, sys
import numpy as np
from entropykit import CorruptDataError, rans
from entropykit.coding import tables
from entropykit.rans import kernels

rng = np.random.default_rng(20261126)
n = 50_021  # a partial last step and a partial last chunk
data = {
    "skewed": np.minimum(rng.geometric(0.4, n) - 1, 255).astype(np.uint8),
    "uniform": rng.integers(0, 256, n, dtype=np.uint8),
    "one symbol": np.full(n, 7, np.uint8),
}
ctx = rng.integers(0, 5, n, dtype=np.uint8)
res = {"frames": [], "status": []}
for name, sym in data.items():
    for p in (8, 12, 15):
        blob = rans.encode(sym, precision=p, chunk_size=4096, threads=1)
        assert np.array_equal(rans.decode(blob, threads=1), sym), (name, p)
        res["frames"].append(hashlib.sha256(blob).hexdigest())
    blob = rans.encode(sym, precision=12, chunk_size=4096, threads=1, context=ctx)
    assert np.array_equal(rans.decode(blob, threads=1, context=ctx), sym), name
    res["frames"].append(hashlib.sha256(blob).hexdigest())

# One chunk with a context map, decoded through the map and through table indices.
sym = data["skewed"]
freqs = np.stack([tables.quantize(np.bincount(sym[ctx == c], minlength=256) + 1, 12)
                  for c in range(3)])
cmap = np.zeros(256, np.int64)
cmap[:5] = [0, 1, 2, 1, 0]
out = np.empty(2 * n, np.uint8)
start = kernels.encode_chunk(sym, kernels.encode_tables(freqs, 12), 12, out, ctx, cmap)
payload = out[start:].copy()
dec = kernels.decode_table(freqs, 12)
res["frames"].append(hashlib.sha256(payload).hexdigest())
for c, m in ((ctx, cmap), (cmap[ctx].astype(np.uint8), None)):
    got = np.empty(n, np.uint8)
    assert kernels.decode_chunk(payload, 0, payload.size, dec, 12, got, c, m) == kernels.OK
    assert np.array_equal(got, sym)

# Damage: every truncation and flipped words must come back as an error code.
got = np.empty(n, np.uint8)
for cut in range(2, payload.size - 128, 997):
    code = kernels.decode_chunk(payload[:-cut], 0, payload.size - cut, dec, 12, got, ctx, cmap)
    res["status"].append(code)
    assert code != kernels.OK, cut
for i in range(200):
    bad = payload.copy()
    at = rng.integers(128, bad.size, 4)
    bad[at] ^= rng.integers(1, 256, 4, dtype=np.uint8)
    res["status"].append(kernels.decode_chunk(bad, 0, bad.size, dec, 12, got, ctx, cmap))
blob = bytearray(rans.encode(data["skewed"], precision=12, chunk_size=4096, threads=1))
blob[-100] ^= 0x55
try:
    rans.decode(bytes(blob), threads=1)
    raise SystemExit("a damaged frame decoded")
except CorruptDataError:
    pass
# Numba shows the assembly of a fresh build only: the subprocess's (its own cache).
res["asm"] = ("\n".join(kernels.decode_chunks.inspect_asm().values())
              if "NUMBA_CPU_FEATURES" in os.environ else "")
print(json.dumps(res))
'''


def _run(env_extra: dict[str, str], cache: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(_ROOT), NUMBA_CACHE_DIR=str(cache), **env_extra)
    done = subprocess.run([sys.executable, "-c", _CASES], env=env, capture_output=True,
                          text=True, check=False, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_avx2_build_matches_host_and_uses_its_vector_step(tmp_path: Path) -> None:
    avx2 = _run({"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": rans_isa.avx2_features()},
                tmp_path)
    # The AVX2 step: branchless lane-order refill through vpermd, and no AVX-512 at all.
    assert "vpermd" in avx2["asm"]
    assert "zmm" not in avx2["asm"] and "vpexpand" not in avx2["asm"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # the same cases in this process's build
        exec(_CASES, {})  # noqa: S102 - the module's own constant
    host = json.loads(printed.getvalue())
    assert avx2["frames"] == host["frames"]
    assert avx2["status"] == host["status"]
