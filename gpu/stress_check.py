"""Device check of the kernel's paths on adversarial sizes and placements.

What it is: the script a GPU machine runs to hold every build
of ``entropykit/rans/cuda/_kernel.cu`` to the CPU decoder where real weights do not reach:
symbol counts around the 32-symbol step, the 512-symbol staged round and the chunk
(1 .. 200,003), chunks of 1,024 and 65,536 symbols, outputs whose start is 16-byte aligned
or off by 2 .. 14 bytes (staged or unstaged path per chunk pair), sign_mantissa coded,
plain, in raw chunks or context-conditioned, u8 streams that are skewed, one symbol only
(a frequency of 2^p), incompressible (raw chunks) or plain, and byte planes written at a
stride of 2. Each batch decodes into a poisoned arena: every byte must equal the data,
padding between outputs must keep the poison, and every chunk's status must be clean.
Damaged exponent chunks of a staged pair must raise the CPU decoder's error naming the
chunk.
What it is not: a benchmark (bench_gpu.py) or the real-weights check (device_check.py).

    python3 gpu/stress_check.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from device_check import all_raw, fields, rebuild, specials  # noqa: E402

from entropykit import CorruptDataError, rans  # noqa: E402
from entropykit._status import Status  # noqa: E402
from entropykit.coding import frame as fr  # noqa: E402
from entropykit.gpu import upload  # noqa: E402
from entropykit.rans.cuda import plan  # noqa: E402
from entropykit.rans.kernels import MESSAGES  # noqa: E402
from entropykit.rans.static import CODER  # noqa: E402

DEV = torch.device("cuda", 0)
SIZES = [1, 31, 32, 33, 511, 512, 513, 1000, 1023, 1024, 1025, 2047, 4113, 65535, 65536,
         65537, 200_003]
PAD = [0, 1, 0, 3, 0, 5]  # poison elements after a 16-byte boundary, before an output


def log(*a) -> None:
    print(*a, flush=True)


def arena_layout(sizes: list[int], unit: int) -> tuple[list[int], int]:
    """Start (in elements) of each output: the next 16-byte boundary plus ``PAD[k % 6]``
    elements, so half the outputs start aligned (staged path) and half do not."""
    starts, at = [], 0
    per16 = 16 // unit
    for k, n in enumerate(sizes):
        at = -(-at // per16) * per16 + PAD[k % len(PAD)]
        starts.append(at)
        at += n
    return starts, at + per16


def run_batch(name: str, batch: plan.Batch, expect: list[np.ndarray], unit: int) -> list[str]:
    """Decode ``batch`` into a poisoned arena; the failures found."""
    dtype, poison = (torch.int16, 0x7FA5) if unit == 2 else (torch.uint8, 0xA5)
    starts, total = arena_layout([e.size for e in expect], unit)
    want = np.full(total, poison, np.uint16 if unit == 2 else np.uint8)
    for s, e in zip(starts, expect, strict=True):
        want[s : s + e.size] = e
    want_t = torch.from_numpy(want.view(np.int16) if unit == 2 else want).to(DEV)
    arena = torch.empty(total, dtype=dtype, device=DEV)
    outs = [arena[s : s + e.size] for s, e in zip(starts, expect, strict=True)]
    db = upload(batch, DEV)
    bad = []
    arena.fill_(poison)
    try:
        db.decode(outs)
        if not torch.equal(arena, want_t):
            wrong = (arena != want_t).nonzero().flatten()[:5].tolist()
            bad.append(f"{name}: {int((arena != want_t).sum())} elements wrong, e.g. {wrong}")
    except CorruptDataError as err:
        bad.append(f"{name}: status error {err}")
    log(f"{name}: {len(expect)} outputs, {len(batch.desc) // 2} warps, "
        f"{'ok' if not bad else 'FAILED'}")
    return bad


def bf16_cases(rng, chunk: int, ctx: bool) -> tuple[plan.Batch, list[np.ndarray]]:
    p = plan.Planner(True)
    expect = []
    kinds = ("ctx",) if ctx else ("coded", "plain", "rawframe")
    for k, (n, kind) in enumerate((n, kind) for n in SIZES for kind in kinds):
        bits = specials(n, seed=k) if n >= 50 else rng.integers(0, 1 << 16, n).astype(np.uint16)
        exp, sm = fields(bits)
        ef = rans.encode(exp, chunk_size=chunk)
        if kind == "plain":
            s = plan.Stream.plain(sm, f"sm {k}")
        else:
            sf = rans.encode(sm, chunk_size=chunk, context=exp if ctx else None)
            if kind == "rawframe":
                sf = all_raw(sf, sm)
            s = plan.Stream.frame(sf, f"sm {k}")
        p.add_pair(plan.Stream.frame(ef, f"exp {k}"), s, plan.Place(k))
        expect.append(bits)
    return p.finish([e.size for e in expect]), expect


def u8_cases(rng, chunk: int) -> tuple[plan.Batch, list[np.ndarray]]:
    p = plan.Planner(False)
    expect = []
    k = 0
    for n in SIZES:
        for kind in ("skewed", "one", "uniform", "plain"):
            if kind == "uniform":
                sym = rng.integers(0, 256, n).astype(np.uint8)
            elif kind == "one":
                sym = np.full(n, 7, np.uint8)
            else:
                sym = np.minimum(rng.geometric(0.2, n) - 1, 255).astype(np.uint8)
            s = (plan.Stream.plain(sym, f"u8 {k}") if kind == "plain" else
                 plan.Stream.frame(rans.encode(sym, chunk_size=chunk), f"u8 {k}"))
            p.add(s, plan.Place(k))
            expect.append(sym)
            k += 1
    # byte planes at a stride: two streams fill the low and high bytes of one output
    lo = rng.integers(0, 256, 70_001).astype(np.uint8)
    hi = np.minimum(rng.geometric(0.3, 70_001) - 1, 255).astype(np.uint8)
    p.add(plan.Stream.frame(rans.encode(lo, chunk_size=chunk), "plane 0"), plan.Place(k, 0, 2))
    p.add(plan.Stream.frame(rans.encode(hi, chunk_size=chunk), "plane 1"), plan.Place(k, 1, 2))
    expect.append(np.stack([lo, hi], 1).reshape(-1))
    return p.finish([e.size for e in expect]), expect


def corruption() -> list[str]:
    """Damaged exponent chunks of a staged pair raise the CPU decoder's error, the one of
    the status each damage must give."""
    bits = specials(200_003, seed=99)
    exp, sm = fields(bits)
    ef = rans.encode(exp, chunk_size=1 << 16)
    info = fr.parse(CODER, ef)
    c = 1
    a, ln = int(info.offsets[c]), int(info.lengths[c])
    good = bytearray(ef[a : a + ln])
    low = bytearray(good)
    low[0:4] = (1234).to_bytes(4, "little")
    cases = {"start state": (bytes(low), Status.STATE),
             "words left over": (bytes(good) + b"\x00\x01", Status.TRAILING),
             "words missing": (bytes(good)[:-2], Status.TRUNCATED)}
    bad = []
    for name, (payload, status) in cases.items():
        broken = rebuild(ef, c, payload)
        try:
            rans.decode(broken)
            cpu = "no error"
        except CorruptDataError as e:
            cpu = str(e).split(": ", 1)[1]
        p = plan.Planner(True)
        p.add_pair(plan.Stream.frame(broken, "exponent"), plan.Stream.plain(sm, "sm"),
                   plan.Place(0))
        out = torch.empty(bits.size, dtype=torch.int16, device=DEV)
        try:
            upload(p.finish([bits.size]), DEV).decode([out])
            got = "no error"
        except CorruptDataError as e:
            got = str(e)
        ok = (got.startswith(f"exponent chunk {c} ") and got.endswith(cpu)
              and cpu == MESSAGES[status])
        log(f"corrupt exponent, {name}: {'ok' if ok else 'WRONG'} ({got})")
        if not ok:
            bad.append(f"corrupt {name}: {got} (cpu: {cpu})")
    return bad


def main() -> None:
    rng = np.random.default_rng(5)
    log(torch.cuda.get_device_name(0))
    bad = []
    for chunk in (1024, 1 << 16):
        bad += run_batch(f"bf16 chunk {chunk}", *bf16_cases(rng, chunk, False), 2)
        bad += run_batch(f"bf16 ctx chunk {chunk}", *bf16_cases(rng, chunk, True), 2)
        bad += run_batch(f"u8 chunk {chunk}", *u8_cases(rng, chunk), 1)
    bad += corruption()
    if bad:
        for b in bad:
            log("FAIL", b)
        raise SystemExit(f"{len(bad)} failures")
    log("stress_check: every case exact, every damaged chunk named")


if __name__ == "__main__":
    main()
