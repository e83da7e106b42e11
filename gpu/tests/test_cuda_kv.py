"""The KV distribution coder on the device (``entropykit.rans.cuda.dist``) against the CPU coder.

What it is: kv_check.py's checks, bf16, fp16, fp8 e4m3 and e5m2: values drawn as mu + sigma * t(4)
noise with NaN / inf / -0 / subnormal values mixed in, extreme (mu, sigma), the whole value
space, sizes around the 32-value step and 1024-value chunks, raw chunks, per-value models,
precision 12; the GPU frame must equal the CPU frame byte for byte, and each must decode
on the other coder (outputs poisoned first). Damaged frames (flipped bytes in payloads and
the chunk directory, garbage runs, truncations, a trailing byte, empty frames, a wrong mu)
must fail as on the CPU, with its message, or decode to its output; invalid (mu, sigma)
raise ``ValueError`` naming the value. What it is not: the coder's timings
(``kv_check.py --occupancy``).
"""

from __future__ import annotations

import kv_check as kc
import pytest
import torch

from entropykit.rans.cuda import dist

pytestmark = pytest.mark.cuda


def _checker(tmp_path) -> kc.Checker:
    return kc.Checker(torch, dist, torch.device("cuda", 0), tmp_path)


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3", "fp16", "fp8_e5m2"])
def test_gpu_frames_are_the_cpu_frames_and_decode_both_ways(fmt, tmp_path):
    ck = _checker(tmp_path)
    ck.run_exactness((fmt,), n=1_000_003)
    assert ck.failures == []
    assert ck.count > 40


def test_damaged_frames_and_invalid_parameters_fail_as_on_the_cpu(tmp_path):
    ck = _checker(tmp_path)
    ck.run_errors()
    assert ck.failures == []
    assert ck.count > 400
