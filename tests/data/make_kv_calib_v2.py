"""Writes ``kv_calib_v2.npz``: a version-2 calibration file as an earlier fit wrote it.

Run once against the tree whose files are to be kept (``PYTHONPATH=<tree> python
tests/data/make_kv_calib_v2.py``); ``tests/test_calibration_fit.py`` then checks that
today's code loads the file and codes with it exactly as that tree did. The model is a
tiny random Llama with no predictor (coding needs no model), calibrated for bf16 and fp8
e4m3 with fitted conditional maps; the file's bytes, a cache and its blobs (conditional
model) are stored as they were written.
"""

from __future__ import annotations

import pathlib
import tempfile

import numpy as np
import torch

from entropykit import predictive as P
from entropykit.warmup import tiny_llama

OUT = pathlib.Path(__file__).with_name("kv_calib_v2.npz")


def main() -> None:
    model = tiny_llama(layers=2, hidden=32, heads=2, kv_heads=2, vocab=64, positions=128)
    gen = torch.Generator().manual_seed(12)
    prompts = [torch.randint(0, 64, (80,), generator=gen) for _ in range(4)]
    ids = torch.randint(0, 64, (1, 24), generator=gen)
    with torch.inference_mode():
        cache = P.from_transformers(model(ids, use_cache=True).past_key_values)
    pred = P.NoPredictor()
    cal = P.calibrate(model, pred, prompts, progress=False, threads=1)
    arrays = {"ids": ids.numpy(), "fingerprint": np.array(cal.fingerprint, np.uint32)}
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "cal.safetensors"
        cal.save(path)
        arrays["calibration"] = np.frombuffer(path.read_bytes(), np.uint8)
    for name, c in (("bf16", cache), ("fp8", P.to_fp8(cache))):
        blob = P.compress_kv(c, ids, pred, cal, threads=1)
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
