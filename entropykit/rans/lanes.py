"""The 32-lane interleaved stream layout both rANS coders write (static and distribution).

What it is: the lane count, the state bound and a payload's head: 32 u32 decoder start
states (little-endian) before the 16-bit words; ``put_states`` writes them, ``read_states``
checks a payload's extent and reads them back. What it is not: either coder's symbol
steps (``kernels.py``, ``dist_kernels.py``).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .._status import ERR_ODD, ERR_STATE, OK

LANES = 32
L = 1 << 16  # states live in [L, 2**32)
STATE_BYTES = 4 * LANES

# Inlined by LLVM into both coders' kernels; allocates nothing (callable without NRT).
_inline = njit(nogil=True, cache=True, _nrt=False, forceinline=True)


@_inline
def put_states(x, out, pos):
    """Write the lanes' states ``x`` at ``out[pos:pos + STATE_BYTES]``."""
    for lane in range(LANES):
        v = x[lane]
        o = pos + 4 * lane
        out[o] = v & 0xFF
        out[o + 1] = (v >> 8) & 0xFF
        out[o + 2] = (v >> 16) & 0xFF
        out[o + 3] = (v >> 24) & 0xFF


@_inline
def read_states(buf, start, length, x):
    """Check the extent of the payload ``buf[start:start + length]`` (start states, then
    whole words, inside ``buf``) and load its start states into ``x``; an error code."""
    if length < STATE_BYTES or (length - STATE_BYTES) & 1 or start < 0 or start + length > buf.size:
        return ERR_ODD
    for lane in range(LANES):
        o = start + 4 * lane
        v = (np.uint32(buf[o]) | (np.uint32(buf[o + 1]) << 8) | (np.uint32(buf[o + 2]) << 16)
             | (np.uint32(buf[o + 3]) << 24))
        if v < L:
            return ERR_STATE
        x[lane] = v
    return OK
