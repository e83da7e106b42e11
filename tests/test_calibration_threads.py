"""Calibration's forward passes: the file does not depend on torch's thread count."""

from __future__ import annotations

import torch
import transformers  # noqa: F401 - the kv extra; .ci/run installs it

from entropykit import predictive as P
from entropykit.warmup import tiny_llama

GEN = torch.Generator().manual_seed(4)
PROMPTS = [torch.randint(0, 64, (80,), generator=GEN) for _ in range(4)]
# A sum over a million floats: torch splits it by its thread count, and the parts' rounding
# differs, as a large model's reductions may on some CPUs.
NOISE = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))


def _thread_sensitive_model() -> torch.nn.Module:
    model = tiny_llama(layers=2, hidden=32, heads=2, kv_heads=2, vocab=64,
                       positions=128).float()
    model.get_input_embeddings().register_forward_hook(
        lambda module, args, out: out + NOISE.sum() * 1e-6)
    return model


def _fingerprint(model: torch.nn.Module, predictor: P.Predictor, threads: int) -> int:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cal = P.calibrate(model, predictor, PROMPTS, progress=False, threads=2)
        assert torch.get_num_threads() == threads  # the caller's count comes back
        return cal.fingerprint
    finally:
        torch.set_num_threads(before)


def test_model_rounds_differently_on_other_thread_counts():
    # The premise of the test below: unpinned, this model's passes differ.
    before = torch.get_num_threads()
    try:
        sums = []
        for threads in (1, 4):
            torch.set_num_threads(threads)
            sums.append(float(NOISE.sum()))
    finally:
        torch.set_num_threads(before)
    assert sums[0] != sums[1]


def test_calibration_file_is_the_same_on_1_and_4_torch_threads():
    model = _thread_sensitive_model()
    for predictor in (P.FP8Predictor(model), P.EarlyExitPredictor(model, 1)):
        prints = [_fingerprint(model, predictor, t) for t in (1, 4)]
        assert prints[0] == prints[1]


def test_forward_passes_run_on_one_torch_thread_and_side_by_side_guesses_are_exact():
    model = tiny_llama(layers=3, hidden=32, heads=2, kv_heads=2, vocab=64, positions=128)
    seen = []
    model.get_input_embeddings().register_forward_hook(
        lambda *a: seen.append(torch.get_num_threads()))
    predictor = P.EarlyExitPredictor(model, 1)
    # Early exit hooks the target's own layers: passes side by side must not see them.
    one = P.calibrate(model, predictor, PROMPTS, progress=False, threads=1)
    two = P.calibrate(model, predictor, PROMPTS, progress=False, threads=2)
    assert one.fingerprint == two.fingerprint
    assert seen and set(seen) == {1}
