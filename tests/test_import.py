"""``import entropykit`` compiles and loads no Numba kernel: the first kernel call of a
process loads Numba's whole target registry (~0.3 s), which belongs to the first call that
needs it, not to every program (and CLI ``--help``) that imports the package."""

import subprocess
import sys

_PROBE = """
import sys
import entropykit
from numba.core.registry import CPUDispatcher
loaded = sorted(f"{name}.{attr}" for name, mod in list(sys.modules.items())
                if name.startswith("entropykit") and mod is not None
                for attr, obj in vars(mod).items()
                if isinstance(obj, CPUDispatcher) and obj.overloads)
kernels = sum(isinstance(obj, CPUDispatcher) for name, mod in list(sys.modules.items())
              if name.startswith("entropykit") and mod is not None
              for obj in vars(mod).values())
print(kernels, " ".join(loaded))
"""


def test_import_loads_no_numba_kernel() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         check=True).stdout.split()
    assert int(out[0]) > 20  # the probe sees the package's kernels
    assert out[1:] == []

