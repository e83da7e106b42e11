"""fp8 e4m3 as exponent pairs: the compression ratio of a pair alphabet against today's bytes.

What it is: a CPU measurement that decides whether an fp8 e4m3 tensor may be split into one
rANS-coded byte per pair of values (both 4-bit exponents, ``e_a << 4 | e_b``) and one raw
byte per pair (both sign + mantissa nibbles), which would let a GPU decode step write two
output bytes as the bf16 build does. Data: MiniLM-L6's bf16 tensors (the carried compressed
file, ``--data``) cast to e4m3 exactly as ``gpu/bench_gpu.py`` casts them (per-tensor scale
onto +-448), and the same values scaled per 128 x 128 block (the block-wise scales of
published fp8 checkpoints; 1-D tensors per tensor). For each it prints the stored bytes over
the values of: today's layout (the whole byte rANS-coded in chunks of 2**16, stored raw
unless that saves 1 %, as ``bench_gpu.py`` stores it), the pair split (pair symbols coded the
same way, in chunks of 2**16 and 2**15 pairs, plus the raw nibble bytes; an odd last value's
byte raw), the pair split with the nibble bytes coded as well, and a pair split whose nibbles
are not the exponent but a per-tensor group of magnitudes: the 128 magnitudes ranked by
count, eight consecutive ranks a group, the coded byte both values' groups, the raw byte
both values' sign and rank within the group (the raw nibble's order within a group does
not change a size, so a decoder needs only each magnitude's group, taking a group's members
in ascending order: 4 bits a magnitude, counted as 64 bytes a tensor). Beside each, the
order-0 entropies, and for the exponent split the information the raw nibbles drop by
exponent value. With ``--fp8-file`` (an e4m3 file as it is), also what ``compress_file``
stores of its tensors and of their pair symbols, default and ``target="gpu"``. fp8 e5m2
(per-tensor scale onto +-57344) gets today's and the ranked rows: its 5-bit exponents do
not pair into a byte, while eight magnitudes a group leave the same 4-bit sign + rank
nibble.
What it is not: a speed measurement, or part of any codec.

    PYTHONPATH=$PWD python bench/fp8_pair_ratio.py --data .gpu-bench/minilm_bf16.ek.safetensors
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

os.environ.setdefault("EK_BENCH_DEVICE", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))

import bench_gpu  # noqa: E402 - the GPU benchmark's e4m3 cast and coding rule
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from entropykit import compress_file, load_file, rans  # noqa: E402
from entropykit.coding import tables  # noqa: E402

CHUNK = bench_gpu.CHUNK
BLOCK = 128
RANK_MAP = 64  # bytes: a 4-bit group for each of the 128 magnitudes


def stored(sym: np.ndarray, chunk: int = CHUNK) -> int:
    """Bytes ``bench_gpu.py`` stores for a byte stream: its rANS frame, or raw if that is
    not 1 % smaller."""
    if not sym.size:
        return 0
    f = rans.encode(sym, chunk_size=chunk)
    return len(f) if len(f) <= (1 - bench_gpu.GPU_MIN_SAVING) * sym.size else sym.size


def entropy(sym: np.ndarray) -> float:
    return tables.entropy_bits(np.bincount(sym, minlength=256)) / 8 if sym.size else 0.0


def block_scaled(tensors: dict[str, torch.Tensor]) -> list[np.ndarray]:
    """bf16 tensors -> e4m3 bytes, each 128 x 128 block of a 2-D tensor scaled onto +-448."""
    out = []
    for _, t in sorted(tensors.items()):
        if t.dtype != torch.bfloat16:
            continue
        x = t.float()
        if x.dim() != 2:
            out.append(bench_gpu.e4m3_of([t.view(torch.int16).numpy().view(np.uint16).ravel()])[0])
            continue
        r, c = x.shape
        pr, pc = -(-r // BLOCK) * BLOCK, -(-c // BLOCK) * BLOCK
        p = torch.zeros(pr, pc)
        p[:r, :c] = x
        blocks = p.view(pr // BLOCK, BLOCK, pc // BLOCK, BLOCK)
        s = (blocks.abs().amax(dim=(1, 3), keepdim=True) / 448.0).clamp(min=1e-12)
        q = (blocks / s).view(pr, pc)[:r, :c].contiguous()
        out.append(q.to(torch.float8_e4m3fn).view(torch.uint8).numpy().ravel())
    return out


def measure(name: str, fp8: list[np.ndarray], exponent_split: bool = True) -> None:
    """Print the sizes of one data set; ``exponent_split`` False: e5m2, whose exponents
    (5 bits) do not pair into a byte, gets today's and the ranked rows only."""
    n = sum(b.size for b in fp8)
    today = pair16 = pair15 = both = ranked = 0
    h_byte = h_pair = h_nib = h_ranked = 0.0
    lost = np.zeros(16)  # bits the raw nibbles carry beyond their content, by exponent
    for b in fp8:
        sym, raw = bench_gpu.pair_split(b)
        raw = np.concatenate([raw, b[2 * (b.size // 2):]])  # an odd last value's byte raw
        today += stored(b)
        pair16 += stored(sym) + raw.size
        pair15 += stored(sym, CHUNK // 2) + raw.size
        both += stored(sym) + stored(raw)
        h_byte += entropy(b)
        h_pair += entropy(sym) + raw.size
        h_nib += entropy(sym) + entropy(raw)
        rsym, rraw = bench_gpu.ranked_split(b)
        ranked += stored(rsym) + raw.size + RANK_MAP
        h_ranked += entropy(rsym) + raw.size
        full = np.bincount(((b >> 3) & 0xF).astype(np.int64) * 16
                           + (((b >> 4) & 8) | (b & 7)), minlength=256).reshape(16, 16)
        for e in range(16):
            if full[e].sum():
                lost[e] += 4 * full[e].sum() - tables.entropy_bits(full[e])
    print(f"{name}: {len(fp8)} tensors, {n:,} values")
    print(f"  today (byte coded)            {today / n:.5f}   order-0 {h_byte / n:.5f}")
    print(f"  ranked groups, sign raw       {ranked / n:.5f}   order-0 {h_ranked / n:.5f}"
          f"   {(ranked - today) / n:+.5f} (map {RANK_MAP * len(fp8) / n:.5f})")
    if not exponent_split:
        return
    print(f"  pair split, 2^16 pairs/chunk  {pair16 / n:.5f}   order-0 {h_pair / n:.5f}"
          f"   {(pair16 - today) / n:+.5f}")
    print(f"  pair split, 2^15 pairs/chunk  {pair15 / n:.5f}   {(pair15 - today) / n:+.5f}")
    print(f"  pair split, nibbles coded     {both / n:.5f}   order-0 {h_nib / n:.5f}"
          f"   {(both - today) / n:+.5f}")
    print("  raw nibbles' excess, bits a value of all values, by exponent: "
          + " ".join(f"e{e} {lost[e] / n:.4f}" for e in range(16) if lost[e] / n >= 5e-4))


def with_codecs(name: str, tensors: dict[str, torch.Tensor]) -> None:
    """The payload bytes ``compress_file`` writes (default and ``target="gpu"``) of an fp8
    file's e4m3 tensors, and of their pair symbols as a U8 tensor of half the columns (so the
    default's rans2d classes see their grid) plus the raw nibble bytes (and the ranked map)."""
    fp8 = {k: t.view(torch.uint8).numpy() for k, t in tensors.items()
           if t.dtype == torch.float8_e4m3fn and t.shape[-1] % 2 == 0}
    n = sum(b.size for b in fp8.values())
    print(f"{name}: {len(fp8)} e4m3 tensors of even rows, {n:,} values, compress_file "
          "(default / target gpu)")
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp, "s.safetensors"), Path(tmp, "s.ek.safetensors")
        for label, split, side in (("today (bytes)", None, 0),
                                   ("exponent pairs", bench_gpu.pair_split, 0),
                                   ("ranked pairs", bench_gpu.ranked_split, RANK_MAP)):
            out, raw = {}, 0
            for k, b in fp8.items():
                if split is None:
                    out[k] = torch.from_numpy(b.copy())
                    continue
                sym, nib = split(b.ravel())
                out[k] = torch.from_numpy(sym.reshape(*b.shape[:-1], b.shape[-1] // 2))
                raw += nib.size + side
            save_file(out, src)
            sizes = [sum(r.bytes_out for r in compress_file(
                src, dst, force=True, target=t).rows.values()) for t in ("cpu", "gpu")]
            print(f"  {label:15s} " + " / ".join(f"{(c + raw) / n:.5f}" for c in sizes))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="compressed MiniLM bf16 .safetensors")
    ap.add_argument("--fp8-file", help="also an fp8 e4m3 .safetensors as it is (e.g. "
                    "bench/data.py's minilm_cast_path('F8_E4M3'))")
    args = ap.parse_args()
    if args.fp8_file:
        fp8 = [t.view(torch.uint8).numpy().ravel()
               for _, t in sorted(load_file(args.fp8_file).items())
               if t.dtype == torch.float8_e4m3fn]
        measure(f"{Path(args.fp8_file).name}, its e4m3 tensors", fp8)
        with_codecs(Path(args.fp8_file).name, load_file(args.fp8_file))
    tensors = load_file(args.data)
    bits = bench_gpu.minilm_bf16(args.data)
    measure("MiniLM-L6 e4m3, per-tensor scale (bench_gpu.py's cast)", bench_gpu.e4m3_of(bits))
    measure("MiniLM-L6 e4m3, 128 x 128 block scales", block_scaled(tensors))
    measure("MiniLM-L6 e5m2, per-tensor scale", bench_gpu.fp8_of(bits, torch.float8_e5m2),
            exponent_split=False)


if __name__ == "__main__":
    main()
