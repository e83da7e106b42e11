"""Hostile frames and payloads against the coders: bounded memory, CorruptDataError.

Each test builds its hostile input here. Where memory is the point the work runs in a
child process under an address-space limit (so a regression fails instead of taking the
machine's memory) and reports its peak RSS.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import entropykit
from entropykit import rans
from entropykit.coding import frame, lines
from entropykit.container import classed, codecs

_LIMIT = 2 << 30  # address space of a child: far above what bounded decoding needs
# The children import the entropykit this test imports.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(entropykit.__file__)))


def _child(body: str, **values: object) -> dict:
    """Run ``body`` in a fresh interpreter under ``_LIMIT`` of address space; return the
    JSON object it prints on its last line, with "rss" (its peak RSS, bytes) added.
    ``values`` are bound as globals (their repr)."""
    head = ["import json, resource\n",
            f"resource.setrlimit(resource.RLIMIT_AS, ({_LIMIT}, {_LIMIT}))\n"]
    head += [f"{k} = {v!r}\n" for k, v in values.items()]
    tail = ('result["rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024\n'
            "print(json.dumps(result))\n")
    code = "".join(head) + textwrap.dedent(body) + tail
    env = dict(os.environ, PYTHONPATH=_ROOT, NUMBA_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"child peak RSS {result['rss'] >> 20} MiB")
    return result


# ---- rans2d: column counts -----------------------------------------------------------


def _row_classed(n: int, cols: int, phase: int) -> tuple[np.ndarray, bytes]:
    """(symbols, a rans2d payload of them: rows in 2 classes of different statistics,
    columns not classed; its frame has a table per row class)."""
    rng = np.random.default_rng(0)
    rows = lines.n_rows(n, cols, phase)
    row = (phase + np.arange(n)) // cols
    sym = (rng.geometric(0.3, n) + 40 * (row % 2)).clip(0, 255).astype(np.uint8)
    rcls = (np.arange(rows) % 2).astype(np.uint8)
    joint = lines.context_counts(sym, cols, phase, rcls, None, 1)
    blob = classed.encode(sym, cols, phase, classed.Plan(2, 1, rcls, None, joint, 0),
                          codecs.RANS_PRECISION)
    assert frame.parse(rans.static.CODER, blob[classed.HEADER_SIZE + 1:]).cmap is not None
    return sym, blob


@pytest.mark.parametrize("cols", [1 << 30, 1 << 40])
def test_rans2d_claimed_columns_cost_nothing(cols: int) -> None:
    # A payload of a segment across two rows, edited to claim rows of 2**30 (2**40)
    # columns: its one row now (the row map says class 1, a valid map) decodes with the
    # wrong table, so the frame rejects it, in memory that follows the symbols, not
    # the claimed row (which old code laid out: 19 GB, or a numpy allocation error).
    n = 5000
    sym, blob = _row_classed(n, 8192, 8192 - n // 2)
    assert np.array_equal(codecs.decode("rans2d", np.frombuffer(blob, np.uint8), n, None),
                          sym)
    hostile = bytearray(blob)
    struct.pack_into("<Q", hostile, 16, cols)
    hostile[classed.HEADER_SIZE] = 0b01  # one row, class 1
    got = _child("""
        import numpy as np
        from entropykit.container import codecs
        data = np.frombuffer(bytes.fromhex(blob), np.uint8)
        try:
            codecs.decode("rans2d", data, n, None)
            result = {"error": None}
        except Exception as e:
            result = {"error": type(e).__name__, "message": str(e)}
    """, blob=bytes(hostile).hex(), n=n)
    assert got["error"] == "CorruptDataError", got
    assert got["message"].startswith("rans2d frame: rANS frame chunk 0")
    assert got["rss"] < 400 << 20


def test_rans2d_long_rows_segment_memory() -> None:
    # A segment of a [2, 37748736] tensor's exponents (8 Mi symbols, a default 16 MiB
    # bf16 segment) that crosses its row boundary: classed by rows, and both coded and
    # decoded in memory that follows the segment, never the 37.7 M-column row.
    got = _child("""
        import numpy as np, zlib
        from entropykit.container import classed, codecs
        n, cols = 1 << 23, 37748736
        phase = cols - n // 2
        rng = np.random.default_rng(0)
        sym = np.concatenate([rng.geometric(0.3, n // 2) + 110,
                              rng.geometric(0.6, n // 2) + 100]).clip(0, 255).astype(np.uint8)
        choice = codecs.choose(sym, None, grid=(cols, phase))
        out = codecs.decode(choice.codec, np.frombuffer(choice.blob, np.uint8), n, None)
        result = {"codec": choice.codec, "same": bool(np.array_equal(out, sym)),
                  "kr": choice.blob[5], "kc": choice.blob[6]}
    """)
    assert (got["codec"], got["same"], got["kr"], got["kc"]) == ("rans2d", True, 4, 1)
    assert got["rss"] < 450 << 20


def test_rans2d_indirect_columns_roundtrip() -> None:
    # Classed columns far more than the symbols (a short segment of very long rows, as
    # only a hand-made payload has): contexts are looked up through the column classes
    # instead of laid out along the row; the same symbols come back.
    n, cols, phase = 3000, 1 << 21, (1 << 21) - 1000
    rng = np.random.default_rng(3)
    sym = rng.geometric(0.2, n).clip(0, 255).astype(np.uint8)
    rows = lines.n_rows(n, cols, phase)
    rcls = rng.integers(0, 4, rows).astype(np.uint8)
    ccls = rng.integers(0, 4, cols).astype(np.uint8)
    joint = lines.context_counts(sym, cols, phase, rcls, ccls, 4)
    assert joint.sum() == n
    blob = classed.encode(sym, cols, phase, classed.Plan(4, 4, rcls, ccls, joint, 0),
                          codecs.RANS_PRECISION)
    ctx = lines.context(n, cols, phase, rcls, ccls, 4)
    np.testing.assert_array_equal(ctx, rcls[(phase + np.arange(n)) // cols] * 4
                                  + ccls[(phase + np.arange(n)) % cols])
    np.testing.assert_array_equal(codecs.decode("rans2d", np.frombuffer(blob, np.uint8), n,
                                                None), sym)
