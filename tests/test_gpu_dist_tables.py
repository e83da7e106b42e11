"""The GPU coder's model-table arguments (entropykit.rans.cuda.dist._table_args), on the CPU.

A launch whose values all use one shape gets that shape's rows alone, as a model of one
shape: the kernel indexes every per-shape table by the model index, so the rows it reads
must be byte for byte the tables of the one-shape model. Checked here through the
addresses the kernel would get (tables on the CPU: the arithmetic is the same)."""

import ctypes

import numpy as np
import pytest
import torch

from entropykit.rans import distribution as D
from entropykit.rans.cuda import dist


def _model(shapes: int) -> D.CoderModel:
    counts = np.ones(65536, np.int64)
    rows, emps = [], []
    for m in range(shapes):
        rows.append(D.gaussian_shape((1.0, 2.0 + m), (0.9, 0.1)))
        counts[0x8000 + 0x3F00 + m : 0x8000 + 0x3F80 + m] += 100 * (m + 1)
        emps.append(D.empirical_table(counts))
    return D.CoderModel(np.stack(rows), np.stack(emps), [100 * m for m in range(shapes)])


def _read(addr: int, like: np.ndarray) -> np.ndarray:
    return np.frombuffer(ctypes.string_at(int(addr), like.nbytes), like.dtype)


@pytest.mark.parametrize("m", [0, 1, 4])
def test_one_shape_rows_are_the_one_shape_model(m):
    model = _model(5)
    one = D.CoderModel(model.shapes[m : m + 1], model.emps[m : m + 1], model.weights[m : m + 1])
    want = dist.model_arrays(one)
    shapes, emps, count, weights, zinv, rtab, xpow = dist._table_args(
        model, torch.device("cpu"), m, 1)
    assert int(count) == 1
    for name, addr in (("shapes", shapes), ("emps", emps), ("weights", weights),
                       ("zinv", zinv), ("rtab", rtab)):
        np.testing.assert_array_equal(_read(addr, want[name]), want[name], err_msg=name)
    np.testing.assert_array_equal(_read(xpow, dist.x_powers()), dist.x_powers())


def test_all_shapes_by_default_and_cached():
    model = _model(3)
    args = dist._table_args(model, torch.device("cpu"))
    assert int(args[2]) == 3
    np.testing.assert_array_equal(_read(args[0], dist.model_arrays(model)["shapes"]),
                                  dist.model_arrays(model)["shapes"])
    assert dist._table_args(model, torch.device("cpu")) is args
    assert dist._table_args(model, torch.device("cpu"), 1, 1) is not args


def _kernel_words() -> tuple[int, int]:
    """(MODEL_W, ZROW) as _dist_kernel.cu computes them: a model block's words and an
    inverse row's floats (block_model's test for the inverse rows' room)."""
    import re
    from importlib import resources

    src = resources.files("entropykit.rans.cuda").joinpath("_dist_kernel.cu").read_text()
    const = {k: int(v) for k, v in re.findall(r"#define (INV_POINTS|Z_MAX|Z_GRID_BITS|EMP_W) "
                                             r"(\d+)\n", src)}
    shape_w = (2 * const["Z_MAX"] << const["Z_GRID_BITS"]) + 2
    return shape_w + const["EMP_W"], const["INV_POINTS"] + 1 + 2 * (dist.TAIL_POINTS + 1)


def test_one_shape_fits_shared_memory_where_a_calibrations_do_not():
    model = _model(61)  # a SmolLM2-135M calibration: 2 x 30 layers + the exact model
    assert dist.smem_bytes(model) == 0
    assert dist.smem_bytes(model, 1) == model.padded.shape[1] * 4 + model.emps.shape[1] * 4


@pytest.mark.parametrize("zinv", [False, True])
def test_inverse_rows_in_shared_memory_for_one_shape_launches(zinv):
    """A 16-bit format's decoder (zinv) has its inverse rows follow the model blocks
    where the launch's size holds them: exactly the kernel's words, for launches of one
    shape; launches of more shapes, and 8-bit formats' and the encoder's, take none."""
    model = _model(5)
    model_w, zrow = _kernel_words()
    assert zrow == dist.model_arrays(model)["zinv"].size // len(model)
    tables = model.padded.shape[1] + model.emps.shape[1]
    assert tables == model_w
    assert dist.smem_bytes(model, 1, zinv=zinv) == 4 * (model_w + zrow * zinv)
    assert dist.smem_bytes(model, 2, zinv=zinv) == 4 * 2 * model_w
    assert dist.smem_bytes(model, 3, zinv=zinv) == 4 * 3 * model_w


@pytest.mark.parametrize(("runs", "n"), [
    ([(3, 98304), (4, 98304)], 196608),         # a hook layer: keys then values
    ([(1, 192000), (2, 192000)], 384000),       # boundary 2^9 * 375
    ([(2, 7), (0, 5)], 12),                      # odd boundary: one entry per value
    ([(4, 0), (1, 64), (4, 64), (2, 1)], 129),   # empty run, three models
    ([(2, 1 << 20), (3, 5)], (1 << 20) + 5),     # last run shorter than an entry
])
def test_model_runs_become_a_coarse_index(runs, n):
    """_models: value i's model is first + midx[i >> shift], exactly the runs' per-value
    index; the tables are the rows of the models used."""
    model = _model(5)
    ms = dist._models(runs, model, n, torch.device("cpu"))
    want = D._as_index(runs, model, n)
    got = ms.first + ms.midx.numpy()[np.arange(n) >> ms.shift]
    np.testing.assert_array_equal(got, want)
    used = [m for m, c in runs if c]
    assert (ms.first, ms.count) == (min(used), max(used) - min(used) + 1)
    assert ms.midx.numel() == -(-n >> ms.shift)
    assert dist._models(runs, model, n, torch.device("cpu")).midx is ms.midx  # kept


def test_one_model_runs_and_ints_need_no_index():
    model = _model(3)
    for index in (2, [(2, 10), (2, 6)], [(1, 0), (2, 16)]):
        ms = dist._models(index, model, 16, torch.device("cpu"))
        assert (ms.midx, ms.m0, ms.first, ms.count) == (None, 0, 2, 1)
    per_value = torch.tensor([0, 1] * 8, dtype=torch.int16)
    ms = dist._models(per_value, model, 16, torch.device("cpu"))
    assert (ms.shift, ms.first, ms.count) == (0, 0, None) and torch.equal(ms.midx, per_value)


@pytest.mark.parametrize("shape", [(1, 3, 7, 64), (2, 2, 1, 8), (3, 1, 5, 4), (1, 1, 1, 1)])
def test_group_params_channel_of_each_value(shape):
    """predictive.cuda.groupparams' kernel reads bias / std at channel
    c(i) = ((i / dim / seq) % heads) dim + i % dim for flat value i of [batch, heads, seq,
    dim]: the (head, dim) a broadcast of a [heads, dim] table gives (its float math is the
    reference's, checked on CUDA by gpu/kv_hook_check.py)."""
    b, h, s, d = shape
    i = np.arange(b * h * s * d)
    row = i // d
    c = ((row // s) % h) * d + (i - row * d)
    want = np.broadcast_to(np.arange(h * d).reshape(1, h, 1, d), shape).reshape(-1)
    np.testing.assert_array_equal(c, want)
    from entropykit.predictive.cuda import groupparams
    assert "((row / seq) % heads) * dim + (int)(i - row * dim)" in groupparams._SRC
