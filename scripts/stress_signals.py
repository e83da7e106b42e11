"""Stress check: does ``entropykit compress`` always honour SIGHUP/SIGTERM?

Starts the command on a file of many small segments again and again, sends the signal
at a random moment of the run, and counts how each run ended: 128+N (the signal
honoured), killed by it (it came before or after the CLI's handler), 0 with the signal
sent before main() returned (it was lost) or after (too late: the process was exiting),
or another code (the signal turned into an error). Stderr of every lost or odd run is
printed ("Exception ignored" says where the handler's raise was dropped), and any
temporary left behind is named.
Not a test: it takes minutes and its outcome depends on timing.

    PYTHONPATH=$PWD python scripts/stress_signals.py --runs 100 [--signal HUP]
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _source(path: Path, tensors: int) -> None:
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(0)
    save_file({f"t{i}": torch.randn(256, 64).to(torch.bfloat16) for i in range(tensors)},
              path)


# The CLI, saying on stderr when main() returned: a signal sent after that (while the
# process exits) is not one the run could honour.
_CHILD = """
import os, sys, time
from entropykit.cli import main
code = main(sys.argv[1:])
os.write(2, f"{_RETURNED} {time.time()}\\n".encode())
sys.exit(code)
"""
_RETURNED = "stress: main returned at"


def _run_once(src: Path, out: Path, sig: int | None, delay: float
              ) -> tuple[int, str, bool]:
    """Exit code, stderr, and whether the signal was sent before main() returned."""
    p = subprocess.Popen([sys.executable, "-c", _CHILD.replace("_RETURNED", repr(_RETURNED)),
                          "compress", str(src), "-o", str(out), "--threads", "1", "-q",
                          "--force"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(delay)
    sent = None
    if sig is not None and p.poll() is None:
        p.send_signal(sig)
        sent = time.time()
    _, err = p.communicate(timeout=120)
    returned = [float(line.split()[-1]) for line in err.splitlines()
                if line.startswith(_RETURNED)]
    err = "".join(line for line in err.splitlines(True) if not line.startswith(_RETURNED))
    in_time = sent is not None and (not returned or sent < returned[0])
    return p.returncode, err, in_time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--signal", default="HUP", choices=("HUP", "TERM"))
    ap.add_argument("--tensors", type=int, default=200)
    ap.add_argument("--min-delay", type=float, default=0.5)
    ap.add_argument("--max-delay", type=float, default=1.6)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    sig = getattr(signal, "SIG" + a.signal)
    rng = random.Random(a.seed)
    counts: collections.Counter[str] = collections.Counter()
    with tempfile.TemporaryDirectory() as d:
        src, out = Path(d) / "big.safetensors", Path(d) / "o.ek"
        _source(src, a.tensors)
        _run_once(src, out, None, 0.0)  # warms the JIT cache
        for i in range(a.runs):
            delay = rng.uniform(a.min_delay, a.max_delay)
            rc, err, in_time = _run_once(src, out, sig, delay)
            kind = ("honoured" if rc == 128 + sig else "killed" if rc == -sig
                    else ("LOST" if in_time else "too late") if rc == 0 else f"rc={rc}")
            counts[kind] += 1
            if "Exception ignored" in err:
                counts["exception ignored"] += 1
            left = [n for n in os.listdir(d) if n not in ("big.safetensors", "o.ek")]
            if left:
                counts["temporaries left"] += 1
                for name in left:  # counted once, not again after every later run
                    here = Path(d) / name
                    if here.is_dir():
                        shutil.rmtree(here)
                    else:
                        here.unlink()
            if kind not in ("honoured", "killed", "too late") or "Exception ignored" in err or left:
                print(f"run {i}: delay {delay:.3f}s: {kind}; left {left}\n{err}", flush=True)
    print(dict(counts))
    return 1 if counts["LOST"] or counts["temporaries left"] else 0


if __name__ == "__main__":
    sys.exit(main())
