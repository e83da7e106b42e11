"""The analysis report: per tensor and field entropies, aggregates, JSON and a text table.

What it is: the data model ``analyze`` fills (``Report`` of ``TensorRow`` of ``FieldRow``),
the aggregates per dtype and per role (``Group``), the JSON form (schema
``SCHEMA``, round-trips exactly) and the terminal table. What it is not: the counting
(counts.py), the reading of inputs (_source.py) or plots (plots.py).

The numbers, per field of the formats split (the streams the coders see), in bits:

- ``entropy``: order-0 empirical entropy per symbol, H(X), one table per tensor and field.
- ``conditional``: H(X | C) for a field with a context field C (BF16 sign_mantissa given
  the exponent): one table per context value, tables not paid for. The information bound.
- ``coder``: H(X | class(C)) with the context classes the coder picks
  (``coding.contexts.choose``, which weighs table costs): what the coder's model can reach.
- ``carried``: the bound used for totals, ``conditional`` where there is a context, else
  ``entropy``; ``allocated`` is 8 bits per symbol. ratio = carried / allocated is the
  best compressed size over raw size any coder of per-tensor static tables can reach.

Group ``pooled`` entropy: one table for all tensors of the group (order-0), against the
sum of per-tensor tables: the gain of per-tensor statistics.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import numpy as np

from ..coding.tables import entropy_bits
from ._source import ITEMSIZE
from .magnitude import Log2Histogram
from .roles import ROLES

SCHEMA = "entropykit.analysis/1"


@dataclass(frozen=True)
class FieldRow:
    """One field of one tensor."""

    name: str
    context: str | None
    symbols: int
    distinct: int  # symbol values present
    entropy: float  # bits per symbol, order 0
    conditional: float | None  # bits per symbol given the context field, if any
    coder: float | None  # bits per symbol given the coder's context classes, if any
    hist: tuple[int, ...]  # 256 counts

    @property
    def carried(self) -> float:
        return self.entropy if self.conditional is None else self.conditional

    @property
    def carried_bits(self) -> float:
        return self.carried * self.symbols


@dataclass(frozen=True)
class TensorRow:
    """One tensor: where it is, what it is, and its fields."""

    file: str | None
    name: str
    dtype: str
    layout: str | None
    role: str
    shape: tuple[int, ...]
    nbytes: int
    fields: tuple[FieldRow, ...]
    log2: Log2Histogram | None  # float tensors only
    coded: int | None = None  # bytes entropykit's container spent on it, when known

    @property
    def elements(self) -> int:
        return self.nbytes // ITEMSIZE[self.dtype]

    @property
    def allocated_bits(self) -> int:
        return 8 * self.nbytes

    @property
    def carried_bits(self) -> float:
        return sum(f.carried_bits for f in self.fields)

    @property
    def ratio(self) -> float:
        return self.carried_bits / self.allocated_bits if self.nbytes else 1.0

    @property
    def kind(self) -> str:
        """The dtype, with the packed layout where there is one ("U8:mxfp4")."""
        return self.dtype if self.layout is None else f"{self.dtype}:{self.layout}"


@dataclass(frozen=True)
class GroupField:
    """One field name over a group of tensors of the same split."""

    name: str
    symbols: int
    entropy_bits: float  # sum of per-tensor order-0 entropies
    carried_bits: float  # sum of per-tensor carried bits
    pooled_bits: float  # order-0 entropy of the group's pooled histogram


@dataclass(frozen=True)
class Group:
    """Totals over the tensors of one dtype, one role, or all of them."""

    kind: str  # "dtype", "role" or "total"
    key: str
    tensors: int
    elements: int
    nbytes: int
    carried_bits: float
    fields: tuple[GroupField, ...]  # dtype groups only (one split per dtype)
    coded: int | None = None  # container bytes, when every tensor of the group has them

    @property
    def allocated_bits(self) -> int:
        return 8 * self.nbytes

    @property
    def ratio(self) -> float:
        return self.carried_bits / self.allocated_bits if self.nbytes else 1.0


def _group(kind: str, key: str, rows: list[TensorRow]) -> Group:
    fields: list[GroupField] = []
    if kind == "dtype" and rows:
        for i, f0 in enumerate(rows[0].fields):
            pooled = np.sum([r.fields[i].hist for r in rows], axis=0)
            fields.append(GroupField(
                f0.name, sum(r.fields[i].symbols for r in rows),
                sum(r.fields[i].entropy * r.fields[i].symbols for r in rows),
                sum(r.fields[i].carried_bits for r in rows), entropy_bits(pooled) + 0.0))
    coded = [r.coded for r in rows]
    return Group(kind, key, len(rows), sum(r.elements for r in rows),
                 sum(r.nbytes for r in rows), sum(r.carried_bits for r in rows), tuple(fields),
                 None if None in coded or not rows else sum(coded))


@dataclass(frozen=True)
class Skipped:
    """A tensor not analyzed, and why."""

    file: str | None
    name: str
    dtype: str
    nbytes: int
    reason: str


@dataclass(frozen=True)
class Report:
    """What ``analyze`` found. ``rows``: one per tensor, in reading order."""

    source: str
    rows: tuple[TensorRow, ...]
    skipped: tuple[Skipped, ...] = ()
    seconds: float = 0.0  # time spent counting
    extra: dict = field(default_factory=dict)  # e.g. what a compressed file achieved

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.rows)

    def groups(self, kind: str) -> list[Group]:
        """Aggregates by "dtype" (packed layouts apart) or by "role", largest first."""
        keyf = {"dtype": lambda r: r.kind, "role": lambda r: r.role}[kind]
        by: dict[str, list[TensorRow]] = {}
        for r in self.rows:
            by.setdefault(keyf(r), []).append(r)
        groups = [_group(kind, k, v) for k, v in by.items()]
        order = {k: i for i, k in enumerate(ROLES)}
        return sorted(groups, key=lambda g: (-g.nbytes, order.get(g.key, 0), g.key))

    @property
    def total(self) -> Group:
        return _group("total", "all", list(self.rows))

    # --- JSON -------------------------------------------------------------------------

    def to_dict(self) -> dict:
        def group(g: Group) -> dict:
            return {**asdict(g), "allocated_bits": g.allocated_bits, "ratio": g.ratio}

        def row(r: TensorRow) -> dict:
            d = asdict(r)
            d["log2"] = None if r.log2 is None else {
                "bins": [list(b) for b in r.log2.bins], "zeros": r.log2.zeros,
                "nonfinite": r.log2.nonfinite}
            for fd, f in zip(d["fields"], r.fields, strict=True):
                fd["carried"] = f.carried
            d.update(elements=r.elements, allocated_bits=r.allocated_bits,
                     carried_bits=r.carried_bits, ratio=r.ratio)
            return d

        return {
            "schema": SCHEMA, "source": self.source, "seconds": self.seconds,
            "nbytes": self.nbytes, "tensors": [row(r) for r in self.rows],
            "skipped": [asdict(s) for s in self.skipped], "extra": self.extra,
            # Derived, for readers of the JSON; from_dict recomputes them.
            "total": group(self.total),
            "by_dtype": [group(g) for g in self.groups("dtype")],
            "by_role": [group(g) for g in self.groups("role")],
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict) -> Report:
        if d.get("schema") != SCHEMA:
            raise ValueError(f"not an analysis report of schema {SCHEMA}: {d.get('schema')!r}")
        derived = {"carried", "elements", "allocated_bits", "carried_bits", "ratio"}

        def row(t: dict) -> TensorRow:
            fields = tuple(FieldRow(**{**{k: v for k, v in f.items() if k not in derived},
                                       "hist": tuple(f["hist"])}) for f in t["fields"])
            lg = t["log2"]
            log2 = None if lg is None else Log2Histogram(
                tuple(tuple(b) for b in lg["bins"]), lg["zeros"], lg["nonfinite"])
            base = {k: v for k, v in t.items() if k not in derived | {"fields", "log2"}}
            return TensorRow(**{**base, "shape": tuple(t["shape"])}, fields=fields, log2=log2)

        return cls(d["source"], tuple(row(t) for t in d["tensors"]),
                   tuple(Skipped(**s) for s in d["skipped"]), d["seconds"], d["extra"])

    @classmethod
    def from_json(cls, text: str) -> Report:
        return cls.from_dict(json.loads(text))

    # --- text table -------------------------------------------------------------------

    def to_table(self, top: int | None = 20, columns: int | None = None) -> str:
        """A terminal table: the ``top`` largest tensors (all if None), then aggregates.
        ``columns``: fit lines in that many characters (the per-field entropies left out,
        long names shortened from the left); None: every column, names up to 60."""
        return _table(self, top, columns)


def _fields_text(fields: tuple[FieldRow, ...] | tuple[GroupField, ...]) -> str:
    parts = []
    for f in fields:
        if isinstance(f, FieldRow):
            s = f"{f.name} {f.entropy:.3f}"
            if f.conditional is not None:
                s += f" |{f.context} {f.conditional:.3f}"
        else:
            n = max(f.symbols, 1)
            s = f"{f.name} {f.entropy_bits / n:.3f} (pooled {f.pooled_bits / n:.3f})"
            if f.carried_bits < f.entropy_bits:
                s += f" |ctx {f.carried_bits / n:.3f}"
        parts.append(s)
    return "  ".join(parts)


def _line(label: str, width: int, kind: str, role: str, nbytes: int, elements: int,
          carried: float, fields: str, coded: int | None | bool) -> str:
    alloc = 8 * nbytes / max(elements, 1)
    bits = carried / max(elements, 1)
    ratio = carried / (8 * nbytes) if nbytes else 1.0
    achieved = ""
    if coded is True:  # the header
        achieved = f" {'coded':>6} {'vs bound':>8}"
    elif coded is not False:
        achieved = (f" {'-':>6} {'':>8}" if coded is None else
                    f" {coded / nbytes if nbytes else 1.0:>6.4f} "
                    f"{(8 * coded - carried) / carried if carried else 0.0:>+8.2%}")
    return (f"{label:<{width}} {kind:<10} {role:<10} {nbytes / 1e6:>9.2f} {alloc:>6.2f} "
            f"{bits:>7.3f} {ratio:>6.4f}{achieved}  {fields}").rstrip()


def _table(rep: Report, top: int | None, columns: int | None) -> str:
    rows = sorted(rep.rows, key=lambda r: (-r.nbytes, r.name))
    shown = rows if top is None else rows[:top]
    has_coded = any(r.coded is not None for r in rep.rows)
    coded = (lambda v: v) if has_coded else (lambda v: False)
    first = "tensor" if top is None or top >= len(rows) else f"tensor (largest {top})"
    width = max([len(first), len("by dtype")] + [len(r.name) for r in shown])
    width = min(width, 60)
    if columns is not None:  # what the name may take beside the fixed columns
        fixed = len(_line("", 0, "", "", 1, 1, 1.0, "", 1 if has_coded else False))
        width = max(len(first), min(width, columns - fixed))

    def fields(f: tuple[FieldRow, ...] | tuple[GroupField, ...]) -> str:
        return "" if columns is not None else _fields_text(f)

    def head(title: str) -> str:
        return _line(title, width, "dtype", "role", 0, 0, 0.0,
                     "" if columns is not None else
                     "fields: bits/symbol order-0 [|context conditional]",
                     True if has_coded else False).replace(
            f"{0:>9.2f} {0:>6.2f} {0:>7.3f} {1:>6.4f}",
            f"{'MB':>9} {'alloc':>6} {'carried':>7} {'ratio':>6}")

    mbps = rep.nbytes / 1e6 / rep.seconds if rep.seconds > 0 else float("inf")
    out = [f"entropykit analyze {rep.source}: {len(rep.rows)} tensors, "
           f"{rep.nbytes / 1e6:.2f} MB, counted in {rep.seconds:.2f} s ({mbps:.0f} MB/s)",
           "alloc, carried: bits per element; ratio: carried / allocated, the bound for "
           "per-tensor static tables"]
    if has_coded:
        out.append("coded: bytes in the entropykit container / raw bytes; vs bound: its "
                   "excess over the bound")
    out += ["", head(first)]
    for r in shown:
        name = r.name if len(r.name) <= width else "…" + r.name[-(width - 1):]
        out.append(_line(name, width, r.kind, r.role, r.nbytes, r.elements, r.carried_bits,
                         fields(r.fields), coded(r.coded)))
    for kind in ("dtype", "role"):
        out += ["", head(f"by {kind}")]
        for g in rep.groups(kind):
            out.append(_line(g.key, width, g.key if kind == "dtype" else "",
                             g.key if kind == "role" else "", g.nbytes, g.elements,
                             g.carried_bits, fields(g.fields), coded(g.coded)))
    t = rep.total
    out += ["", _line("total", width, "", "", t.nbytes, t.elements, t.carried_bits, "",
                      coded(t.coded))]
    for sk in rep.skipped:
        out.append(f"skipped {sk.name} ({sk.dtype}, {sk.nbytes} bytes): {sk.reason}")
    for k, v in rep.extra.items():
        out.append(f"{k}: {v}")
    if columns is None:
        return "\n".join(out)
    out.append("(per-field entropies: --wide, or --json)")
    return "\n".join(x if len(x) <= columns else x[: columns - 1] + "…" for x in out)
