"""Writes ``kv_v1.npz``: KV blobs of blob version 1 and the version-1 calibration they need.

Run once against the tree whose blobs are to be kept (``PYTHONPATH=<tree> python
tests/data/make_kv_v1.py``); ``tests/test_predictive_layouts.py`` then checks that today's
code decodes them to the caches they hold. The cache is a tiny random Llama's (no
predictor: decoding needs no model), bf16 with the conditional model and fp8 with the
mixture model; the calibration file's bytes are stored as they were written.
"""

from __future__ import annotations

import pathlib
import tempfile

import numpy as np
import torch

from entropykit import predictive as P
from entropykit.warmup import tiny_llama

OUT = pathlib.Path(__file__).with_name("kv_v1.npz")


def main() -> None:
    model = tiny_llama(layers=2, hidden=32, heads=2, kv_heads=1)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 64, (40,), generator=gen) for _ in range(2)]
    ids = torch.randint(0, 64, (1, 24), generator=gen)
    with torch.inference_mode():
        cache = P.from_transformers(model(ids, use_cache=True).past_key_values)
    pred = P.NoPredictor()
    cal = P.calibrate(model, pred, prompts)
    fp8 = P.to_fp8(cache)
    arrays = {"ids": ids.numpy()}
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "cal.safetensors"
        cal.save(path)
        arrays["calibration"] = np.frombuffer(path.read_bytes(), np.uint8)
    for name, c, kind in (("bf16", cache, "conditional"), ("fp8", fp8, "mixture")):
        blob = P.compress_kv(c, ids, pred, cal, model=kind, threads=1)
        arrays[f"blob_{name}"] = np.frombuffer(blob, np.uint8)
        for i, (k, v) in enumerate(zip(c.keys, c.values, strict=True)):
            view = torch.int16 if k.element_size() == 2 else torch.uint8
            arrays[f"{name}_k{i}"] = k.contiguous().view(view).numpy()
            arrays[f"{name}_v{i}"] = v.contiguous().view(view).numpy()
        if c.scales is not None:
            arrays[f"{name}_scales"] = c.scales.numpy()
    np.savez_compressed(OUT, **arrays)


if __name__ == "__main__":
    main()
