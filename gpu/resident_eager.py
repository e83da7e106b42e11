"""Eager decode steps of resident mode against the plain model and DFloat11's, on a GPU.

What it is: a script for a GPU machine measuring what ``generate()`` runs, the eager
forward, where each launch's host cost counts: on a random SmolLM2-135M-shaped Llama
(``resident_check.py``'s ``smollm2-random``: hidden 576, MLP 1536, 30 layers, 9 heads, 3
kv heads, a tied 49152-row embedding; no weights needed), one row each for the plain
model, resident mode by block and by weight (their defaults) and, with ``--df11 DIR``,
DFloat11's ``DFloat11Model`` of the same model: the eager step at batch 1 (one token,
median ms) and against plain, ``generate`` tokens/s (32 new tokens), launches a step,
memory against plain, and whether the step's logits are the plain model's bit for bit.
With ``--profile``, the top functions (own time) of ten eager steps of each resident row.
With ``--device cpu`` a short dry run on the CPU backend (``--layers 2`` keeps it short).
What it is not: the correctness checks (``resident_check.py``) or a benchmark of record.

    python3 gpu/resident_eager.py [--profile]
    python3 gpu/resident_check.py --size smollm2-random --save-plain /tmp/smol
    python3 gpu/df11_model.py /tmp/smol /tmp/smol-df11
    python3 gpu/resident_eager.py --df11 /tmp/smol-df11
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import pstats
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
import resident_check as rc  # noqa: E402

import entropykit.torch as ekt  # noqa: E402

SIZE = "smollm2-random"
ROWS = {"resident block": {}, "resident weight": dict(granularity="weight")}


def _profile(model: torch.nn.Module, ids: torch.Tensor, device: str, top: int) -> str:
    """The ``top`` functions by own time of ten eager steps."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(10):
        rc._full_step(model, ids)
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


@torch.no_grad()
def measure(device: str, layers: int | None, df11: str | None, profile: bool) -> list[str]:
    """The table's rows, printed; the failures (logits that differ from plain)."""
    plain = rc.llama(SIZE, device, layers=layers)
    ids = rc._ids(plain.config.vocab_size, 1, 1, device, 0)
    want = rc._bits(rc._full_step(plain, ids))
    base = rc._time(lambda: rc._full_step(plain, ids), device)
    rows = [("plain", base, rc._generate_rate(plain, ids, device), "-", "1.000x", "yes")]
    fails = []
    for label, opts in ROWS.items():
        model = ekt.compress_model(rc._sharing(plain), **opts)
        state = model._entropykit_resident
        exact = torch.equal(rc._bits(rc._full_step(model, ids)), want)
        fails += [] if exact else [f"{label}: eager logits differ from the plain model's"]
        ms = rc._time(lambda m=model: rc._full_step(m, ids), device)
        mem = ekt.resident_memory(model)
        rows.append((label, ms, rc._generate_rate(model, ids, device), str(len(state.leads)),
                     f"{rc._whole_ratio(mem):.3f}x", "yes" if exact else "NO"))
        if profile:
            print(f"{label}: ten eager steps\n{_profile(model, ids, device, 14)}")
        del model, state
        gc.collect()
    if df11:
        compat = rc._df11_compat()
        with contextlib.redirect_stderr(sys.stdout):
            model = compat.load(df11, device)
        fails += rc.df11_compare("DFloat11", model, plain, df11)
        exact = torch.equal(rc._bits(rc._full_step(model, ids)), want)
        ms = rc._time(lambda: rc._full_step(model, ids), device)
        rows.append(("DFloat11", ms, rc._generate_rate(model, ids, device),
                     str(len(compat.coded_modules(model))), "-", "yes" if exact else "NO"))
    print(f"{SIZE}{'' if layers is None else f' x{layers}'}, batch 1, one token a step "
          f"(eager, median ms); torch {torch.__version__}, transformers "
          f"{transformers.__version__}, "
          f"{torch.cuda.get_device_name(device) if device.startswith('cuda') else 'CPU'}")
    print("| model | eager step ms | vs plain | generate tok/s | launches a step | "
          "memory vs plain | logits exact |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for label, ms, rate, launches, mem, exact in rows:
        print(f"| {label} | {ms:.2f} | {ms / base:.2f}x | {rate:.0f} | {launches} | {mem} "
              f"| {exact} |")
    return fails


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--layers", type=int, metavar="N", help="depth (default: 30)")
    ap.add_argument("--df11", metavar="DIR",
                    help="DFloat11's checkpoint of the same model (df11_model.py of what "
                         "resident_check.py --size smollm2-random --save-plain wrote)")
    ap.add_argument("--profile", action="store_true",
                    help="print the top functions of ten eager steps of each resident row")
    args = ap.parse_args(argv)
    fails = measure(args.device, args.layers, args.df11, args.profile)
    print("FAILURES: " + "; ".join(fails) if fails else "ALL OK")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
