"""Float dtypes as (sign, exponent, mantissa) bit widths, and the rule that makes their fields.

What it is: one ``FloatFormat`` per safetensors float dtype and ``planes()``, the single rule
that derives the split from the widths. What it is not: the kernels (_planes.py), validation
(registry.py) or any coding.

The rule, and the measurements behind it (MiniLM-L6, 22.7 M trained values cast with torch;
order-0 entropy per tensor, averaged over values, in bits per value; [t] adds each tensor's
serialized 12-bit frequency tables):

- One byte (F8_E4M3, F8_E5M2, F8_E8M0): the whole byte, "byte0". E4M3 scaled per tensor to
  +-448: 6.550 [6.556]; E5M2 scaled to +-57344: 5.562 [5.566] (nibble fields: 3.980 + 2.732
  and 3.928 + 1.914, worse). Unscaled casts: 6.057 and 5.560.
- A sign and an 8-bit exponent in two or more bytes (BF16, F32): the sign moves below the
  exponent so the exponent is a whole byte. BF16: "exponent" 2.614, "sign_mantissa" 7.970
  [7.979], sign_mantissa given exponent 7.921 (context "exponent"). One table per exponent
  value costs more than it gains, 7.986 [t]; the 8 most frequent exponents plus one class
  for the rest give 7.973 [t], and 7.929 [t] against 7.972 [t] on tensors of >= 1 Mi
  values. Plain bytes would be 2.692 + 7.970. F32 adds the two low mantissa bytes
  unchanged: "byte1" 7.924, "byte0" 7.845, so exponent 33%, sign_mantissa 99.6%, byte1
  99.0%, byte0 98.1% of their raw size.
- Otherwise (F16: 5-bit exponent, F64: 11-bit): plain byte planes, no context. F16 "byte1"
  (sign, exponent, 2 mantissa bits) 5.544 [5.549], "byte0" 7.997 [8.006]. Splitting byte1
  into exponent 2.612 + (sign, 2 mantissa bits) given exponent 2.933 is the same 5.544 in
  one more stream. Conditioning byte0 on byte1 gives 7.957 but 8.288 [t], on the exponent
  7.988 but 8.051 [t]; merging classes never beats no context by more than 0.002 bits even
  on tensors of >= 1 Mi values: the low byte is noise. F64 (cast from F32): byte7 1.006 +
  byte6 6.540; moving the sign below the 11-bit exponent instead gives 0.547 + 7.455.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._planes import Planes


@dataclass(frozen=True)
class FloatFormat:
    """A float dtype's bit widths, most significant first; they sum to a whole number of bytes."""

    dtype: str
    sign: int
    exponent: int
    mantissa: int

    @property
    def itemsize(self) -> int:
        return (self.sign + self.exponent + self.mantissa) // 8

    def planes(self) -> Planes:
        word = self.itemsize
        lower = tuple(f"byte{k}" for k in range(word - 1, -1, -1))
        if self.sign and self.exponent == 8 and word >= 2:
            names = ("exponent", "sign_mantissa") + lower[2:]
            return Planes(word, names, (None, "exponent") + (None,) * (word - 2), sign_move=True)
        return Planes(word, lower, (None,) * word)


FORMATS = {
    f.dtype: f
    for f in (
        FloatFormat("BF16", 1, 8, 7),
        FloatFormat("F16", 1, 5, 10),
        FloatFormat("F32", 1, 8, 23),
        FloatFormat("F64", 1, 11, 52),
        FloatFormat("F8_E4M3", 1, 4, 3),
        FloatFormat("F8_E5M2", 1, 5, 2),
        FloatFormat("F8_E8M0", 0, 8, 0),
    )
}
