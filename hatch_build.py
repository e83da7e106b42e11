"""Wheel build hook (hatchling): compiles the kernels into the wheel's portable cache.

What it is: before a wheel is built, ``python -m entropykit.warmup --portable`` runs on the
source tree (``entropykit._portable``: code for portable CPUs, stamped with the Python,
Numba and llvmlite it was built with) and its cache goes into the wheel as
``entropykit/_portable_kernels``, so that the first command after installing that wheel
loads its kernels instead of compiling them. The wheel is then tagged for this Python and
platform. That needs entropykit's dependencies in the build environment (``pip wheel
--no-build-isolation .`` or ``python -m build --no-isolation`` where they are installed).
``ENTROPYKIT_PORTABLE_BUILD``: unset, build the cache where the dependencies import and say
why not otherwise; ``1``, fail without it; ``0``, never. ``ENTROPYKIT_PORTABLE_PARTS``: a
comma-separated subset of the warm-up's parts (default all).
What it is not: editable installs and sdists (they compile at first use, as always).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

_DEPENDENCIES = "import numba, numpy, ml_dtypes, safetensors, zstandard"


class PortableKernelsHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        self._tmp: str | None = None
        mode = os.environ.get("ENTROPYKIT_PORTABLE_BUILD", "")
        if self.target_name != "wheel" or version == "editable" or mode == "0":
            return
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [self.root, *filter(None, [os.environ.get("PYTHONPATH")])])}
        if subprocess.run([sys.executable, "-c", _DEPENDENCIES], env=env,
                          capture_output=True).returncode != 0:
            why = ("entropykit: building the wheel without compiled kernels: its dependencies "
                   "do not import in the build environment (build with --no-isolation where "
                   "they are installed)")
            if mode == "1":
                raise RuntimeError(why)
            self.app.display_warning(why)
            return
        self._tmp = tempfile.mkdtemp(prefix="entropykit-wheel-kernels-")
        target = os.path.join(self._tmp, "_portable_kernels")
        cmd = [sys.executable, "-m", "entropykit.warmup", "--portable", target,
               "--jobs", str(min(2, os.cpu_count() or 1))]
        for part in filter(None, os.environ.get("ENTROPYKIT_PORTABLE_PARTS", "").split(",")):
            cmd += ["--part", part.strip()]
        self.app.display_info("entropykit: compiling the kernels for the wheel (minutes)")
        subprocess.run(cmd, env=env, check=True, cwd=self.root)
        build_data["force_include"][target] = "entropykit/_portable_kernels"
        # Machine code for this Python and architecture: not a pure-Python wheel.
        build_data["pure_python"] = False
        build_data["infer_tag"] = True

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        if getattr(self, "_tmp", None):
            shutil.rmtree(self._tmp, ignore_errors=True)
