"""The model section of a static frame: one frequency table, or one per context class.

What it is: building the section from symbol counts (``build``) and reading it back
(``parse``), with the class map that sends each context value to its table.
What it is not: the frame around it (``frame``) or the table format (``tables``).

Section layout (docs/format.md): context flag 0: one serialized table; flag 1: u8
n_tables - 1, u8[256] class of each context value (< n_tables), n_tables serialized tables.
"""

from __future__ import annotations

import numpy as np

from .._errors import CorruptDataError
from . import contexts, tables


def build(counts: np.ndarray | None, joint: np.ndarray | None, param: int, max_tables: int
          ) -> tuple[np.ndarray, np.ndarray | None, bytes]:
    """Quantized tables (int64[n_tables, 256]), class map (None: one table) and the section
    bytes, from a symbol histogram ``counts`` or a (context, symbol) histogram ``joint``."""
    cmap = None
    if joint is not None:
        cmap = contexts.choose(joint, max_tables)
        if cmap is None:
            counts = joint.sum(axis=0)
    if cmap is None:
        freqs, section = tables.quantize_rows(counts[None, :], param)
        return freqs, None, section
    freqs, rows = tables.quantize_rows(contexts.class_counts(joint, cmap), param)
    return freqs, cmap, b"".join([bytes([freqs.shape[0] - 1]), cmap.tobytes(), rows])


def parse(name: str, buf: np.ndarray, off: int, end: int, param: int, flag: int
          ) -> tuple[np.ndarray, np.ndarray | None]:
    """The tables and class map of the section ``buf[off:end]`` of a ``name`` frame;
    ``CorruptDataError`` unless it is exactly one well-formed section."""
    if flag == 0:
        freqs = np.empty((1, 256), np.int64)
        t_end = tables.parse_rows_into(buf, off, end, param, freqs)
        cmap = None
    else:
        if off + 257 > end:
            raise CorruptDataError(f"{name} frame context map truncated at byte {off}")
        n_tables = int(buf[off]) + 1
        cmap = buf[off + 1 : off + 257].copy()
        if int(cmap.max()) >= n_tables:
            raise CorruptDataError(
                f"{name} frame context map at byte {off + 1} names table "
                f"{int(cmap.max())} of {n_tables}"
            )
        t_end = off + 257
        freqs = np.empty((n_tables, 256), np.int64)
        t_end = tables.parse_rows_into(buf, t_end, end, param, freqs)
    if t_end != end:
        raise CorruptDataError(f"{name} frame tables end at byte {t_end}, header says {end}")
    return freqs, cmap
