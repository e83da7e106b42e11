"""The package's one thread pool: nested calls share the outer call's threads (no nested
pools), a segment's frame chunks run on every thread, the thread count is honoured (the
``threads`` argument, ``ENTROPYKIT_THREADS``), errors come back in item order, the work
split into parts (histograms, a segment's join) gives exactly the one-pass result, and
the bytes written do not depend on the thread count."""

from __future__ import annotations

import hashlib
import io
import threading
import time

import ml_dtypes
import numpy as np
import pytest
from test_container import all_dtypes

from entropykit.api import tensor_source
from entropykit.coding import contexts, lines, parallel
from entropykit.container import order0, segment, writer
from entropykit.container.reader import Compressed


def _leaves(outer: int, inner: int, threads: int) -> tuple[int, set[int]]:
    """Outer items each running ``inner`` nested items (sleeping, so calls overlap):
    the most leaves that ran at once, and the threads that ran them."""
    lock = threading.Lock()
    state = {"now": 0, "most": 0}
    idents: set[int] = set()

    def leaf(_: int) -> None:
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
            idents.add(threading.get_ident())
        time.sleep(0.02)
        with lock:
            state["now"] -= 1

    def item(_: int) -> int:
        return len(parallel.run(leaf, inner, threads))

    assert list(parallel.imap(item, range(outer), threads)) == [inner] * outer
    return state["most"], idents


def test_nested_calls_run_on_the_outer_calls_threads() -> None:
    most, idents = _leaves(outer=3, inner=6, threads=2)
    assert most <= 2 and len(idents) <= 2  # nested pools would run 2 x 2 at once
    assert threading.get_ident() not in idents


def test_nested_calls_inside_one_thread_stay_inline() -> None:
    most, idents = _leaves(outer=2, inner=4, threads=1)
    assert most == 1 and idents == {threading.get_ident()}


def test_errors_come_back_in_item_order_and_stop_the_rest() -> None:
    started: list[int] = []

    def fn(i: int) -> int:
        started.append(i)
        if i in (3, 5):
            raise KeyError(i)
        return i

    with pytest.raises(KeyError) as e:
        list(parallel.imap(fn, range(40), 2))
    assert e.value.args == (3,)
    assert max(started) < 40  # queued items were cancelled

    def outer(_: int) -> list[int]:
        return parallel.run(fn, 40, 2)

    with pytest.raises(KeyError) as e:
        parallel.run(outer, 2, 2)
    assert e.value.args == (3,)


def test_a_segments_chunks_run_on_every_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    # One segment of several rANS chunks: both threads must code its chunks together (each
    # waits for the other), where a segment used to code its chunks on its own thread.
    meet = threading.Barrier(2, timeout=20)
    encode = order0._chunks
    calls = []

    def chunks(*args, **kwargs):
        calls.append(threading.get_ident())
        if len(calls) <= 2:
            meet.wait()
        return encode(*args, **kwargs)

    monkeypatch.setattr(order0, "_chunks", chunks)
    monkeypatch.setattr(order0, "GROUP", 1)  # a call a chunk: three to share
    x = (np.random.default_rng(0).standard_normal(700_000) * 0.02).astype(ml_dtypes.bfloat16)
    out = io.BytesIO()
    writer.write(tensor_source({"w": x}, None), out, threads=2)
    assert len(set(calls[:2])) == 2
    assert np.array_equal(Compressed(out.getvalue()).tensor("w").view(x.dtype), x)


def _file(fast: bool, threads: int) -> bytes:
    rng = np.random.default_rng(1)
    bf16 = ml_dtypes.bfloat16
    tensors = {
        "emb": (rng.standard_normal((600, 1024)) * 0.05).astype(bf16),  # 3 chunks a field
        "w": (rng.standard_normal((256, 384)) * 0.02).astype(bf16),
        "f": (rng.standard_normal(70_000) * 0.1).astype(np.float32),
        "b": (rng.standard_normal(384) * 0.01).astype(bf16),
        "i": rng.integers(0, 9, 5000).astype(np.int64),
    }
    out = io.BytesIO()
    # Small segments too: many segments of a tensor, each of several chunks.
    writer.write(tensor_source(tensors, None), out, threads=threads, fast=fast,
                 segment_bytes=1 << 20)
    return out.getvalue()


@pytest.mark.parametrize("fast", [False, True])
def test_multi_tensor_file_bytes_do_not_depend_on_threads(fast: bool) -> None:
    files = {n: _file(fast, n) for n in (1, 2, 4)}
    digests = {n: hashlib.sha256(b).hexdigest() for n, b in files.items()}
    assert len(set(digests.values())) == 1, digests
    c = Compressed(files[1])
    assert np.array_equal(c.restored(4), c.restored(1))


def test_env_var_sets_the_default_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(parallel.ENV, "3")
    assert parallel.default_threads() == 3 == parallel.resolve(None)
    assert parallel.resolve(5) == 5  # an explicit count wins
    for bad in ("0", "-2", "two", "1.5"):
        monkeypatch.setenv(parallel.ENV, bad)
        with pytest.raises(ValueError, match=parallel.ENV):
            parallel.default_threads()
    monkeypatch.delenv(parallel.ENV)
    assert parallel.default_threads() >= 1


@pytest.mark.parametrize("cols, phase, n", [(97, 0, 50_000), (97, 41, 50_000),
                                            (5000, 4999, 12_345), (64, 3, 64 * 40 - 3)])
def test_counts_in_parts_equal_one_pass(monkeypatch: pytest.MonkeyPatch, cols: int,
                                        phase: int, n: int) -> None:
    # A large field's histograms are counted in row-aligned parts on the pool's threads;
    # the sums must equal one pass for any split (tiny parts here: many, mid-row start).
    rng = np.random.default_rng(cols + phase)
    sym = rng.integers(0, 40, n).astype(np.uint8)
    ctx = rng.integers(0, 7, n).astype(np.uint8)
    rows = lines.n_rows(n, cols, phase)
    rcls = rng.integers(0, 3, rows).astype(np.uint8)
    ccls = rng.integers(0, 2, cols).astype(np.uint8)
    index, _ = lines.buckets(np.bincount(sym, minlength=256))
    width = int(index.max()) + 1

    def counts() -> list[np.ndarray]:
        hr, hc = lines.line_histograms(sym, index, width, cols, phase)
        return [hr, hc, lines.context_counts(sym, cols, phase, rcls, ccls, 2),
                contexts.joint_histogram(ctx, sym)]

    whole = counts()
    monkeypatch.setattr(contexts, "PART", 300)
    for threads in (1, 2):
        parts = parallel.run(lambda _: counts(), 1, threads)[0]
        for a, b in zip(whole, parts, strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b)


def test_large_segments_join_in_parts_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    # A large segment's fields are joined in parts of whole elements on the pool's
    # threads; every dtype's join must give the original bytes, in place or not.
    packed = io.BytesIO()
    writer.write(tensor_source(all_dtypes(3), None), packed, threads=1)
    c = Compressed(packed.getvalue())
    whole = c.restored(1)
    monkeypatch.setattr(segment, "JOIN_PART", 64)
    assert np.array_equal(c.restored(2), whole)
    assert np.array_equal(c.restored(1), whole)
    for name in c.keys():
        assert np.array_equal(c.tensor(name, threads=2), c.tensor(name))


def test_one_thread_counts_and_joins_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    # Parts exist only to share work: on one thread each pass runs whole (one kernel call,
    # no partial counts to sum), as unsplit code does; on two threads, in parts.
    calls: dict[str, int] = {}

    def counted(module: object, name: str) -> None:
        fn = getattr(module, name)

        def wrapper(*args: object, **kwargs: object) -> object:
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    for module, name in ((contexts, "_joint_histogram"), (lines, "_line_hists"),
                         (lines, "_count"), (segment.formats, "join")):
        counted(module, name)
    monkeypatch.setattr(contexts, "PART", 300)
    monkeypatch.setattr(segment, "JOIN_PART", 64)
    rng = np.random.default_rng(5)
    n, cols = 50_000, 97
    sym = rng.integers(0, 40, n).astype(np.uint8)
    index, _ = lines.buckets(np.bincount(sym, minlength=256))
    rcls = rng.integers(0, 3, lines.n_rows(n, cols, 0)).astype(np.uint8)
    ccls = rng.integers(0, 2, cols).astype(np.uint8)
    done = {"exponent": sym, "sign_mantissa": sym[::-1].copy()}

    def passes(_: int) -> dict[str, int]:
        calls.clear()
        lines.line_histograms(sym, index, int(index.max()) + 1, cols, 0)
        lines.context_counts(sym, cols, 0, rcls, ccls, 2)
        contexts.joint_histogram(sym, sym, 1)
        segment._join("BF16", None, done, [n, n], 2 * n, None)
        return dict(calls)

    one = {"_line_hists": 1, "_count": 1, "_joint_histogram": 1, "join": 1}
    assert passes(0) == one  # outside any call
    assert parallel.run(passes, 1, 1)[0] == one  # inside a call of one thread
    split = list(parallel.imap(passes, [0], 2))[0]
    assert all(split[k] > 1 for k in one), split


def test_grouped_map_runs_small_items_together_in_order() -> None:
    sizes = [5, 1, 1, 8, 2, 2, 2, 2, 1, 9, 1]
    assert list(parallel._groups(range(len(sizes)), sizes.__getitem__, 4)) == [
        [0], [1, 2], [3], [4, 5], [6, 7], [8], [9], [10]]
    units: list[int] = []

    def fn(i: int) -> int:
        units.append(threading.get_ident())
        return i * i

    for threads in (1, 2, 4):
        assert list(parallel.imap_grouped(fn, range(200), threads, lambda _: 1, 7)) == [
            i * i for i in range(200)]

    def fail(i: int) -> int:
        if i in (9, 30):
            raise KeyError(i)
        return i

    with pytest.raises(KeyError) as e:
        list(parallel.imap_grouped(fail, range(100), 2, lambda _: 1, 4))
    assert e.value.args == (9,)


def _tiny_file(threads: int) -> bytes:
    """Many tensors of a few hundred bytes around two of over a megabyte (whose segments
    and chunks run on every thread), as a model's biases and norms sit between its
    matrices."""
    rng = np.random.default_rng(7)
    bf16 = ml_dtypes.bfloat16
    tensors: dict[str, np.ndarray] = {}
    for i in range(48):
        tensors[f"l{i}.bias"] = (rng.standard_normal(384) * 0.01).astype(bf16)
        tensors[f"l{i}.norm"] = (1 + rng.standard_normal(96) * 0.1).astype(np.float32)
        if i in (10, 30):
            tensors[f"l{i}.w"] = (rng.standard_normal((700, 1024)) * 0.02).astype(bf16)
    tensors["steps"] = np.arange(5, dtype=np.int64)
    out = io.BytesIO()
    writer.write(tensor_source(tensors, None), out, threads=threads, segment_bytes=1 << 20)
    return out.getvalue()


def test_small_tensors_share_work_units(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    # One pool item per tiny tensor cost more hand-offs between threads (each holding the
    # GIL) than work; they now run several to an item. Bytes and tensors are the same for
    # every thread count.
    items = []
    execute = parallel._Pool._execute

    def counted(self, b, i):  # noqa: ANN001 - wraps the pool's private method
        items.append(b)
        return execute(self, b, i)

    monkeypatch.setattr(parallel._Pool, "_execute", counted)
    packed = {n: _tiny_file(n) for n in (1, 4)}
    assert packed[1] == packed[4]
    coded = len(items)
    c = Compressed(packed[1])
    restored = {}
    for n in (1, 4):
        items.clear()
        out = io.BytesIO()
        c.restore(out, n)
        restored[n] = (out.getvalue(), len(items))
    assert restored[1][0] == restored[4][0] and restored[1][1] == 0
    path = tmp_path / "t.ek.safetensors"
    path.write_bytes(packed[1])
    from entropykit import load_file

    items.clear()
    loaded = {n: load_file(path, threads=n) for n in (1, 4)}
    assert list(loaded[1]) == list(loaded[4]) == c.keys()
    assert all(loaded[1][k].equal(loaded[4][k]) for k in loaded[1])
    # 97 tensors of under a megabyte between two of 1.4 MB (2 segments each, of a few
    # chunks): a few units and the large ones' chunks, where each segment was a unit.
    assert coded <= 20 and restored[4][1] <= 20 and len(items) <= 20


def test_payload_indexes_are_read_on_the_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    # The thread handing out the jobs does serial work at any thread count; reading and
    # checking each tensor's payload index is done by the worker of its first segment.
    c = Compressed(_tiny_file(1))
    readers: list[int] = []
    fields = Compressed.fields

    def recorded(self: Compressed, name: str, *buf):  # noqa: ANN202 - wraps a method
        readers.append(threading.get_ident())
        return fields(self, name, *buf)

    monkeypatch.setattr(Compressed, "fields", recorded)
    out = io.BytesIO()
    c.restore(out, 2)
    assert len(readers) == len(c.keys())  # once per tensor, however many segments
    assert threading.get_ident() not in readers
    assert out.getvalue() == c.restored(1).tobytes()
