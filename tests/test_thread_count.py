"""The process runs no threads beyond the pool's and the file writer's: no kernel starts
threads of its own (a Numba ``parallel`` kernel, a multi-threaded zstd or BLAS call would
put a second pool under each of the pool's threads), counted as OS threads."""

from __future__ import annotations

import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent("""
    import os, sys, threading, time
    import numpy as np
    import entropykit
    from safetensors.numpy import save_file

    def os_threads():
        return len(os.listdir("/proc/self/task"))

    d = sys.argv[1]
    rng = np.random.default_rng(0)
    save_file({f"t{i}": rng.normal(0, 0.02, (384, 512)).astype(np.float32)
               for i in range(6)}, f"{d}/a.safetensors")
    for n in (1, 3):  # warm: compile and load every kernel first
        entropykit.compress_file(f"{d}/a.safetensors", f"{d}/b.ek", threads=n, force=True)
    base, peak, stop = os_threads(), [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], os_threads())
            time.sleep(0.0005)

    s = threading.Thread(target=sample)
    s.start()
    for n in (1, 3):
        entropykit.compress_file(f"{d}/a.safetensors", f"{d}/b.ek", threads=n, force=True)
        entropykit.decompress_file(f"{d}/b.ek", f"{d}/c.safetensors", threads=n, force=True)
        entropykit.load_file(f"{d}/b.ek", threads=n)
    stop.set()
    s.join()
    print(peak[0] - base - 1)  # less the sampler
""")


def test_no_threads_beyond_the_pool_and_the_writer(tmp_path) -> None:
    run = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path)], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    extra = int(run.stdout.split()[-1])
    # 3 pool workers, the writer and its write-back thread at most.
    assert 0 <= extra <= 3 + 2
