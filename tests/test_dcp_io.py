"""How a rank's shard is written and read: raw fields checksummed once and written
without a join copy, a rank's items spread over files written in parallel, loads decoded
straight into the planner's tensors. (Round trips and failure behaviour: test_dcp.py.)"""

from __future__ import annotations

import io

import numpy as np
import pytest

from entropykit.api import tensor_source
from entropykit.container import codecs, order0, payload
from entropykit.container.reader import Compressed
from entropykit.container.writer import write


def test_raw_fields_are_read_once_by_the_crcs_and_never_joined(monkeypatch):
    # Random bytes: every field is stored raw. Its CRC is taken once (the field's own);
    # the position CRC comes from it, and the payload is written in pieces.
    data = np.random.default_rng(1).integers(0, 256, 3 << 20).astype(np.uint8)
    crcd = []

    def counting(real):
        def crc(buf, value=0):
            crcd.append(memoryview(buf).nbytes)
            return real(buf, value)
        return crc

    monkeypatch.setattr(codecs, "crc32", counting(codecs.crc32))
    monkeypatch.setattr(payload, "crc32", counting(payload.crc32))
    code = order0.code

    def choice(symbols, *args):  # the policy's kernel takes a raw field's CRC itself
        got = code(symbols, *args)
        if got[0] in (order0.RAW, order0.NO_BID):
            crcd.append(symbols.nbytes)
        return got

    monkeypatch.setattr(order0, "code", choice)
    writes = []

    class Out(io.BytesIO):
        def write(self, b):
            writes.append(memoryview(b).nbytes)
            return super().write(b)

        def writelines(self, lines):  # a segment's payloads come at once
            for b in lines:
                self.write(b)

    out = Out()
    write(tensor_source({"x": data}, None), out, threads=1, fast=True, segment_bytes=1 << 20)
    # Each byte once (old: twice), and each field's 4-byte CRC in its position CRC.
    assert data.size <= sum(crcd) <= data.size + 4 * 3
    assert max(writes) == 1 << 20  # the symbols as they are, not joined to their CRC
    got = Compressed(out.getvalue()).tensor("x")
    assert np.array_equal(got, data)


def test_stored_payload_crc_equals_the_joined_bytes_crc():
    from entropykit.coding.crc32 import crc32

    sym = np.random.default_rng(2).integers(0, 256, 100_003).astype(np.uint8)
    s = codecs.RAW.stored(sym)
    joined = codecs.RAW.encode(sym, None, 0, 0, None)
    assert s.joined() == joined and len(s) == len(joined)
    for seed in (0, 1, 0xFFFFFFFF, 0x12345678):
        assert s.crc32(seed) == crc32(joined, seed)
    assert payload.field_crc(s, "t", 3, 1) == payload.field_crc(joined, "t", 3, 1)


@pytest.mark.parametrize("n", [0, 1, 7, 4096, 1 << 20])
def test_crc32_combine_is_zlibs(n):
    import zlib

    from entropykit.coding.crc32 import crc32_combine

    g = np.random.default_rng(n)
    a, b = g.bytes(13), g.bytes(n)
    for seed in (0, 0xDEADBEEF):
        assert crc32_combine(zlib.crc32(a, seed), zlib.crc32(b), n) == zlib.crc32(a + b, seed)


# -- a rank's files, and loads into the planner's tensors (one process, no_dist) -------

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")
ekdcp = pytest.importorskip("entropykit.dcp")


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    sd = {f"w{i}": (torch.randn(64, 256 + 8 * i, generator=g) * 0.02).to(dt)
          for i, dt in enumerate([torch.float32, torch.bfloat16] * 3)}
    sd["fp8"] = torch.randn(33, 65, generator=g).to(torch.float8_e4m3fn)
    sd["scalar"] = torch.tensor(3.5)
    sd["step"] = 17
    return sd


def _zeros(sd: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0
            for k, v in sd.items()}


def _equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
               if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def _saved(path, **writer) -> dict:
    """``_state()``, saved at ``path`` by one process (``writer``: the writer's options)."""
    sd = _state()
    dcp.save(sd, storage_writer=ekdcp.CompressedStorageWriter(path, **writer), no_dist=True)
    return sd


def _loads_back(path, sd: dict) -> None:
    """``sd`` loaded from the checkpoint at ``path`` into zeros is ``sd``, bit for bit."""
    got = _zeros(sd)
    dcp.load(got, storage_reader=ekdcp.CompressedStorageReader(path), no_dist=True)
    assert _equal(sd, got)


class _Counting(ekdcp.CompressedStorageWriter):
    """Counts the shard files open at once (coding, or coded and waiting to be closed);
    ``fail`` names one that fails, ``at`` says where: on opening, or on closing once
    its data is all written."""

    def __init__(self, *a, fail: str | None = None, at: str = "open", **kw) -> None:
        super().__init__(*a, **kw)
        import threading

        self.lock, self.now, self.most = threading.Lock(), 0, 0
        self.fail, self.at = fail, at

    def _shard_output(self, path):
        import contextlib

        failing = bool(self.fail) and path.name.endswith(self.fail)

        @contextlib.contextmanager
        def counted():
            with self.lock:
                self.now += 1
                self.most = max(self.most, self.now)
            try:
                if failing and self.at == "open":
                    raise OSError("disk full")
                with super(_Counting, self)._shard_output(path) as out:
                    yield out
                    if failing:
                        raise OSError("disk full")
            finally:
                with self.lock:
                    self.now -= 1
        return counted()


class _Coding:
    """Every shard file's coding (``write``), recorded: (file's sharding record, coding
    threads) in the order begun, and the most files coded at once (each held a while,
    so that files meant to overlap do, on a busy machine too)."""

    def __init__(self, monkeypatch) -> None:
        import threading
        import time

        self.calls: list[tuple[str, int]] = []
        self.lock, self.now, self.most = threading.Lock(), 0, 0
        real = ekdcp.write

        def recording(source, out, *, threads, **kw):
            with self.lock:
                self.calls.append((source.header.metadata[ekdcp.SHARDING_KEY], threads))
                self.now += 1
                self.most = max(self.most, self.now)
            try:
                time.sleep(0.2)
                return real(source, out, threads=threads, **kw)
            finally:
                with self.lock:
                    self.now -= 1

        monkeypatch.setattr(ekdcp, "write", recording)


def test_a_rank_writes_its_files_at_once_one_coding_thread_each(tmp_path, monkeypatch):
    monkeypatch.setattr(ekdcp, "PART_BYTES", 40_000)
    coding = _Coding(monkeypatch)
    sd = _state()
    w = _Counting(tmp_path, threads=8)
    dcp.save(sd, storage_writer=w, no_dist=True)
    shards = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("shard-"))
    # Items in order, a file begun before one would pass 40 000 bytes: 6 tensors of
    # 32-66 KB each alone, fp8 + scalar + step together.
    assert len(shards) == 7 and all(ekdcp._SHARD.fullmatch(n) for n in shards)
    assert coding.most == w.most == 7  # 8 threads: every file at once
    assert [t for _, t in coding.calls] == [1] * 7
    _loads_back(tmp_path, sd)
    # Same state, other thread counts: the same files, byte for byte; 3 coded at once,
    # or one after another, the largest (w4: fp32, 64 x 288) first; open at once: those
    # and at most as many coded ones waiting to be closed.
    before = {n: (tmp_path / n).read_bytes() for n in shards}
    for threads in (3, 1):
        coding.calls.clear()
        coding.most = 0
        w = _Counting(tmp_path, threads=threads)
        dcp.save(sd, storage_writer=w, no_dist=True)
        after = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("shard-"))
        assert len(after) == 7 and [(tmp_path / n).read_bytes() for n in after] == list(
            before.values())
        assert coding.most == threads and threads <= w.most <= 2 * threads
    assert '"w4"' in coding.calls[0][0] and '"w2"' in coding.calls[1][0]


def test_a_coded_file_is_closed_while_the_next_one_codes(tmp_path, monkeypatch):
    # One coding thread, a slow close (the tail of the writes, fsync, rename): the next
    # file's coding begins before the previous file is closed (old: after).
    import contextlib
    import time

    monkeypatch.setattr(ekdcp, "PART_BYTES", 40_000)
    events: list[str] = []
    real = ekdcp.write

    def coding(source, out, **kw):
        events.append("code")
        return real(source, out, **kw)

    monkeypatch.setattr(ekdcp, "write", coding)

    class SlowClose(ekdcp.CompressedStorageWriter):
        def _shard_output(self, path):
            @contextlib.contextmanager
            def slow():
                with super(SlowClose, self)._shard_output(path) as out:
                    yield out
                    time.sleep(0.3)
                events.append("closed")
            return slow()

    sd = _state()
    dcp.save(sd, storage_writer=SlowClose(tmp_path, threads=1), no_dist=True)
    assert events.count("code") == events.count("closed") == 7
    assert events[:2] == ["code", "code"]
    _loads_back(tmp_path, sd)


def test_a_rank_spreads_its_items_over_files_per_rank(tmp_path, monkeypatch):
    # 4 KiB segments; 3 MiB of items: files of 3 MiB / 16 (old: one file up to 32 MiB).
    monkeypatch.setattr(ekdcp, "SEGMENT_BYTES", 4096)
    g = torch.Generator().manual_seed(4)
    sd = {f"t{i:02d}": torch.randn(256, 128, generator=g).to(torch.bfloat16)
          for i in range(32)}  # 64 KiB each
    sd["big"] = torch.randn(1024, 256, generator=g)  # 1 MiB of fp32: a file of its own
    calls = _Coding(monkeypatch).calls
    dcp.save(sd, storage_writer=ekdcp.CompressedStorageWriter(tmp_path, threads=4),
             no_dist=True)
    shards = [p.name for p in tmp_path.iterdir() if p.name.startswith("shard-")]
    assert len(shards) == 12 == len(calls)  # 11 of three 64 KiB tensors or less, "big"
    assert ekdcp._part_bytes(3 << 20) == (3 << 20) // 16
    # "big" holds a third of the bytes: a third of the threads (of 4: one, as the rest).
    assert [t for _, t in calls] == [1] * 12
    calls.clear()
    dcp.save(sd, storage_writer=ekdcp.CompressedStorageWriter(tmp_path, threads=9),
             no_dist=True)
    assert sorted(t for _, t in calls) == [1] * 11 + [3]
    assert [t for k, t in calls if '"big"' in k] == [3]
    got = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(got, storage_reader=ekdcp.CompressedStorageReader(tmp_path), no_dist=True)
    assert _equal(sd, got)


@pytest.mark.parametrize("at, threads", [("open", 8), ("close", 8), ("close", 1)])
def test_a_failing_file_of_a_rank_leaves_no_checkpoint_and_the_old_one_whole(
        tmp_path, monkeypatch, at, threads):
    # A file that fails on opening, or on closing (in the closing thread, after its
    # coding thread went on): the save fails, no temporary is left, the old checkpoint
    # loads whole.
    monkeypatch.setattr(ekdcp, "PART_BYTES", 40_000)
    old = _state()
    dcp.save(old, storage_writer=ekdcp.CompressedStorageWriter(tmp_path, threads=8),
             no_dist=True)
    new = {k: v + 1 if isinstance(v, torch.Tensor) and v.dtype != torch.float8_e4m3fn
           else v for k, v in old.items()}
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException):
        dcp.save(new, storage_writer=_Counting(tmp_path, threads=threads, at=at,
                                                  fail="-0003.safetensors"),
                 no_dist=True)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".ek-tmp")]
    _loads_back(tmp_path, old)


def test_whole_chunks_load_straight_into_their_tensors(tmp_path, monkeypatch):
    # Segments of 4 KiB: tensors of several segments each.
    monkeypatch.setattr(ekdcp, "SEGMENT_BYTES", 4096)
    sd = _saved(tmp_path, threads=2)
    calls = []
    real = ekdcp._piece
    monkeypatch.setattr(ekdcp, "_piece", lambda *a: calls.append(a[1]) or real(*a))
    got = _zeros(sd)
    ptrs = {k: v.data_ptr() for k, v in got.items() if isinstance(v, torch.Tensor)}
    dcp.load(got, storage_reader=ekdcp.CompressedStorageReader(tmp_path, threads=2),
             no_dist=True)
    assert _equal(sd, got) and calls == []  # no piece decoded apart and copied
    assert ptrs == {k: v.data_ptr() for k, v in got.items() if isinstance(v, torch.Tensor)}
    # A target that is not contiguous (or of another dtype) still loads, through a copy.
    t = torch.zeros(256, 64).t()
    got = {"w0": t}
    dcp.load(got, storage_reader=ekdcp.CompressedStorageReader(tmp_path), no_dist=True)
    assert torch.equal(got["w0"], sd["w0"]) and calls == ["w0"]


@pytest.mark.parametrize("offsets, lengths", [
    ((0, 0), (40, 70)), ((3, 0), (20, 70)), ((5, 0), (1, 70)), ((7, 9), (1, 30)),
    ((39, 69), (1, 1)), ((2, 5), (30, 20)), ((0, 3), (40, 1)), ((11, 0), (0, 70))])
def test_a_piece_decodes_into_its_target_exactly(offsets, lengths):
    # Segments of 512 bytes (64 bf16 elements, less than a row): pieces start and end
    # inside segments, or span whole ones.
    g = torch.Generator().manual_seed(5)
    chunk = torch.randn(40, 70, generator=g).to(torch.bfloat16)
    buf = io.BytesIO()
    write(tensor_source({"c": chunk}, None), buf, threads=1, fast=True, segment_bytes=512)
    c = Compressed(buf.getvalue())
    want = chunk[tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))]
    for threads in (1, 3):
        target = torch.full(lengths, 7.0, dtype=torch.bfloat16)
        ekdcp._into(c, "c", "BF16", (40, 70), offsets, lengths, target, threads)
        assert torch.equal(target.view(torch.int16), want.view(torch.int16))


def test_span_into_refuses_a_range_outside_the_tensor():
    buf = io.BytesIO()
    write(tensor_source({"c": np.zeros(100, np.uint8)}, None), buf, threads=1)
    c = Compressed(buf.getvalue())
    with pytest.raises(ValueError, match="bytes"):
        c.span_into("c", 90, 101, np.empty(11, np.uint8))
    with pytest.raises(ValueError, match="bytes"):
        c.span_into("c", 0, 10, np.empty(9, np.uint8))


# -- the write-behind thread: queued writes in one writev ------------------------------

def test_queued_writes_go_out_in_few_writev_calls_even_when_short(tmp_path, monkeypatch):
    import os
    import threading

    from entropykit.container import _atomic

    gate = threading.Event()
    calls = []
    real = os.writev

    def writev(fd, bufs):
        gate.wait(30)  # the writer thread waits here while the caller queues the rest
        calls.append(len(bufs))
        room, part = 5000, []  # a short write: at most 5000 bytes, often mid-buffer
        for b in bufs:
            part.append(memoryview(b)[:room])
            room -= part[-1].nbytes
            if not room:
                break
        return real(fd, part)

    monkeypatch.setattr(os, "writev", writev)
    want = b"".join(bytes([i % 251]) * (100 + i) for i in range(300))
    with _atomic.output_file(tmp_path / "o.bin") as out:
        at = 0
        for i in range(300):
            n = 100 + i
            out.write(memoryview(want)[at : at + n])
            at += n
        gate.set()
    assert (tmp_path / "o.bin").read_bytes() == want
    # 300 writes of 74 850 bytes: calls of many buffers (short writes taken up again).
    assert 15 <= len(calls) < 40 and max(calls) > 100


def test_a_killed_saves_shard_temporaries_go_with_the_next_save(tmp_path):
    # A killed save leaves its shards' temporaries under names no later save writes
    # (each save's shards have their own), so the next save removes those proven stale
    # (old, unlocked) and keeps what is not stale or not a shard's (old: all kept).
    import os
    import time

    sd = _saved(tmp_path, threads=2)
    old = time.time() - 3600
    stale = tmp_path / ".shard-0123456789ab-00000-0001.safetensors.abcd1234.ek-tmp"
    running = tmp_path / ".shard-0123456789ab-00001.safetensors.abcd1234.ek-tmp"
    other = tmp_path / ".notes.txt.abcd1234.ek-tmp"
    for p in (stale, running, other):
        p.write_bytes(b"partial")
    for p in (stale, other):
        os.utime(p, (old, old))
    dcp.save(sd, storage_writer=ekdcp.CompressedStorageWriter(tmp_path, threads=2),
             no_dist=True)
    assert not stale.exists() and running.exists() and other.exists()
    _loads_back(tmp_path, sd)


def test_a_rank_with_many_files_lists_the_directory_a_fixed_number_of_times(
        tmp_path, monkeypatch):
    # 40 files of one item each: the temporaries are swept once in ``finish``, not once
    # per file (old: a listing of the checkpoint directory per shard file, so a rank's
    # save cost files^2 name checks).
    import os

    monkeypatch.setattr(ekdcp, "PART_BYTES", 8)
    monkeypatch.setattr(ekdcp, "SEGMENT_BYTES", 8)
    g = torch.Generator().manual_seed(5)
    sd = {f"t{i:02d}": torch.randn(8, 16, generator=g) for i in range(40)}
    listings = []
    real_listdir, real_scandir = os.listdir, os.scandir
    monkeypatch.setattr(os, "listdir", lambda d=".": (listings.append(d), real_listdir(d))[1])
    monkeypatch.setattr(os, "scandir", lambda d=".": (listings.append(d), real_scandir(d))[1])
    dcp.save(sd, storage_writer=ekdcp.CompressedStorageWriter(tmp_path, threads=2),
             no_dist=True)
    shards = [n for n in real_listdir(tmp_path) if n.startswith("shard-")]
    assert len(shards) == 40
    assert len(listings) <= 4
    got = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(got, storage_reader=ekdcp.CompressedStorageReader(tmp_path), no_dist=True)
    assert _equal(sd, got)


def test_a_reader_takes_chunk_shapes_from_its_own_read_or_from_given_metadata(tmp_path):
    # Each rank reads the metadata itself: the chunks' dtypes and shapes come from the
    # layout it parsed; metadata from elsewhere (another reader's) gives the same.
    sd = _saved(tmp_path)
    own = ekdcp.CompressedStorageReader(tmp_path)
    own.set_up_storage_reader(own.read_metadata(), True)
    other = ekdcp.CompressedStorageReader(tmp_path)
    other.set_up_storage_reader(ekdcp.CompressedStorageReader(tmp_path).read_metadata(), True)
    assert own._chunks == other._chunks and len(own._chunks) == 8
    assert own._chunks[("w1", (0, 0))] == ("BF16", (64, 264))
    _loads_back(tmp_path, sd)


def test_a_load_opens_each_shard_on_the_pool_as_its_items_come(tmp_path, monkeypatch):
    # 7 files: each opened (its header parsed) by the pool thread that first needs it,
    # once, while earlier files' items decode (old: every file opened, one after another
    # on the calling thread, before the first item was decoded).
    import threading

    monkeypatch.setattr(ekdcp, "PART_BYTES", 40_000)
    sd = _saved(tmp_path, threads=2)
    events, lock = [], threading.Lock()
    real_opened, real_into = ekdcp.files.opened, ekdcp._into

    def opened(path):
        with lock:
            events.append(("open", path.name, threading.get_ident()))
        return real_opened(path)

    def into(c, key, *a):
        with lock:
            events.append(("decode", key, threading.get_ident()))
        return real_into(c, key, *a)

    monkeypatch.setattr(ekdcp.files, "opened", opened)
    monkeypatch.setattr(ekdcp, "_into", into)
    got = _zeros(sd)
    dcp.load(got, storage_reader=ekdcp.CompressedStorageReader(tmp_path, threads=2),
             no_dist=True)
    assert _equal(sd, got)
    opens = [e for e in events if e[0] == "open" and e[1].startswith("shard-")]
    assert len(opens) == len({e[1] for e in opens}) == 7
    first_decode = next(i for i, e in enumerate(events) if e[0] == "decode")
    assert any(i > first_decode for i, e in enumerate(events) if e in opens)
    assert threading.get_ident() not in {e[2] for e in opens}


def test_a_ranks_saves_code_and_close_on_threads_kept_from_save_to_save(tmp_path,
                                                                          monkeypatch):
    # 7 files, 3 coded at once: the coding, closing and writer threads come from the
    # output pool, so once earlier saves left it idle threads a save starts none (old:
    # a coding and a closing executor per save, each starting its threads).
    import threading

    monkeypatch.setattr(ekdcp, "PART_BYTES", 40_000)
    sd = _state()
    started = []
    real = threading.Thread.start

    def counted(self) -> None:
        started.append(self.name)
        real(self)

    monkeypatch.setattr(threading.Thread, "start", counted)
    for i in range(4):
        started.clear()
        dcp.save(sd, storage_writer=ekdcp.CompressedStorageWriter(tmp_path / str(i),
                                                                  threads=3), no_dist=True)
    assert len(started) <= 1, started  # a close may outlast the next file's coding
    _loads_back(tmp_path / "3", sd)


def _codecs(path) -> dict[str, dict[str, set[tuple[str, int]]]]:
    """Per shard tensor, per field: the (codec, symbols) of each segment."""
    out: dict[str, dict[str, set[tuple[str, int]]]] = {}
    for p in sorted(path.iterdir()):
        if not p.name.startswith("shard-"):
            continue
        c = Compressed(p.read_bytes())
        for name, rec in c.record.tensors.items():
            bounds = c.bounds(c.entry(name))
            fields = out.setdefault(name, {})
            for (lo, hi), coded in zip(bounds, rec.codecs, strict=True):
                symbols = (hi - lo) * 8 // _BITS[rec.dtype]
                for (field, _), codec in zip(rec.fields, coded, strict=True):
                    fields.setdefault(field, set()).add((codec, symbols))
    return out


_BITS = {"F32": 32, "BF16": 16, "U8": 8, "F8_E4M3": 8}


def test_the_writer_codes_float_fields_order_0_with_tans_and_tries_zstd_on_small_ones(
        tmp_path):
    # A checkpoint writer's policy: the exponent and a sign-free mantissa byte (optimizer
    # second moments) coded by tANS, which takes no context (main: rANS, the mantissa byte
    # conditioned on the exponent); zstd tried on fields of at most 4096 symbols only;
    # the low mantissa bytes raw.
    g = torch.Generator().manual_seed(5)
    w = torch.randn(512, 1024, generator=g) * 0.02
    sd = {"master": w, "exp_avg_sq": (w * w).contiguous(), "bf16": w.to(torch.bfloat16),
          "small": w[:4, :1000].contiguous(), "mid": w[:8, :1024].contiguous()}
    dcp.save(sd, storage_writer=ekdcp.CompressedStorageWriter(tmp_path, threads=2),
             no_dist=True)
    got = _codecs(tmp_path)
    big = 512 * 1024
    assert got["master"] == {"exponent": {("tans", big)}, "sign_mantissa": {("raw", big)},
                             "byte1": {("raw", big)}, "byte0": {("raw", big)}}
    assert got["exp_avg_sq"]["sign_mantissa"] == {("tans", big)}
    assert got["bf16"] == {"exponent": {("tans", big)}, "sign_mantissa": {("raw", big)}}
    assert {c for c, _ in got["small"]["exponent"]} <= {"tans", "zstd"}
    assert got["mid"]["exponent"] == {("tans", 8 * 1024)}
    assert not any(c == "zstd" and n > codecs.CHECKPOINT.zstd_limit
                   for fields in got.values() for segs in fields.values() for c, n in segs)
    _loads_back(tmp_path, sd)


@pytest.mark.parametrize("dtype", ["F32", "BF16", "F16", "F64", "I32", "U16", "I64"])
def test_the_checkpoint_policy_codes_a_segments_planes_in_one_call_as_field_by_field(dtype):
    # One kernel call splits and judges every plane; each plane's codec and payload are
    # what ``codecs.choose`` gives it field by field (the split and the policy's choice).
    from entropykit import formats
    from entropykit.container import segment
    from entropykit.dtypes import BITS, NUMPY

    rng = np.random.default_rng(len(dtype))
    word = BITS[dtype] // 8
    split = segment.Split.of(dtype, None, BITS[dtype])
    calls = []
    real = order0._code_planes

    def counted(*args):
        calls.append(args[0].size)
        return real(*args)

    values = {"weights": lambda n: rng.standard_normal(n) * 0.02,
              "squares": lambda n: (rng.standard_normal(n) * 0.02) ** 2,
              "few": lambda n: rng.integers(0, 3, n).astype(np.float64),
              "bits": lambda n: rng.integers(0, 256, n * word).astype(np.uint8)}
    for kind, make in values.items():
        for n in (1, 3, 4095, 4097, 16383, 16384, 70_000):
            x = make(n)
            raw = (x if kind == "bits" else x.astype(NUMPY[dtype])).view(np.uint8)[: n * word]
            calls.clear()
            order0._code_planes = counted
            try:
                got = segment.encode(dtype, None, raw, split, fast=True,
                                     policy=codecs.CHECKPOINT)
            finally:
                order0._code_planes = real
            assert calls == [n]
            want = [codecs.choose(f.symbols, None, policy=codecs.CHECKPOINT)
                    for f in formats.split(dtype, raw)]
            assert got.fields == split.fields
            assert got.codecs == tuple(c.codec for c in want), (kind, n)
            assert [bytes(codecs.Choice(c, p, 0).blob) for c, p in
                    zip(got.codecs, got.parts, strict=True)] == [c.blob for c in want]
            back = segment.decode(dtype, None, got.fields, got.codecs,
                                  [np.frombuffer(codecs.Choice(c, p, 0).blob, np.uint8)
                                   for c, p in zip(got.codecs, got.parts, strict=True)],
                                  raw.size)
            assert bytes(back) == bytes(raw)


def test_a_frame_on_one_thread_codes_its_chunks_in_one_call(monkeypatch):
    # 3 Mi symbols are 48 chunks, 6 groups of 8: one call on one thread (main: 6), the
    # same bytes as group by group (a function for contexts asks group by group).
    from entropykit.coding import parallel

    monkeypatch.setenv(parallel.ENV, "1")
    sym = np.random.default_rng(1).integers(0, 7, 3 << 20).astype(np.uint8)
    counts = np.bincount(sym, minlength=256).astype(np.int64)
    calls = []
    real = order0._chunks

    def counted(*args):
        calls.append(args[0].size)
        return real(*args)

    monkeypatch.setattr(order0, "_chunks", counted)
    one = order0.encode(sym, None, counts, 12, 1 << 16, True)
    assert calls == [sym.size]
    calls.clear()
    ctx = np.zeros(sym.size, np.uint8)
    joint = np.zeros((256, 256), np.int64)
    joint[0] = counts
    grouped = order0.encode(sym, lambda lo, hi: ctx[lo:hi], joint, 12, 1 << 16, False)
    whole = order0.encode(sym, ctx, joint, 12, 1 << 16, False)
    assert calls == [8 << 16] * 6 + [sym.size] and grouped == whole
    assert codecs.decode("tans", np.frombuffer(one, np.uint8), sym.size, None).tobytes() \
        == sym.tobytes()
