"""Compression statistics: bytes in and out, values, order-0 entropy bound, time.

What it is: the numbers the CLI summary table and the API report, per dtype and in total.
What it is not: the table's formatting (``cli.py``) or the entropy computation
(``coding/tables.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Row:
    """Totals for a group of tensors (one dtype, or everything)."""

    tensors: int = 0
    values: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    entropy_bits: float = 0.0  # sum over fields of order-0 entropy (0 if not measured)

    def add(self, other: Row) -> None:
        self.tensors += other.tensors
        self.values += other.values
        self.bytes_in += other.bytes_in
        self.bytes_out += other.bytes_out
        self.entropy_bits += other.entropy_bits

    @property
    def ratio(self) -> float:
        return self.bytes_out / self.bytes_in if self.bytes_in else 1.0

    @property
    def bits_per_value(self) -> float:
        return 8 * self.bytes_out / self.values if self.values else 0.0

    @property
    def bound_per_value(self) -> float:
        return self.entropy_bits / self.values if self.values else 0.0


@dataclass
class Summary:
    """What one compress or decompress did: per-dtype rows, file sizes and seconds.

    ``original_bytes``/``compressed_bytes`` are whole-file sizes (headers included),
    whichever way the work went; the rows count tensor bytes only (original bytes in,
    payload bytes out).
    """

    rows: dict[str, Row] = field(default_factory=dict)
    original_bytes: int = 0
    compressed_bytes: int = 0
    seconds: float = 0.0
    files: int = 0

    def row(self, dtype: str) -> Row:
        return self.rows.setdefault(dtype, Row())

    @property
    def total(self) -> Row:
        t = Row()
        for r in self.rows.values():
            t.add(r)
        return t

    @property
    def ratio(self) -> float:
        return self.compressed_bytes / self.original_bytes if self.original_bytes else 1.0

    def mb_per_s(self, nbytes: int) -> float:
        return nbytes / 1e6 / self.seconds if self.seconds > 0 else float("inf")

    def merge(self, other: Summary) -> None:
        for k, r in other.rows.items():
            self.row(k).add(r)
        self.original_bytes += other.original_bytes
        self.compressed_bytes += other.compressed_bytes
        self.seconds += other.seconds
        self.files += other.files
