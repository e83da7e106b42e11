"""Writes ``frames_v1.npz``: frames of every kind with the inputs and options that made them.

Run once against the tree whose frames are to be kept (``PYTHONPATH=<tree> python
tests/data/make_frames_v1.py``); ``tests/test_frame_fixtures.py`` then checks that today's
code decodes them to those inputs and encodes those inputs to the same bytes.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

from entropykit import rans, tans
from entropykit.rans import distribution as D

OUT = pathlib.Path(__file__).with_name("frames_v1.npz")


def _symbols(rng: np.random.Generator) -> np.ndarray:
    # Skewed chunks that code, then one of uniform bytes that stays raw.
    skewed = np.minimum(rng.geometric(0.2, 5000), 255).astype(np.uint8)
    return np.concatenate([skewed[:4096], rng.integers(0, 256, 1024, np.uint8), skewed[4096:]])


def _model() -> D.CoderModel:
    counts = np.ones(65536, np.int64)
    counts[0x8000 + 0x3F00 : 0x8000 + 0x4000] = 1000
    emp = D.empirical_table(counts)
    return D.CoderModel(np.stack([D.gaussian_shape((1.0, 3.0), (0.95, 0.03)),
                                  D.gaussian_shape()]), np.stack([emp, emp]), [1311, 0])


def main() -> None:
    rng = np.random.default_rng(2026)
    arrays: dict[str, np.ndarray] = {}
    cases: dict[str, dict] = {}
    sym = _symbols(rng)
    # Symbols whose distribution shifts with their context, so that classes pay.
    ctx = rng.integers(0, 6, sym.size).astype(np.uint8)
    ctx_sym = ((sym.astype(np.int64) + 40 * ctx) % 256).astype(np.uint8)
    arrays["symbols"], arrays["context"], arrays["context_symbols"] = sym, ctx, ctx_sym
    static = {
        "rans": (rans.encode, {"precision": 12, "chunk_size": 1024}),
        "rans_p15": (rans.encode, {"precision": 15, "chunk_size": 2048}),
        "rans_context": (rans.encode, {"precision": 12, "chunk_size": 1024, "context": True}),
        "rans_empty": (rans.encode, {"precision": 12, "chunk_size": 1024, "empty": True}),
        "tans": (tans.encode, {"precision": 11, "chunk_size": 1024}),
        "tans_p9": (tans.encode, {"precision": 9, "chunk_size": 4096}),
    }
    for name, (enc, kw) in static.items():
        kw = dict(kw)
        use_ctx, empty = kw.pop("context", False), kw.pop("empty", False)
        data = sym[:0] if empty else ctx_sym if use_ctx else sym
        extra = {"context": ctx} if use_ctx else {}
        arrays[f"{name}/frame"] = np.frombuffer(enc(data, threads=1, **kw, **extra), np.uint8)
        cases[name] = {"kind": "tans" if name.startswith("tans") else "rans", "kw": kw,
                       "context": bool(use_ctx), "empty": bool(empty)}
    model = _model()
    arrays["model/shapes"], arrays["model/emps"] = model.shapes, model.emps
    arrays["model/weights"] = model.weights
    dtypes = {"bf16": "bfloat16", "fp16": "float16", "fp8_e4m3": "float8_e4m3fn",
              "fp8_e5m2": "float8_e5m2"}
    import ml_dtypes

    for fmt, dt in dtypes.items():
        n = 2500
        mu = rng.normal(0, 1, n).astype(np.float32)
        sigma = np.exp(rng.normal(-2, 0.5, n)).astype(np.float32)
        x = (mu + sigma * rng.normal(size=n).astype(np.float32))
        x = x.astype(getattr(ml_dtypes, dt, np.float16) if dt != "float16" else np.float16)
        bits = x.view(D.FORMATS[fmt].storage).copy()
        bits[2048:] = rng.integers(0, 1 << D.FORMATS[fmt].bits, n - 2048)  # a raw last chunk
        midx = rng.integers(0, 2, n).astype(np.uint16)
        kw = {"precision": 14 if fmt == "fp16" else 16, "chunk_size": 1024}
        blob = D.encode(bits, mu, sigma, model, fmt=fmt, model_index=midx, threads=1, **kw)
        name = f"dist_{fmt}"
        arrays[f"{name}/bits"], arrays[f"{name}/mu"], arrays[f"{name}/sigma"] = bits, mu, sigma
        arrays[f"{name}/model_index"] = midx
        arrays[f"{name}/frame"] = np.frombuffer(blob, np.uint8)
        cases[name] = {"kind": "distribution", "fmt": fmt, "kw": kw}
    arrays["cases"] = np.frombuffer(json.dumps(cases, sort_keys=True).encode(), np.uint8)
    np.savez_compressed(OUT, **arrays)


if __name__ == "__main__":
    main()
