"""Split a safetensors tensor's bytes into fields by dtype, and join fields back.

What it is: ``Field``, ``split``, ``join`` and the dtype/layout lookup, with every check on
their inputs. What it is not: the choice of split per dtype (floats.py, integers.py,
packed4.py), the kernels (_planes.py), or coding: a field is only a stream of uint8 symbols.
The kernels do not branch on data; one-byte dtypes split to a view of the input and join
with one copy.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from .. import dtypes
from . import floats, integers, packed4
from ._planes import Planes, int_view, join_words, split_words

_PLANES: dict[str, Planes] = {d: f.planes() for d, f in floats.FORMATS.items()}
_PLANES.update({d: integers.planes(d) for d in integers.ITEMSIZE})
_ITEMSIZE = {d: dtypes.BITS[d] // 8 for d in _PLANES}  # a plane word is one element

DTYPES = frozenset(_PLANES)
LAYOUTS = packed4.LAYOUTS


@dataclass(frozen=True, eq=False)
class Field:
    """One symbol stream of a split tensor."""

    name: str  # e.g. "exponent", "sign_mantissa", "byte0", "nibble_pair"
    symbols: np.ndarray  # uint8, 1-D, one symbol per element (per byte for one-byte planes)
    context: str | None  # a field of the same split (listed earlier) to condition on, or None


def _plan(dtype: str, layout: str | None) -> Planes:
    if dtype not in _PLANES:
        raise ValueError(f"unknown safetensors dtype {dtype!r}; known: {sorted(DTYPES)}")
    if layout is None:
        return _PLANES[dtype]
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; known: {sorted(LAYOUTS)}")
    if dtype not in integers.ITEMSIZE or dtype == "BOOL":
        raise ValueError(f"layout {layout!r} needs an integer dtype, got {dtype}")
    return packed4.PLANES


def planes(dtype: str, layout: str | None = None) -> Planes:
    """The byte planes ``split`` makes of ``dtype`` (with ``layout``); ValueError if
    unknown."""
    return _plan(dtype, layout)


def split(dtype: str, raw: np.ndarray, *, layout: str | None = None) -> list[Field]:
    """The fields of a tensor whose stored bytes (uint8, little-endian) are ``raw``.

    Fields come most significant first; a field's context is always an earlier field. For
    one-byte planes the single field shares memory with ``raw``.
    """
    plan = _plan(dtype, layout)
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8:
        raise TypeError(f"raw must be a uint8 numpy array, got {type(raw).__name__} "
                        f"{getattr(raw, 'dtype', '')}")
    data = np.ascontiguousarray(raw).reshape(-1)
    itemsize = _ITEMSIZE[dtype]
    if data.size % itemsize:
        raise ValueError(f"{dtype} tensor of {data.size} bytes: not a multiple of {itemsize}")
    if plan.word == 1:
        planes: tuple[np.ndarray, ...] = (data,)
    else:
        rows = np.empty((plan.word, data.size // plan.word), np.uint8)
        planes = tuple(rows)
        split_words(int_view(data, plan.word), plan.sign_move, planes)
    return [Field(n, p, c) for n, p, c in zip(plan.names, planes, plan.contexts, strict=True)]


def join(
    dtype: str, fields: Mapping[str, np.ndarray], nbytes: int, *, layout: str | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """The tensor's bytes (uint8 array of ``nbytes``) from the fields ``split`` gave:
    written into ``out`` when given (a writable, contiguous 1-D uint8 array of exactly
    ``nbytes``, which is returned: a restored file's slice, saving a copy), else new."""
    plan = _plan(dtype, layout)
    nbytes = operator.index(nbytes)
    itemsize = _ITEMSIZE[dtype]
    if nbytes < 0 or nbytes % itemsize:
        raise ValueError(f"{dtype} tensor cannot have {nbytes} bytes (itemsize {itemsize})")
    missing = [n for n in plan.names if n not in fields]
    extra = sorted(set(fields) - set(plan.names))
    if missing or extra:
        raise ValueError(f"{dtype} fields must be {list(plan.names)}: "
                         f"missing {missing}, unexpected {extra}")
    n = nbytes // plan.word
    planes = []
    for name in plan.names:
        a = fields[name]
        if not isinstance(a, np.ndarray) or a.dtype != np.uint8:
            raise TypeError(f"field {name!r} must be a uint8 numpy array")
        if a.shape != (n,):
            raise ValueError(f"field {name!r} has shape {a.shape}, {dtype} of {nbytes} bytes "
                             f"needs ({n},)")
        # Read-only contiguous views give the kernel one tuple type whatever the inputs' flags.
        view = np.ascontiguousarray(a).view()
        view.flags.writeable = False
        planes.append(view)
    if out is None:
        out = np.empty(nbytes, np.uint8)
    elif (not isinstance(out, np.ndarray) or out.dtype != np.uint8 or out.shape != (nbytes,)
          or not out.flags.c_contiguous or not out.flags.writeable):
        raise ValueError(f"out must be a writable contiguous uint8 array of shape ({nbytes},)")
    if plan.word == 1:
        out[:] = planes[0]
    else:
        join_words(tuple(planes), plan.sign_move, int_view(out, plan.word))
    return out
