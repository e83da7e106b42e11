"""The kernels' status codes: one number per meaning (``entropykit._status.Status``), in
the CUDA builds through the generated prologue and in the messages the GPU paths raise."""

from __future__ import annotations

import re
from importlib import resources

import numpy as np

from entropykit._status import Status, by_status, cuda_prologue
from entropykit.rans import dist_kernels as K
from entropykit.rans import kernels as RK
from entropykit.rans.cuda import dist as G
from entropykit.rans.cuda import plan


def test_numbers_are_stable_and_distinct():
    assert {s.name: s.value for s in Status} == {
        "OK": 0, "STATE": 1, "TRUNCATED": 2, "TRAILING": 3, "FINAL": 4, "ODD": 5,
        "CONTEXT": 6, "BOUNDS": 7, "TABLE": 8, "CRC": 9, "RAW": 10, "PARAM": 11,
        "EMPTY": 12, "MARKER": 13, "PLACE": 14, "HEADER": 15, "MODEL": 16, "DIRECTORY": 17}


def test_rans_numba_codes_are_the_status_numbers():
    # The rANS Numba kernels' ERR_<NAME> is Status.<NAME>: their numbers mean one thing.
    for mod in (RK, K):
        names = {n[4:]: v for n, v in vars(mod).items() if n.startswith("ERR_")}
        assert names and all(Status[n] == v for n, v in names.items()), mod.__name__


def test_gpu_distribution_codes_collide_with_no_other_meaning():
    # The GPU distribution coder's own codes (CRC, RAW, PARAM) are numbers no CPU rANS
    # kernel uses for something else (they were 6..8: CONTEXT, BOUNDS, TABLE there).
    own = {Status.CRC, Status.RAW, Status.PARAM}
    assert not own & set(RK.MESSAGES) and not own & set(K.MESSAGES)
    assert set(G.MESSAGES) == set(by_status(K.MESSAGES)) | {Status.CRC, Status.RAW}


def test_cuda_prologue_defines_every_code_and_the_kernels_no_number():
    lines = cuda_prologue().splitlines()
    assert lines == [f"#define ERR_{s.name} {int(s)}" for s in Status if s]
    for name in ("_dist_kernel.cu", "_kernel.cu", "_encode_kernel.cu"):
        src = resources.files("entropykit.rans.cuda").joinpath(name).read_text()
        assert not re.search(r"#define ERR_", src), name
        if name == "_encode_kernel.cu":  # writes no status: every chunk codes or goes raw
            continue
        used = set(re.findall(r"\bERR_([A-Z]+)\b", src))
        assert used and used <= {s.name for s in Status}, (name, used)


def test_chunk_errors_are_worded_through_the_enum():
    offsets = np.array([28, 40, 90])
    c, msg = G.chunk_error(np.array([0, 0, Status.CRC], np.int32), offsets)
    assert c == 2 and msg.endswith("CRC-32 of decoded values does not match")
    c, msg = G.chunk_error(np.array([0, Status.RAW, 0], np.int32), offsets)
    assert c == 1 and msg.endswith("raw payload length differs from the chunk's values")
    assert G.first_bad_param(np.array([0, Status.PARAM], np.int32), np.array([0, 7]), 64) == 71
    # the static decoder's rows: the CPU decoder's words for its codes
    origins = plan.Origins(np.array([[0, 3, 100]]), ("exponent frame 0",))
    err = origins.error(np.array([Status.TRAILING], np.int32))
    assert str(err) == ("exponent frame 0 chunk 3 (payload at byte 100): "
                        + RK.MESSAGES[RK.ERR_TRAILING])
