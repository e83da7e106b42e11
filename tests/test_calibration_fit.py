"""Calibration: the ridge fit, progress reporting, the file's size formula and caps."""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers  # noqa: F401 - the kv extra; .ci/run installs it

from entropykit import CorruptDataError, _jit
from entropykit import predictive as P
from entropykit.container.progress import Bar
from entropykit.predictive import calibration, residual
from entropykit.warmup import tiny_llama

MODEL = tiny_llama(layers=2, hidden=32, heads=2, kv_heads=2, vocab=64, positions=128)
GEN = torch.Generator().manual_seed(4)
PROMPTS = [torch.randint(0, 64, (80,), generator=GEN) for _ in range(4)]


def test_zero_features_get_zero_weight_and_the_fit_is_repeatable():
    rng = np.random.default_rng(7)
    feats = rng.standard_normal((640, 30)).astype(np.float32)
    feats[:, 10:20] = 0  # a predictor that guesses nothing: its features are all zero
    target = (feats @ rng.standard_normal((30, 4)) + 0.1 * rng.standard_normal((640, 4))
              ).astype(np.float32)
    w, oof = residual.fit_conditional(feats, target)
    assert not w[10:20].any() and w[:10].any() and w[20:].any()
    w2, oof2 = residual.fit_conditional(feats, target)
    assert w.tobytes() == w2.tobytes() and oof.tobytes() == oof2.tobytes()
    assert oof.dtype == np.float32 and np.abs(target - oof).std() < 0.15


def test_calibration_bytes_are_deterministic_and_file_bytes_is_their_size(tmp_path):
    a = P.calibrate(MODEL, P.FP8Predictor(MODEL), PROMPTS, progress=False)
    b = P.calibrate(MODEL, P.FP8Predictor(MODEL), PROMPTS, progress=False)
    assert a.fingerprint == b.fingerprint
    assert a.version == 2
    assert sum(x.nbytes for x in a.arrays.values()) == calibration.file_bytes(
        a.dims, len(a.formats))
    a.save(tmp_path / "c.safetensors")
    b.save(tmp_path / "d.safetensors")
    assert (tmp_path / "c.safetensors").read_bytes() == (tmp_path / "d.safetensors").read_bytes()
    assert P.Calibration.load(tmp_path / "c.safetensors").fingerprint == a.fingerprint


@pytest.fixture
def torch_threads():
    """Sets torch's thread count for a test and restores it after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_fit_is_the_same_on_any_number_of_torch_threads(torch_threads):
    # 160 features: a size whose factorization torch rounds differently on 1 and 2 threads
    rng = np.random.default_rng(0)
    feats = rng.standard_normal((320, 160)).astype(np.float32)
    target = (feats[:, :32] * 0.3 + rng.standard_normal((320, 32))).astype(np.float32)
    fits = []
    for threads in (1, 2, 1):
        torch_threads(threads)
        w, oof = residual.fit_conditional(feats, target)
        fits.append((w.tobytes(), oof.tobytes()))
        assert torch.get_num_threads() == threads  # the fit restores the caller's count
    assert fits[0] == fits[1] == fits[2] and w.any()


def test_calibration_file_is_the_same_on_any_number_of_torch_threads(torch_threads):
    prints = []
    for threads in (1, 2):
        torch_threads(threads)
        prints.append(P.calibrate(MODEL, P.FP8Predictor(MODEL), PROMPTS,
                                  progress=False).fingerprint)
        assert torch.get_num_threads() == threads
    assert prints[0] == prints[1]


def test_fits_side_by_side_give_the_same_file_and_progress():
    steps = {1: [], 3: []}
    cals = {t: P.calibrate(MODEL, P.FP8Predictor(MODEL), PROMPTS, progress=lambda *a, t=t:
                           steps[t].append(a), threads=t) for t in steps}
    assert cals[1].fingerprint == cals[3].fingerprint
    assert cals[1].arrays["cond_bf16"].any()  # real maps were fitted, not zeros
    assert steps[1] == steps[3] == [(i + 1, len(PROMPTS) + 8) for i in range(len(PROMPTS) + 8)]
    with pytest.raises(ValueError, match="threads"):
        P.calibrate(MODEL, P.FP8Predictor(MODEL), PROMPTS, progress=False, threads=0)


@pytest.fixture
def blas_threads():
    """Sets every OpenBLAS's thread count (numpy's products) for a test and restores it."""
    controls = residual._openblas_threads()
    if not controls:
        pytest.skip("numpy's BLAS is not an OpenBLAS found by name")
    before = [get() for get, _ in controls]

    def put(n: int) -> None:
        for _, set_ in controls:
            set_(n)

    yield put
    for (_, set_), n in zip(controls, before, strict=True):
        set_(n)


def test_fit_is_the_same_on_any_number_of_blas_threads(blas_threads):
    # A shape whose products OpenBLAS rounds differently on 1 and 2 threads: unpinned, a
    # file would depend on the cores of the machine that fitted it.
    rng = np.random.default_rng(0)
    feats = rng.standard_normal((660, 96)).astype(np.float32)
    target = (0.3 * feats[:, :24] + rng.standard_normal((660, 24))).astype(np.float32)
    fits = []
    for threads in (1, 2):
        blas_threads(threads)
        w, oof = residual.fit_conditional(feats, target)
        fits.append((w.tobytes(), oof.tobytes()))
        assert residual.blas_threads() == [threads] * len(residual.blas_threads())
    assert fits[0] == fits[1] and w.any()


def test_fits_side_by_side_run_each_on_one_thread_of_torch_and_blas(blas_threads,
                                                                  torch_threads, monkeypatch):
    # Fits side by side, each with every core's BLAS or torch threads, would oversubscribe
    # the cores; the counts come back after.
    blas_threads(2)
    torch_threads(2)
    seen = []
    fit = residual.fit_conditional

    def spy(feats, target):
        seen.append((torch.get_num_threads(), *residual.blas_threads()))
        return fit(feats, target)

    monkeypatch.setattr(residual, "fit_conditional", spy)
    P.calibrate(MODEL, P.FP8Predictor(MODEL), PROMPTS, progress=False, threads=2)
    assert len(seen) == 8 and set(seen) == {(1,) * len(seen[0])}
    assert torch.get_num_threads() == 2 and set(residual.blas_threads()) == {2}


def test_one_thread_pins_until_the_outermost_caller_leaves(blas_threads, torch_threads):
    blas_threads(2)
    torch_threads(2)
    with residual.one_thread():
        with residual.one_thread():
            assert torch.get_num_threads() == 1 and set(residual.blas_threads()) == {1}
        assert torch.get_num_threads() == 1 and set(residual.blas_threads()) == {1}
    assert torch.get_num_threads() == 2 and set(residual.blas_threads()) == {2}


def _sweep_fit(feats: np.ndarray, target: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``fit_conditional``'s model written plainly in float64: every penalty tried on the
    last fold, then the weights and each fold's map (fitted without it) solved on their
    own with the whole system's penalty."""
    f, t = feats.astype(np.float64), target.astype(np.float64)
    fold = residual.folds(len(f))
    live = np.any(f != 0, axis=0)
    sd = f[:, live].std(axis=0)
    x = f[:, live] / np.where(sd > 0, sd, 1.0)

    def fit(penalty: float, train: np.ndarray) -> np.ndarray:
        g = x[train].T @ x[train]
        return np.linalg.solve(g + penalty * np.eye(len(g)), x[train].T @ t[train])

    def code(err: np.ndarray) -> float:
        return float(np.log((err**2).mean(axis=0) + 1e-30).sum())

    def unit(train: np.ndarray) -> float:
        return float(np.trace(x[train].T @ x[train])) / x.shape[1]

    last = fold == residual.FOLDS - 1
    scores = {r: code(t[last] - x[last] @ fit(r * unit(~last), ~last)) for r in residual.RIDGES}
    best = min(scores, key=scores.get)
    if scores[best] >= code(t[last]):
        return np.zeros((f.shape[1], t.shape[1])), np.zeros(t.shape, np.float32)
    penalty = best * unit(np.ones(len(f), bool))
    oof = np.empty(t.shape)
    for k in range(residual.FOLDS):
        oof[fold == k] = x[fold == k] @ fit(penalty, fold != k)
    w = np.zeros((f.shape[1], t.shape[1]))
    w[live] = fit(penalty, np.ones(len(f), bool)) / np.where(sd > 0, sd, 1.0)[:, None]
    return w, oof.astype(np.float32)


@pytest.mark.parametrize(("features", "outputs", "own"), [(300, 64, 0), (40, 6, 5), (200, 64, 5)])
def test_fit_solves_the_ridge_problem_of_a_plain_float64_solve(monkeypatch, features, outputs,
                                                               own):
    # Folds of 128 tokens. With many features and outputs each fold's out-of-fold errors
    # come from the whole system's factorization through the fold's hat block; with few,
    # from the fold's own system (``own`` of them), the cheaper route there. Either way
    # the weights and out-of-fold predictions are those of numpy's float64 solves.
    rng = np.random.default_rng(features)
    feats = rng.standard_normal((640, features)).astype(np.float32)
    feats[:, : features // 2] += feats[:, features // 2 :]  # correlated, as sources are
    feats[:, 5] = 0  # a feature that is zero throughout
    target = (feats[:, :10] @ rng.standard_normal((10, outputs)) +
              2 * rng.standard_normal((640, outputs))).astype(np.float32)
    solves = []
    real = residual._ridge_solve
    monkeypatch.setattr(residual, "_ridge_solve",
                        lambda *a, **k: solves.append(a[2]) or real(*a, **k))
    w, oof = residual.fit_conditional(feats, target)
    w_ref, oof_ref = _sweep_fit(feats, target)
    assert w.any() and not w[5].any()
    np.testing.assert_allclose(w, w_ref, rtol=0, atol=2e-5 * np.abs(w_ref).max())
    np.testing.assert_allclose(oof, oof_ref, rtol=0, atol=2e-5 * np.abs(oof_ref).max())
    # first the last fold's system per penalty tried, then each fold's own at one penalty
    assert 2 <= len(solves) - own <= len(residual.RIDGES)
    assert len(set(solves[len(solves) - own :])) == (own > 0)


def _code_length(target: np.ndarray, oof: np.ndarray) -> float:
    err = (target - oof).astype(np.float64)
    return float(0.5 * np.log2((err**2).mean(axis=0)).mean())


def test_cholesky_factors_the_system_rounded_to_float32_as_a_whole():
    # The float32 system is built from a float32 copy of g and the float64 diagonal plus
    # the penalty: exactly (g + penalty I) rounded to float32.
    rng = np.random.default_rng(8)
    x = rng.standard_normal((200, 64))
    g = x.T @ x / 3.0
    for penalty in (1e-4, 0.37, 25.0):
        want = g.copy()
        want[np.diag_indices_from(want)] += penalty
        ref = torch.linalg.cholesky(torch.from_numpy(want).float())
        assert torch.equal(residual._cholesky(g, penalty), ref)
        assert torch.equal(residual._cholesky(g, penalty, g.astype(np.float32)), ref)


def test_cholesky_solve_from_the_right_solves_the_system():
    rng = np.random.default_rng(9)
    x = rng.standard_normal((300, 80))
    g, c = x.T @ x, x.T @ rng.standard_normal((300, 24))
    got = residual._ridge_solve(g, c, 2.0)
    want = np.linalg.solve(g + 2.0 * np.eye(80), c)
    assert got.dtype == np.float32 and got.shape == (80, 24)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_cholesky_falls_back_to_float64_where_float32_is_not_positive_definite():
    # Duplicated columns and a penalty far below float32's resolution of the diagonal:
    # float32 rounding leaves the system indefinite; float64 still factors it.
    rng = np.random.default_rng(10)
    x = rng.standard_normal((200, 40))
    x = np.concatenate([x, x + 1e-9 * rng.standard_normal(x.shape)], axis=1)
    g, c = x.T @ x, x.T @ rng.standard_normal((200, 5))
    penalty = 1e-7
    assert int(torch.linalg.cholesky_ex(torch.from_numpy(g).float())[1]) != 0
    chol = residual._cholesky(g, penalty)
    assert chol.dtype == torch.float64
    a = g + penalty * np.eye(80)
    got = residual._cholesky_solve(chol, c).astype(np.float64)
    assert np.linalg.norm(a @ got - c) <= 1e-3 * np.linalg.norm(c)


def test_fit_refuses_values_that_are_not_finite():
    rng = np.random.default_rng(3)
    feats = rng.standard_normal((640, 20)).astype(np.float32)
    target = feats[:, :3].copy()
    for a in (feats, target):
        a[5, 1] = np.inf
        with pytest.raises(ValueError, match="not all finite"):
            residual.fit_conditional(feats, target)
        a[5, 1] = 0


@pytest.mark.parametrize(("noise", "most"), [(0.3, 12), (10.0, 10), (30.0, 9), (3000.0, 2)])
def test_fit_matches_a_full_sweep_with_fewer_factorizations(monkeypatch, noise, most):
    # Noise levels whose best penalty is the smallest, a middling one, a larger one and
    # "no map": the search from the largest penalty down stops at the first rise and
    # picks what the sweep picks, factorizing ``most`` systems (the sweep: 6, then the
    # whole system and, few features here, each fold's own).
    rng = np.random.default_rng(11)
    feats = rng.standard_normal((640, 48)).astype(np.float32)
    feats[:, :24] += feats[:, 24:]  # correlated features, as the sources are
    target = (feats[:, :12] @ rng.standard_normal((12, 6)) +
              noise * rng.standard_normal((640, 6))).astype(np.float32)
    factorized = []
    real = residual._cholesky
    monkeypatch.setattr(residual, "_cholesky", lambda *a: factorized.append(a[1]) or real(*a))
    w, oof = residual.fit_conditional(feats, target)
    w_ref, oof_ref = _sweep_fit(feats, target)
    assert len(factorized) == most
    assert _code_length(target, oof) <= _code_length(target, oof_ref) + 1e-5
    np.testing.assert_allclose(w, w_ref, rtol=1e-3, atol=1e-4 * np.abs(w_ref).max())


def test_fit_shape_bins_as_numpy_histogram():
    from entropykit.rans import distribution as dist

    edges = dist.z_grid()
    rng = np.random.default_rng(5)
    z = np.concatenate([4 * rng.standard_normal(50_000), edges, edges[:-1] + 2**-7,
                        [-1e9, 1e9, np.nextafter(edges[-1], 0)]]).astype(np.float32)
    hist = np.histogram(np.clip(z, edges[0], edges[-1]), bins=edges)[0].astype(np.float64)
    smooth = np.convolve(hist, np.ones(9) / 9, mode="same")
    smooth /= smooth.sum()
    wide = np.diff(dist.gaussian_shape((4.0,), (1.0,)).astype(np.float64)) / dist.ONE
    want = dist.shape_from_masses(0.999 * smooth + 0.001 * wide)
    assert np.array_equal(residual.fit_shape(z), want)


def test_fitted_model_decodes_exactly_and_codes_as_a_float64_sweep(monkeypatch):
    pred = P.FP8Predictor(MODEL)
    cal = P.calibrate(MODEL, pred, PROMPTS, progress=False)
    monkeypatch.setattr(residual, "fit_conditional", _sweep_fit)
    ref = P.calibrate(MODEL, pred, PROMPTS, progress=False)
    ids = torch.randint(0, 64, (1, 96), generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        cache = P.from_transformers(MODEL(ids, use_cache=True).past_key_values)
    for c in (cache, P.to_fp8(cache)):
        blob = P.compress_kv(c, ids, pred, cal)
        assert P.decompress_kv(blob, pred, cal).equal(c)
        # float32 solves round a few int8 weights and the stds' last digits otherwise
        assert len(blob) <= 1.002 * len(P.compress_kv(c, ids, pred, ref))


def test_progress_reports_every_step():
    seen = []
    P.calibrate(MODEL, P.NoPredictor(), PROMPTS, ("bf16",),
                progress=lambda d, t: seen.append((d, t)))
    total = len(PROMPTS) + 2 * 2  # prompts, then one (layer, k/v) fit each
    assert seen == [(i, total) for i in range(1, total + 1)]


def test_progress_line_only_where_asked(capsys):
    P.calibrate(MODEL, P.NoPredictor(), PROMPTS[:1], ("bf16",))  # stderr is not a terminal
    assert capsys.readouterr().err == ""
    P.calibrate(MODEL, P.NoPredictor(), PROMPTS[:1], ("bf16",), progress=True)
    err = capsys.readouterr().err
    assert "calibrate  100%  5/5 steps" in err and err.endswith("\n")


def test_bar_counts_steps():
    bar = Bar("fit", stream=io.StringIO(), unit="steps", scale=1)
    bar._first = (0.0, 1, _jit.compile_seconds())  # (time, steps, compiling) at step 1
    assert bar.line(3, 10, 1.0) == "fit   30%  3/10 steps  2.0 steps/s  ETA 0:04"


def test_calibrate_refuses_a_file_over_the_cap(monkeypatch):
    monkeypatch.setattr(calibration, "MAX_BYTES", 1000)
    seen = []
    with pytest.raises(ValueError, match="tensor bytes, more than the format's 1000"):
        P.calibrate(MODEL, P.NoPredictor(), PROMPTS, progress=lambda d, t: seen.append(d))
    assert seen == []  # refused after the first prompt's forward pass, before any step


def _safetensors(tensors: dict[str, np.ndarray]) -> bytes:
    meta = {"entropykit_kv_calibration": json.dumps(
        {"version": 1, "predictor": "none", "tokens": 0})}
    header, data, off = {"__metadata__": meta}, b"", 0
    for name, a in tensors.items():
        header[name] = {"dtype": "F32", "shape": list(a.shape),
                        "data_offsets": [off, off + a.nbytes]}
        data += a.tobytes()
        off += a.nbytes
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def test_load_refuses_a_shape_over_the_channel_cap(tmp_path):
    # kv heads * head dim above 2**12: refused from the header, whatever else is missing.
    big = np.zeros((1, 2, 1, calibration.MAX_CHANNELS + 1), np.float32)
    path = tmp_path / "big.safetensors"
    path.write_bytes(_safetensors({"bias": big, "std": big}))
    with pytest.raises(CorruptDataError, match="kv heads \\* head dim, more than"):
        P.Calibration.load(path)
    ok = np.zeros((1, 2, 1, calibration.MAX_CHANNELS), np.float32)
    path.write_bytes(_safetensors({"bias": ok, "std": ok}))
    assert P.Calibration.load(path).arrays["bias"].shape == ok.shape


def test_load_checks_the_caps_on_a_version_2_layout(tmp_path, monkeypatch):
    cal = P.calibrate(MODEL, P.NoPredictor(), PROMPTS, ("bf16",), progress=False)
    path = tmp_path / "c.safetensors"
    cal.save(path)
    size = calibration.file_bytes(cal.dims, 1)
    monkeypatch.setattr(calibration, "MAX_BYTES", size - 1)
    with pytest.raises(CorruptDataError, match=f"{size} tensor bytes, more than"):
        P.Calibration.load(path)
    monkeypatch.setattr(calibration, "MAX_BYTES", size)
    assert P.Calibration.load(path).fingerprint == cal.fingerprint
    # One group of 2 heads of 2**12 in the layout: over the channel cap, refused from the
    # layout before the other tensors (not of its sizes) are compared or read.
    layout = cal.arrays["layout"].copy()
    layout[0, 0] = (2, calibration.MAX_CHANNELS)
    P.Calibration(cal.predictor, dict(cal.arrays, layout=layout), cal.tokens).save(path)
    with pytest.raises(CorruptDataError, match="8192 kv heads \\* head dim, more than"):
        P.Calibration.load(path)


def test_calibrate_refuses_a_group_over_the_channel_cap(monkeypatch):
    monkeypatch.setattr(calibration, "MAX_CHANNELS", 31)  # MODEL's groups: 2 heads of 16
    with pytest.raises(ValueError, match="32 kv heads \\* head dim, more than"):
        P.calibrate(MODEL, P.NoPredictor(), PROMPTS, progress=False)


MAIN_V2 = np.load(Path(__file__).parent / "data" / "kv_calib_v2.npz")


@pytest.mark.parametrize("name", ["bf16", "fp8"])
def test_calibration_written_by_the_earlier_fit_loads_and_codes_as_it_did(name, tmp_path):
    path = tmp_path / "cal.safetensors"
    path.write_bytes(MAIN_V2["calibration"].tobytes())
    cal = P.Calibration.load(path)
    assert cal.version == 2 and cal.fingerprint == int(MAIN_V2["fingerprint"])
    assert cal.get("cond", "bf16").any() and cal.get("cond", "fp8_e4m3").any()
    blob = MAIN_V2[f"blob_{name}"].tobytes()
    out = P.decompress_kv(blob, P.NoPredictor(), cal, threads=1)
    for i in range(2):
        for kv, t in enumerate((out.keys[i], out.values[i])):
            view = torch.int16 if t.element_size() == 2 else torch.uint8
            assert np.array_equal(t.contiguous().view(view).numpy(),
                                  MAIN_V2[f"{name}_{'kv'[kv]}{i}"])
    # and today's encoder writes the very same blob with it
    assert P.compress_kv(out, torch.from_numpy(MAIN_V2["ids"]), P.NoPredictor(), cal,
                         threads=1) == blob
