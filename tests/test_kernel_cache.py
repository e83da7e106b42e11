"""Numba's cache of the package's kernels follows every source of the package.

Numba stamps a cached kernel with its own file's time and size only, but the rANS
decoder inlines its vector step from another module (``rans/simd.py``): an edit there must
make the cached decoder stale, not leave the old machine code in use.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import entropykit

_RUN = """
import numpy as np
from entropykit import rans
from entropykit.rans import kernels
x = np.random.default_rng(0).integers(0, 7, 5000).astype(np.uint8)
assert np.array_equal(rans.decode(rans.encode(x)), x)
s = kernels.decode_chunks.stats
print(sum(s.cache_hits.values()), sum(s.cache_misses.values()))
"""


def _run(src: Path, cache: Path) -> tuple[int, int]:
    env = {**os.environ, "PYTHONPATH": str(src), "NUMBA_CACHE_DIR": str(cache),
           "ENTROPYKIT_PORTABLE_KERNELS": "", "ENTROPYKIT_BACKGROUND_COMPILE": "0"}
    out = subprocess.run([sys.executable, "-c", _RUN], env=env, check=True,
                         capture_output=True, text=True, cwd=src).stdout.split()
    return int(out[0]), int(out[1])


def test_an_edit_to_an_inlined_module_makes_the_cached_decoder_stale(tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(Path(entropykit.__file__).parent, src / "entropykit",
                    ignore=shutil.ignore_patterns("__pycache__", "_portable_kernels"))
    cache = tmp_path / "cache"
    assert _run(src, cache) == (0, 1)  # compiled
    assert _run(src, cache) == (1, 0)  # from the cache
    with open(src / "entropykit" / "rans" / "simd.py", "a") as f:
        f.write("# an edit\n")
    assert _run(src, cache) == (0, 1)  # compiled again
    assert _run(src, cache) == (1, 0)
