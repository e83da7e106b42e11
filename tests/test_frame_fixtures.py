"""Frames written by an earlier release (``tests/data/frames_v1.npz``, made by
``tests/data/make_frames_v1.py``) decode to their inputs, and those inputs encode to the
same bytes: the frame formats and the encoders' output are unchanged."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from entropykit import rans, tans
from entropykit.coding import frame
from entropykit.rans import distribution as D

DATA = np.load(pathlib.Path(__file__).parent / "data" / "frames_v1.npz")
CASES = json.loads(DATA["cases"].tobytes())
MODEL = D.CoderModel(DATA["model/shapes"], DATA["model/emps"], DATA["model/weights"])
STATIC = sorted(n for n, c in CASES.items() if c["kind"] != "distribution")
DIST = sorted(n for n, c in CASES.items() if c["kind"] == "distribution")


def test_the_fixtures_cover_every_kind():
    assert {c["kind"] for c in CASES.values()} == {"rans", "tans", "distribution"}
    assert {CASES[n]["fmt"] for n in DIST} == set(D.FORMATS)
    ctx = frame.parse(rans.static.CODER, DATA["rans_context/frame"])
    assert ctx.cmap is not None and int(ctx.cmap.max()) > 0
    for name in ("rans", "tans", *DIST):  # coded and raw chunks
        f = DATA[f"{name}/frame"]
        info = (D.parse(f) if name in DIST
                else frame.parse((rans if name == "rans" else tans).static.CODER, f))
        assert set(info.modes.tolist()) == {frame.MODE_CODED, frame.MODE_RAW}, name


@pytest.mark.parametrize("name", STATIC)
def test_static_frames_decode_and_reencode_identically(name):
    case = CASES[name]
    coder = rans if case["kind"] == "rans" else tans
    sym = DATA["context_symbols"] if case["context"] else DATA["symbols"]
    sym = sym[:0] if case["empty"] else sym
    ctx = {"context": DATA["context"]} if case["context"] else {}
    stored = DATA[f"{name}/frame"].tobytes()
    for threads in (1, 2):
        np.testing.assert_array_equal(coder.decode(stored, threads=threads, **ctx), sym)
        assert coder.encode(sym, threads=threads, **case["kw"], **ctx) == stored


@pytest.mark.parametrize("name", DIST)
def test_distribution_frames_decode_and_reencode_identically(name):
    case = CASES[name]
    bits, mu, sigma = (DATA[f"{name}/{k}"] for k in ("bits", "mu", "sigma"))
    midx = DATA[f"{name}/model_index"]
    stored = DATA[f"{name}/frame"].tobytes()
    for threads in (1, 2):
        out = D.decode(stored, mu, sigma, MODEL, model_index=midx, threads=threads)
        assert out.dtype == bits.dtype
        np.testing.assert_array_equal(out, bits)
        again = D.encode(bits, mu, sigma, MODEL, fmt=case["fmt"], model_index=midx,
                         threads=threads, **case["kw"])
        assert again == stored
