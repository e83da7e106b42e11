"""Mutation fuzzing of entropykit's decoders on real artifacts, at bounded cost.

What it is: the harness behind ``tests/test_fuzz.py``. A *target* builds real artifacts
from a seed (compressed files, coder frames, rans2d payloads, distribution frames, KV
blobs) with the decode each must go through; *mutations* damage one (bit flips, byte
sets, truncations, extensions, insertions, splices with another artifact, and structured
edits of header and record fields with their lengths and CRCs recomputed, so the edit
reaches the code behind the checksums). ``campaign`` runs the decode loop in a
subprocess under an address-space limit and reports every case whose decode did not end
in ``CorruptDataError`` or in exactly the original output, took longer than
``TIME_CAP``, grew the peak RSS by more than ``RSS_CAP``, hung or crashed.
What it is not: coverage-guided, and no test of the encoders (they only make inputs).

Each case is reproducible from (target, seed, case):
``python tests/_fuzz.py TARGET SEED CASE [--write FILE]`` prints its mutation and outcome
(and the traceback of a failure).
"""

from __future__ import annotations

import base64
import json
import os
import queue
import re
import resource
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

TIME_CAP = 5.0  # seconds one decode of these small artifacts may take
RSS_CAP = 256 << 20  # peak RSS growth one decode may cause (the artifacts are < 1 MiB)
AS_LIMIT = 3 << 30  # address space of the worker: a runaway allocation is a MemoryError
_START_LIMIT = 300.0  # building the artifacts (and JIT compiling on a cold cache)
_ROOT = Path(__file__).resolve().parent.parent

# Values a structured edit writes into an integer field: boundaries, powers of two and
# sizes no file of these could back.
_EDGES = [0, 1, 2, 3, 7, 8, 31, 32, 33, 255, 256, 1023, 1024, 4096, 65535, 65536,
          1 << 20, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, 1 << 40, 1 << 62,
          (1 << 63) - 1, (1 << 64) - 1]


@dataclass(frozen=True)
class Sample:
    """One artifact, the decode it goes through and what that decode returned."""

    data: bytes
    decode: Callable[[bytes], Any]
    expected: Any
    fields: Callable[[bytes], list[tuple[str, int, int]]] | None = None
    fix: Callable[[bytearray], None] | None = None  # recompute checks after an edit


@dataclass(frozen=True)
class Target:
    samples: list[Sample]
    # target-specific structured edits: (data, rng) -> (new data, description)
    edits: list[Callable[[bytes, np.random.Generator], tuple[bytes, str]]]


# ---- generic mutations ------------------------------------------------------------------

def _flip(b: bytearray, rng: np.random.Generator) -> str:
    bits = [int(rng.integers(len(b) * 8)) for _ in range(int(rng.integers(1, 9)))]
    for bit in bits:
        b[bit // 8] ^= 1 << (bit % 8)
    return f"flip bits {bits}"


def _set(b: bytearray, rng: np.random.Generator) -> str:
    at = [int(rng.integers(len(b))) for _ in range(int(rng.integers(1, 5)))]
    vals = [int(rng.choice([0, 0xFF, 0x7F, 0x80, int(rng.integers(256))])) for _ in at]
    for i, v in zip(at, vals, strict=True):
        b[i] = v
    return f"set bytes {dict(zip(at, vals, strict=True))}"


def _truncate(b: bytearray, rng: np.random.Generator) -> str:
    cut = int(rng.integers(len(b))) if rng.random() < 0.5 else len(b) - int(rng.integers(1, 9))
    del b[max(cut, 0):]
    return f"truncate to {len(b)}"


def _extend(b: bytearray, rng: np.random.Generator) -> str:
    k = int(rng.choice([1, 8, 64, 4096]))
    b += bytes(k) if rng.random() < 0.5 else rng.bytes(k)
    return f"append {k} bytes"


def _insert_delete(b: bytearray, rng: np.random.Generator) -> str:
    at, k = int(rng.integers(len(b))), int(rng.integers(1, 17))
    if rng.random() < 0.5:
        b[at:at] = rng.bytes(k)
        return f"insert {k} bytes at {at}"
    del b[at : at + k]
    return f"delete {k} bytes at {at}"


_GENERIC = [_flip, _set, _truncate, _extend, _insert_delete]


def _splice(a: bytes, donor: bytes, rng: np.random.Generator) -> tuple[bytes, str]:
    i, j = int(rng.integers(len(a) + 1)), int(rng.integers(len(donor) + 1))
    if rng.random() < 0.5:
        return a[:i] + donor[j:], f"splice a[:{i}] + donor[{j}:]"
    k = int(rng.integers(1, 257))
    return a[:i] + donor[j : j + k] + a[i + k :], f"overwrite {k} bytes at {i} from donor {j}"


def edit_field(data: bytes, fields: list[tuple[str, int, int]], rng: np.random.Generator,
               fix: Callable[[bytearray], None] | None = None) -> tuple[bytes, str]:
    """Set one to three little-endian integer fields ``(name, offset, size)`` each to an
    edge value, a neighbour of its own or a random one, then ``fix`` the checks that
    cover them. (Several at once: a hostile size must often get past another field's
    check first, e.g. a column count past the column map's presence.)"""
    b = bytearray(data)
    done = []
    for _ in range(int(rng.choice([1, 1, 2, 3]))):
        name, off, size = fields[int(rng.integers(len(fields)))]
        if off + size > len(b):
            continue
        old = int.from_bytes(b[off : off + size], "little")
        top = (1 << (8 * size)) - 1
        pick = rng.random()
        if pick < 0.5:
            new = int(rng.choice([v for v in _EDGES if v <= top]))
        elif pick < 0.8:
            new = old + int(rng.choice([-2, -1, 1, 2, old or 1]))
        else:
            new = int.from_bytes(rng.bytes(size), "little")
        new &= top
        b[off : off + size] = new.to_bytes(size, "little")
        done.append(f"{name} (byte {off}) {old} -> {new}")
    if fix is not None:
        fix(b)
    return bytes(b), "fields " + (", ".join(done) or "beyond the data: unchanged")


def mutate(target: Target, seed: int, case: int) -> tuple[int, bytes, str, bool]:
    """Case ``case`` of ``target``: (sample index, mutated bytes, description, whether an
    accepted decode must give the original output: false for the edits that rewrite a
    checked field consistently, which may make another valid file)."""
    rng = np.random.default_rng([seed, case])
    s = int(rng.integers(len(target.samples)))
    sample = target.samples[s]
    data = sample.data
    pick = rng.random()
    if pick < 0.45 and (target.edits or sample.fields):
        edits = list(target.edits)
        if sample.fields is not None:
            edits.append(lambda d, r: edit_field(d, sample.fields(d), r, sample.fix))
        edit = edits[int(rng.integers(len(edits)))]
        out, what = edit(data, rng)
        return s, out, f"sample {s}: {what}", edit not in _CONSISTENT
    elif pick < 0.55 and len(target.samples) > 1:
        donor = target.samples[(s + 1 + int(rng.integers(len(target.samples) - 1)))
                               % len(target.samples)].data
        out, what = _splice(data, donor, rng)
        # a splice may rebuild another artifact whole (e.g. a frame's head + an empty
        # frame's tail): a valid input, whose own decode is the right answer
        if any(out == t.data for t in target.samples):
            return s, out, f"sample {s}: {what}", False
    else:
        b = bytearray(data)
        what = _GENERIC[int(rng.integers(len(_GENERIC)))](b, rng) if b else _extend(b, rng)
        out = bytes(b)
    return s, out, f"sample {s}: {what}", True


# ---- frames (docs/format.md) ------------------------------------------------------------

def frame_fields(data: bytes, base: int = 0, prefix: str = "frame") -> list[tuple[str, int, int]]:
    """The integer fields of a coder frame at ``base``: header, then its chunk directory."""
    fields = [(f"{prefix}.{n}", base + o, s) for n, o, s in (
        ("version", 4, 1), ("param", 5, 1), ("lanes", 6, 1), ("context_flag", 7, 1),
        ("n", 8, 8), ("chunk_size", 16, 4), ("n_chunks", 20, 4), ("table_len", 24, 4))]
    if len(data) < base + 28:
        return fields
    n_chunks, table_len = struct.unpack_from("<II", data, base + 20)
    d = base + 28 + table_len
    if n_chunks <= 1 << 16 and d + 9 * n_chunks <= len(data):
        for i in range(n_chunks):
            fields += [(f"{prefix}.length[{i}]", d + 4 * i, 4),
                       (f"{prefix}.mode[{i}]", d + 8 * n_chunks + i, 1)]
        if table_len:
            fields.append((f"{prefix}.table[0] (n_present - 1)", base + 28, 1))
    return fields


def dist_fields(data: bytes, base: int = 0) -> list[tuple[str, int, int]]:
    """The integer fields of a distribution-rANS frame (``rans.distribution``)."""
    fields = [(f"dist.{n}", base + o, s) for n, o, s in (
        ("version", 4, 1), ("precision", 5, 1), ("lanes", 6, 1), ("format", 7, 1),
        ("n", 8, 8), ("chunk_size", 16, 4), ("n_chunks", 20, 4), ("fingerprint", 24, 4))]
    if len(data) >= base + 28:
        n_chunks = struct.unpack_from("<I", data, base + 20)[0]
        if n_chunks <= 1 << 16 and base + 28 + 9 * n_chunks <= len(data):
            for i in range(n_chunks):
                fields += [(f"dist.length[{i}]", base + 28 + 4 * i, 4),
                           (f"dist.mode[{i}]", base + 28 + 8 * n_chunks + i, 1)]
    return fields


_CLASSED_HEAD = 32


def classed_fields(data: bytes, base: int = 0) -> list[tuple[str, int, int]]:
    """The fields of a rans2d payload (``container/classed.py``), then its frame's."""
    fields = [(f"rans2d.{n}", base + o, s) for n, o, s in (
        ("version", 4, 1), ("kr", 5, 1), ("kc", 6, 1), ("reserved", 7, 1), ("n", 8, 8),
        ("cols", 16, 8), ("phase", 24, 8))]
    at = data.find(b"EKRA", base + _CLASSED_HEAD)
    return fields + (frame_fields(data, at, "rans2d.frame") if at >= 0 else [])


# ---- the safetensors container ----------------------------------------------------------

def _split(data: bytes) -> tuple[dict, bytes]:
    n = struct.unpack_from("<Q", data)[0]
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _join(header: dict | str, body: bytes) -> bytes:
    text = (header if isinstance(header, str) else json.dumps(header)).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + body


def _payloads(outer: dict, body: bytes) -> dict[str, bytes]:
    return {k: body[v["data_offsets"][0] : v["data_offsets"][1]]
            for k, v in outer.items() if k != "__metadata__"}


def _with_payloads(outer: dict, payloads: dict[str, bytes]) -> bytes:
    """The file with each tensor's payload replaced, offsets and shapes recomputed."""
    outer = json.loads(json.dumps(outer))
    order = sorted(payloads, key=lambda k: outer[k]["data_offsets"][0])
    body, at = b"", 0
    for k in order:
        outer[k]["data_offsets"] = [at, at + len(payloads[k])]
        outer[k]["shape"] = [len(payloads[k])]
        body += payloads[k]
        at += len(payloads[k])
    return _join(outer, body)


def _pick(rng: np.random.Generator, items: list) -> Any:
    return items[int(rng.integers(len(items)))]


def _json_value(rng: np.random.Generator, old: Any) -> Any:
    """A replacement for a JSON value: edges, wrong types, hostile shapes."""
    choices: list[Any] = [None, True, -1, 0, 1.5, "x", [], {}, 10**30, 1 << 40, 1 << 62,
                          [1 << 40], [0] * 50, [[[[[]]]]], "\u00e9" * 3]
    if isinstance(old, int) and not isinstance(old, bool):
        choices += [old + 1, old - 1, old * 2, old // 2, old * 4096, -old]
    if isinstance(old, list):
        choices += [old[::-1], old + old[-1:], old[:-1], [x for x in old for _ in (0, 1)]]
    return _pick(rng, choices)


def _edit_json(obj: Any, rng: np.random.Generator, path: str = "") -> tuple[Any, str]:
    """``obj`` with one value somewhere inside it replaced (a random walk down)."""
    if isinstance(obj, dict) and obj and rng.random() < 0.8:
        key = _pick(rng, list(obj))
        if rng.random() < 0.1:
            out = dict(obj)
            value = out.pop(key)
            out[key + "\u0000" if rng.random() < 0.5 else key.upper()] = value
            return out, f"{path}/{key}: key renamed"
        inner, what = _edit_json(obj[key], rng, f"{path}/{key}")
        return {**obj, key: inner}, what
    if isinstance(obj, list) and obj and rng.random() < 0.7:
        i = int(rng.integers(len(obj)))
        inner, what = _edit_json(obj[i], rng, f"{path}[{i}]")
        return obj[:i] + [inner] + obj[i + 1 :], what
    new = _json_value(rng, obj)
    return new, f"{path}: {json.dumps(obj)[:60]} -> {json.dumps(new)[:60]}"


def _record(outer: dict) -> dict:
    return json.loads(outer["__metadata__"]["entropykit"])


def _with_record(outer: dict, rec: dict | str) -> dict:
    meta = dict(outer["__metadata__"])
    meta["entropykit"] = rec if isinstance(rec, str) else json.dumps(rec)
    return {**outer, "__metadata__": meta}


def _signed(rec: dict) -> str:
    """The text of record ``rec`` (its record_crc32 dropped) signed again as
    docs/format.md states, for an edit that must get past the record checksum."""
    rec = {k: v for k, v in rec.items() if k != "record_crc32"}
    body = json.dumps(rec, separators=(",", ":"), ensure_ascii=False)[:-1]
    return f'{body},"record_crc32":"{zlib.crc32(body.encode()):08x}"}}'


def _original(rec: dict) -> bytes:
    import zstandard

    return zstandard.ZstdDecompressor().decompress(base64.b64decode(rec["header"]))


def _with_original(rec: dict, text: bytes) -> dict:
    import zstandard

    return {**rec, "header": base64.b64encode(zstandard.ZstdCompressor().compress(text)).decode(),
            "header_size": len(text), "header_crc32": zlib.crc32(text)}


def _edit_record(data: bytes, rng: np.random.Generator) -> tuple[bytes, str]:
    outer, body = _split(data)
    rec, what = _edit_json(_record(outer), rng, "record")
    return _join(_with_record(outer, rec), body), what


def _edit_outer(data: bytes, rng: np.random.Generator) -> tuple[bytes, str]:
    outer, body = _split(data)
    tensors = {k: v for k, v in outer.items() if k != "__metadata__"}
    new, what = _edit_json(tensors, rng, "outer")
    if not isinstance(new, dict):
        return data, "outer: unchanged"
    return _join({"__metadata__": outer["__metadata__"], **new}, body), what


def _edit_original(data: bytes, rng: np.random.Generator) -> tuple[bytes, str]:
    """An edit of the original header inside the record, its size and CRC recomputed."""
    outer, body = _split(data)
    rec = _record(outer)
    orig, what = _edit_json(json.loads(_original(rec)), rng, "original")
    text = json.dumps(orig).encode()
    text += b" " * (-len(text) % 8)
    return _join(_with_record(outer, _signed(_with_original(rec, text))), body), what


def _edit_claim(data: bytes, rng: np.random.Generator) -> tuple[bytes, str]:
    """One tensor claims another element count in the record and the original header alike
    (offsets retiled, size and CRC recomputed), and maybe another ``segment_bytes``: the
    checks that pass are the cheap ones, so the sizes reach the code behind them."""
    outer, body = _split(data)
    rec = _record(outer)
    orig = json.loads(_original(rec))
    name = _pick(rng, [k for k in orig if k != "__metadata__"])
    count = int(rng.choice([0, 1, 1 << 20, 1 << 30, 1 << 37, 1 << 40, (1 << 61) - 1]))
    what = f"{name!r} claims {count} elements"
    orig[name]["shape"] = [count]
    rec["tensors"][name]["shape"] = [count]
    at = 0
    for k in sorted((k for k in orig if k != "__metadata__"),
                    key=lambda k: orig[k]["data_offsets"][0]):
        size = orig[k]["data_offsets"][1] - orig[k]["data_offsets"][0]
        if k == name:
            size = count * {"BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I64": 8}.get(
                orig[k]["dtype"], 1)
        orig[k]["data_offsets"] = [at, at + size]
        at += size
    if rng.random() < 0.5:
        rec["segment_bytes"] = int(rng.choice([8, 64, 1 << 32, 1 << 40]))
        what += f", segment_bytes {rec['segment_bytes']}"
    text = json.dumps(orig).encode()
    text += b" " * (-len(text) % 8)
    return _join(_with_record(outer, _signed(_with_original(rec, text))), body), what


def constant_frame(n: int, chunk: int = 1 << 26) -> bytes:
    """A valid rANS frame of ``n`` zero symbols in ~130 bytes per ``chunk`` symbols: one
    symbol of frequency 2^12 keeps every state at 2^16 and costs no words."""
    full, last = divmod(n, chunk)
    sizes = [chunk] * full + ([last] if last else [])
    zeros = bytes(1 << 20)
    crcs = {}
    for size in set(sizes):  # the CRC of `size` zero bytes, a MiB at a time
        c = 0
        for at in range(0, size, len(zeros)):
            c = zlib.crc32(zeros[: min(len(zeros), size - at)], c)
        crcs[size] = c
    table = bytes([0, 0, 0x80, 0x20])  # one present symbol, 0, frequency 4096 (LEB128)
    payload = struct.pack("<32I", *[1 << 16] * 32)
    return b"".join([
        struct.pack("<4sBBBBQIII", b"EKRA", 1, 12, 32, 0, n, chunk, len(sizes), len(table)),
        table, struct.pack(f"<{len(sizes)}I", *[len(payload)] * len(sizes)),
        struct.pack(f"<{len(sizes)}I", *[crcs[x] for x in sizes]), bytes(len(sizes)),
        payload * len(sizes)])


def _edit_huge_segment(data: bytes, rng: np.random.Generator) -> tuple[bytes, str]:
    """A consistent file whose U8 tensor is one segment of 2^32 zero bytes or more (a
    few KB of rANS), beyond any segment a writer makes: the reader must refuse the
    segment size before it allocates one."""
    outer, body = _split(data)
    rec = _record(outer)
    orig = json.loads(_original(rec))
    name = "mask"
    count = int(rng.choice([1 << 32, 1 << 33]))
    orig[name]["shape"] = [count]
    at = 0
    for k in sorted((k for k in orig if k != "__metadata__"),
                    key=lambda k: orig[k]["data_offsets"][0]):
        size = count if k == name else orig[k]["data_offsets"][1] - orig[k]["data_offsets"][0]
        orig[k]["data_offsets"] = [at, at + size]
        at += size
    rec["tensors"][name].update(shape=[count], codecs=[["rans"]])
    rec["segment_bytes"] = count
    text = json.dumps(orig).encode()
    text += b" " * (-len(text) % 8)
    payload = _ekt2(name, [constant_frame(count)], 1)
    new = _with_payloads(outer, {**_payloads(outer, body), name: payload})
    outer, body = _split(new)
    return _join(_with_record(outer, _signed(_with_original(rec, text))), body), \
        f"{name!r}: one segment of {count} zero bytes"


def _hostile_json(data: bytes, rng: np.random.Generator) -> tuple[bytes, str]:
    """Deep nesting, huge numbers, duplicate keys and a damaged record key."""
    outer, body = _split(data)
    depth = int(rng.choice([100, 1000, 10000, 100000]))
    nest = "[" * depth + "]" * depth
    name = _pick(rng, [k for k in outer if k != "__metadata__"])
    kind = int(rng.integers(8))
    if kind == 7:
        rec = json.dumps(_record(outer))
        return _join(_with_record(outer, rec[:-1] + ', "x": ' + "9" * 5000 + "}"), body), \
            "record + a number of 5000 digits"
    if kind == 0:
        return _join(json.dumps(outer)[:-1] + f', "x": {nest}}}', body), f"outer + nest {depth}"
    if kind == 1:
        rec = json.dumps(_record(outer))
        return _join(_with_record(outer, rec[:-1] + f', "x": {nest}}}'), body), \
            f"record + nest {depth}"
    if kind == 2:
        rec = _record(outer)
        text = _original(rec)
        orig = text.decode().rstrip()[:-1] + f', "x": {nest}}}'
        return _join(_with_record(outer, _signed(_with_original(rec, orig.encode()))), body), \
            f"original header + nest {depth}"
    if kind == 3:
        rec = json.dumps(_record(outer))
        dup = rec[:-1] + ', "segment_bytes": 8}'
        return _join(_with_record(outer, dup), body), "record: duplicate segment_bytes 8"
    if kind == 4:
        meta = dict(outer["__metadata__"])
        meta[_pick(rng, ["entropykiT", "entropykit ", "Entropykit"])] = meta.pop("entropykit")
        return _join({**outer, "__metadata__": meta}, body), "metadata key renamed"
    if kind == 5:
        return _join({**outer, "__metadata__": None}, body), "__metadata__ null"
    text = json.dumps(outer)
    dup = text[:-1] + f', {json.dumps(name)}: {json.dumps(outer[name])}}}'
    return _join(dup, body), f"outer: duplicate entry {name!r}"


def _ekt2(name: str, blobs: list[bytes], nf: int) -> bytes:
    """An EKT2 tensor payload of tensor ``name`` (``nf`` fields a segment) holding these
    field payloads, their position CRCs computed as docs/format.md states them."""
    crcs = [zlib.crc32(b, zlib.crc32(name.encode() + b"\0" + struct.pack("<II", *divmod(i, nf))))
            for i, b in enumerate(blobs)]
    k = len(blobs)
    return (b"EKT2" + struct.pack(f"<I{k}Q{k}I", k, *map(len, blobs), *crcs)
            + b"".join(blobs))


def _tensor_parts(payload: bytes) -> list[tuple[int, int]]:
    """(offset, length) of each field payload inside a tensor payload (EKT2)."""
    k = struct.unpack_from("<I", payload, 4)[0]
    lengths = struct.unpack_from(f"<{k}Q", payload, 8)
    at, out = 8 + 12 * k, []
    for n in lengths:
        out.append((at, n))
        at += n
    return out


def _swap_parts(payloads: dict[str, bytes], rng: np.random.Generator
                ) -> tuple[dict[str, bytes], str] | None:
    """Two equal-sized, different field payloads (of one tensor or two) swapped, every
    index unchanged: each still passes its own checks, only its position CRC fails; None
    if the file has no such pair."""
    found: dict[int, list[tuple[str, int, bytes]]] = {}
    for name, p in payloads.items():
        for i, (a, n) in enumerate(_tensor_parts(p)):
            found.setdefault(n, []).append((name, i, p[a : a + n]))
    pairs = [(x, y) for group in found.values() for j, x in enumerate(group)
             for y in group[j + 1 :] if x[2] != y[2]]
    if not pairs:
        return None
    (n1, i1, b1), (n2, i2, b2) = _pick(rng, pairs)
    out = dict(payloads)
    for name, i, blob in ((n1, i1, b2), (n2, i2, b1)):
        a, n = _tensor_parts(out[name])[i]
        out[name] = out[name][:a] + blob + out[name][a + n :]
    return out, f"field payload {n1!r}[{i1}] swapped with {n2!r}[{i2}]"


def _edit_payload(data: bytes, rng: np.random.Generator) -> tuple[bytes, str]:
    """An edit inside one tensor payload: its index (lengths, position CRCs), one field
    payload's header (frame, rans2d, raw CRC) or a field payload cut short, each with the
    position CRCs recomputed so the payload's own checks are reached; or two equal-sized
    field payloads swapped (only the position CRCs bind them to their places)."""
    outer, body = _split(data)
    payloads = _payloads(outer, body)
    kind = int(rng.integers(4))
    if kind == 3:
        swapped = _swap_parts(payloads, rng)
        if swapped is not None:
            return _with_payloads(outer, swapped[0]), swapped[1]
        kind = 0
    names = [k for k, v in payloads.items() if len(v) >= 8]
    name = _pick(rng, names)
    p = payloads[name]
    parts = _tensor_parts(p)
    nf = len(_record(outer)["tensors"][name]["fields"])
    blobs = [p[a : a + n] for a, n in parts]
    if kind == 0 or not parts:
        k = len(parts)
        fields = [("ekt2.k", 4, 4)] + [(f"ekt2.length[{i}]", 8 + 8 * i, 8) for i in range(k)] \
            + [(f"ekt2.crc[{i}]", 8 + 8 * k + 4 * i, 4) for i in range(k)]
        new, what = edit_field(p, fields, rng)
    elif kind == 1:
        i = int(rng.integers(len(parts)))
        at, n = parts[i]
        head = p[at : at + 4]
        if head in (b"EKRA", b"EKTA"):
            fields = frame_fields(p, at, f"part[{i}]")
        elif head == b"EK2D":
            fields = classed_fields(p, at)
        else:
            fields = [(f"part[{i}].first_u32", at, 4)]
        edited, what = edit_field(p, fields, rng)
        new = _ekt2(name, [edited[a : a + n] for a, n in parts], nf)
    else:  # one field payload cut short, the index recomputed to match
        i = int(rng.integers(len(blobs)))
        blobs[i] = blobs[i][: int(rng.integers(len(blobs[i]) + 1))]
        what = f"field payload {i} cut to {len(blobs[i])} bytes"
        new = _ekt2(name, blobs, nf)
    return _with_payloads(outer, {**payloads, name: new}), f"tensor {name!r}: {what}"


_CONSISTENT = {_edit_original, _edit_claim, _edit_huge_segment}
CONTAINER_EDITS = [_edit_record, _edit_record, _edit_outer, _edit_original, _edit_claim,
                   _edit_huge_segment, _hostile_json, _edit_payload, _edit_payload]


# ---- targets ----------------------------------------------------------------------------

def _tensors(seed: int) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """Small realistic tensors: row-scaled bf16 (rans2d), fp16, fp32, fp8, ints, edges."""
    import ml_dtypes

    rng = np.random.default_rng(seed)
    w = rng.standard_normal((64, 256)) * np.exp(rng.standard_normal((64, 1)))
    fp8 = (rng.standard_normal((48, 64)) * 0.1).astype(ml_dtypes.float8_e4m3fn)
    return {
        "w.bf16": ("BF16", (64, 256), (w * 0.02).astype(ml_dtypes.bfloat16).tobytes()),
        "w.f16": ("F16", (40, 96), (rng.standard_normal((40, 96)) * 0.05).astype(
            np.float16).tobytes()),
        "w.f32": ("F32", (24, 64), (rng.standard_normal((24, 64)) * 0.1).astype(
            np.float32).tobytes()),
        "w.fp8": ("F8_E4M3", (48, 64), fp8.tobytes()),
        "ids": ("I64", (300,), rng.integers(0, 50, 300).astype(np.int64).tobytes()),
        "mask": ("U8", (2, 700), rng.integers(0, 2, 1400).astype(np.uint8).tobytes()),
        "step": ("I32", (), np.int32(7).tobytes()),
        "empty": ("F32", (0, 4), b""),
    }


def safetensors_bytes(tensors: dict[str, tuple[str, tuple[int, ...], bytes]]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    at = 0
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + len(raw)]}
        at += len(raw)
    return _join(header, b"".join(raw for _, _, raw in tensors.values()))


def _tensor_bytes(loaded: dict[str, Any]) -> list[tuple[str, str, tuple, bytes]]:
    import torch

    return [(k, str(t.dtype), tuple(t.shape),
             t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            for k, t in loaded.items()]


def _file_target(workdir: Path, **options: Any) -> Target:
    import entropykit

    def restore(data: bytes) -> bytes:
        src, dst = workdir / "case.ek.safetensors", workdir / "case.safetensors"
        src.write_bytes(data)
        entropykit.decompress_file(src, dst, force=True, threads=1)
        return dst.read_bytes()

    def load(data: bytes) -> list:
        src = workdir / "case.ek.safetensors"
        src.write_bytes(data)
        return _tensor_bytes(entropykit.load_file(src, threads=1))

    samples = []
    for seed in (0, 1):
        plain = workdir / f"in{seed}.safetensors"
        plain.write_bytes(safetensors_bytes(_tensors(seed)))
        packed = workdir / f"in{seed}.ek.safetensors"
        entropykit.compress_file(plain, packed, threads=1, force=True, **options)
        data = packed.read_bytes()
        samples += [Sample(data, restore, plain.read_bytes()),
                    Sample(data, load, _tensor_bytes(entropykit.load_file(plain)))]
    return Target(samples, CONTAINER_EDITS)


def _symbols(rng: np.random.Generator, n: int, spread: float) -> np.ndarray:
    return np.clip(rng.normal(128, spread, n), 0, 255).astype(np.uint8)


def _coder_target(coder: str) -> Target:
    from entropykit import rans, tans

    rng = np.random.default_rng(3)
    mod = rans if coder == "rans" else tans
    params = [12, 15] if coder == "rans" else [9, 12]
    key = "precision"
    cases: list[tuple[np.ndarray, dict, np.ndarray | None]] = [
        (_symbols(rng, 5000, 3), {key: params[0], "chunk_size": 1024}, None),
        (_symbols(rng, 3000, 40), {key: params[1], "chunk_size": 2048}, None),
        # one chunk of uniform bytes is stored raw (mode 1)
        (np.concatenate([_symbols(rng, 1024, 2), rng.integers(0, 256, 1024, dtype=np.uint8)]),
         {"chunk_size": 1024}, None),
        (np.zeros(0, np.uint8), {}, None),
    ]
    if coder == "rans":
        ctx = rng.integers(0, 4, 6000).astype(np.uint8)
        sym = np.where(ctx < 2, _symbols(rng, 6000, 2), _symbols(rng, 6000, 30)).astype(np.uint8)
        cases.append((sym, {"chunk_size": 2048, "context": ctx}, ctx))
    samples = []
    for sym, kw, ctx in cases:
        data = mod.encode(sym, threads=1, **kw)
        kw_dec = {} if ctx is None else {"context": ctx}

        def decode(b: bytes, kw_dec: dict = kw_dec) -> bytes:
            return mod.decode(b, threads=1, **kw_dec).tobytes()

        samples.append(Sample(data, decode, sym.tobytes(), frame_fields))
    return Target(samples, [])


def _classed_target() -> Target:
    from entropykit.container import classed

    rng = np.random.default_rng(4)
    samples = []
    for rows, cols, phase in ((64, 128, 0), (40, 300, 17)):
        spread = np.exp(rng.standard_normal(rows))[:, None] * np.exp(
            rng.standard_normal(cols))[None, :]
        sym = np.clip(128 + rng.standard_normal((rows, cols)) * spread * 4, 0, 255).astype(
            np.uint8).reshape(-1)[phase:]
        p = classed.plan(sym, cols, phase)
        assert p is not None
        data = classed.encode(sym, cols, phase, p, 12)

        def decode(b: bytes, n: int = sym.size) -> bytes:
            return classed.decode(np.frombuffer(b, np.uint8), n).tobytes()

        samples.append(Sample(data, decode, sym.tobytes(), classed_fields))
    return Target(samples, [])


def _dist_target() -> Target:
    import ml_dtypes

    from entropykit.rans import distribution as dist

    rng = np.random.default_rng(5)
    model = dist.gaussian_model()
    samples = []
    for fmt, dtype, n in (("bf16", ml_dtypes.bfloat16, 3000), ("fp8_e4m3",
                                                             ml_dtypes.float8_e4m3fn, 2500)):
        mu = rng.standard_normal(n).astype(np.float32)
        sigma = np.exp(rng.standard_normal(n) * 0.3).astype(np.float32)
        vals = (mu + sigma * rng.standard_normal(n)).astype(dtype)
        bits = vals.view(np.uint16 if dtype == ml_dtypes.bfloat16 else np.uint8)
        data = dist.encode(bits, mu, sigma, model, fmt=fmt, chunk_size=1024, threads=1)

        def decode(b: bytes, mu: np.ndarray = mu, sigma: np.ndarray = sigma) -> bytes:
            return dist.decode(b, mu, sigma, model, threads=1).tobytes()

        samples.append(Sample(data, decode, bits.tobytes(), dist_fields))
    return Target(samples, [])


_VOCAB = 128
_KV_HEADS = {1: struct.Struct("<4sBBBBIIIIIIIIH"), 2: struct.Struct("<4sBBBBIIIIIIH")}
_KV_NAMES = {1: ("version", "format", "model", "reserved", "layers", "batch", "heads", "seq",
                 "dim", "exact", "calibration", "guess_crc", "desc_len"),
             2: ("version", "format", "model", "reserved", "layers", "batch", "seq", "exact",
                 "calibration", "guess_crc", "desc_len")}


def _kv_front(b: bytes) -> tuple[int, int, int, int, int, int]:
    """(version, layers, batch, seq, offset of the ids, offset of the frame lengths) of a
    blob of version 1 (one shape) or 2 (a shape table)."""
    version = 1 if b[4] == 1 else 2
    f = dict(zip(_KV_NAMES[version], _KV_HEADS[version].unpack_from(b)[1:], strict=True))
    table = 0 if version == 1 else 24 * f["layers"]
    ids_at = _KV_HEADS[version].size + f["desc_len"] + table
    scales = 8 * f["layers"] if f["format"] == 3 else 0
    return (version, f["layers"], f["batch"], f["seq"], ids_at,
            ids_at + 4 * f["batch"] * f["seq"] + scales)


def kv_fix(b: bytearray) -> None:
    """Recompute a KV blob's header CRC-32 where its (edited) fields place it."""
    if len(b) < _KV_HEADS[1].size:
        return
    _, layers, _, _, _, lens_at = _kv_front(b)
    end = lens_at + 8 * layers
    if end + 4 <= len(b):
        b[end : end + 4] = struct.pack("<I", zlib.crc32(b[:end]))


def kv_fields(data: bytes) -> list[tuple[str, int, int]]:
    version, layers, _, _, ids_at, lens_at = _kv_front(data)
    head = _KV_HEADS[version]
    sizes = [struct.calcsize(c) for c in head.format[3:]]  # after "<4s"
    offs = [4 + sum(sizes[:i]) for i in range(len(sizes))]
    fields = [(f"kv.{n}", o, s)
              for n, o, s in zip(_KV_NAMES[version], offs, sizes, strict=True)]
    if version == 2:
        table_at = ids_at - 24 * layers
        fields += [(f"kv.shape[{i // 3}].{('heads', 'seq', 'dim')[i % 3]}", table_at + 4 * i, 4)
                   for i in range(6 * layers)]
    return fields + [(f"kv.frame_length[{i}]", lens_at + 4 * i, 4) for i in range(2 * layers)]


def _kv_edit(data: bytes, rng: np.random.Generator) -> tuple[bytes, str]:
    """More tokens claimed and present (random ids), or one frame's header edited; the
    blob's CRC recomputed."""
    version, layers, batch, seq, ids_at, lens_at = _kv_front(data)
    at = ids_at + 4 * batch * seq
    if rng.random() < 0.5:
        extra = int(rng.choice([1, 100, 4000, 60000]))
        ids = rng.integers(0, _VOCAB, batch * extra).astype("<i4").tobytes()  # all valid
        b = bytearray(data[:at] + ids + data[at:])
        struct.pack_into("<I", b, 20 if version == 1 else 16, seq + extra)
        kv_fix(b)
        return bytes(b), f"kv: {extra} more tokens per row"
    lengths = struct.unpack_from(f"<{2 * layers}I", data, lens_at)
    g = int(rng.integers(len(lengths)))
    start = lens_at + 8 * layers + 4 + sum(lengths[:g])
    new, what = edit_field(data, dist_fields(data, start), rng)
    return new, f"kv frame {g}: {what}"


def _kv_target() -> Target:
    import torch
    import transformers

    from entropykit import predictive as P

    torch.set_num_threads(1)  # the predictor's guess (and its CRC) depends on threads
    cfg = transformers.LlamaConfig(
        vocab_size=_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1 << 15)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, _VOCAB, (64,), generator=gen) for _ in range(2)]
    ids = torch.randint(0, _VOCAB, (1, 24), generator=gen)
    with torch.inference_mode():
        cache = P.from_transformers(model(ids, use_cache=True).past_key_values)
    samples = []
    for pred, kind, fp8 in ((P.FP8Predictor(model), "conditional", False),
                            (P.NoPredictor(), "gaussian", True)):
        cal = P.calibrate(model, pred, prompts)
        c = P.to_fp8(cache) if fp8 else cache
        data = P.compress_kv(c, ids, pred, cal, model=kind, threads=1)

        def decode(b: bytes, pred: Any = pred, cal: Any = cal) -> list:
            out = P.decompress_kv(b, pred, cal, threads=1)
            return _kv_values(out)

        samples.append(Sample(data, decode, _kv_values(c), kv_fields, kv_fix))
    # A sliding-window layer beside a full one: a version-2 blob (a shape table).
    cfg = transformers.MistralConfig(
        vocab_size=_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=1 << 15)
    torch.manual_seed(0)
    sliding = transformers.MistralForCausalLM(cfg).to(torch.bfloat16).eval()
    with torch.inference_mode():
        cache = P.from_transformers(sliding(ids, use_cache=True).past_key_values)
    pred = P.NoPredictor()
    cal = P.calibrate(sliding, pred, prompts, formats=("bf16",))
    data = P.compress_kv(cache, ids, pred, cal, model="conditional", threads=1)
    assert data[4] == 2

    def decode_sliding(b: bytes, cal: Any = cal) -> list:
        return _kv_values(P.decompress_kv(b, P.NoPredictor(), cal, threads=1))

    samples.append(Sample(data, decode_sliding, _kv_values(cache), kv_fields, kv_fix))
    return Target(samples, [_kv_edit])


def _kv_values(c: Any) -> list:
    import torch

    out = [t.contiguous().view(torch.uint8).numpy().tobytes() for t in c.keys + c.values
           if t is not None]
    if c.scales is not None:
        out.append(c.scales.numpy().tobytes())
    return out + [str(c.dtype), c.shapes]


TARGETS: dict[str, Callable[[Path], Target]] = {
    "file": lambda d: _file_target(d),
    "file-fast": lambda d: _file_target(d, fast=True),
    "file-gpu": lambda d: _file_target(d, target="gpu"),
    "rans": lambda d: _coder_target("rans"),
    "tans": lambda d: _coder_target("tans"),
    "rans2d": lambda d: _classed_target(),
    "dist": lambda d: _dist_target(),
    "kv": lambda d: _kv_target(),
}
_SELF_TEST = {"faulty": lambda d: _faulty_target()}


def _faulty_target() -> Target:
    """A decoder with every fault the supervisor must report (for the harness's own
    test): by the mutated input's length mod 8, another exception, wrong output, a
    runaway allocation, a crash, or else a clean rejection."""
    from entropykit import CorruptDataError

    original = bytes(range(64))

    def decode(b: bytes) -> bytes:
        if b == original:
            return b
        fault = len(b) % 8
        if fault == 1:
            raise ValueError("not the right type")
        if fault == 2:
            return b
        if fault == 3:
            return np.ones(AS_LIMIT, np.uint8).tobytes()
        if fault == 4:
            os.abort()
        raise CorruptDataError("clean")

    return Target([Sample(original, decode, original)], [])


# ---- one case, the worker, the supervisor -----------------------------------------------

def outcome(sample: Sample, data: bytes, exact: bool = True) -> str:
    """"corrupt" (CorruptDataError), "exact" (the original output; with ``exact`` false,
    any output) or what went wrong."""
    from entropykit import CorruptDataError

    try:
        got = sample.decode(data)
    except CorruptDataError:
        return "corrupt"
    except BaseException as e:  # noqa: BLE001 - every other outcome is the finding
        line = (str(e).splitlines() or [""])[0][:200]
        return f"{type(e).__module__}.{type(e).__qualname__}: {line}"
    return "exact" if not exact or got == sample.expected else "WRONG OUTPUT (accepted, differs)"


def _maxrss() -> int:
    """This process's own peak RSS since ``_reset_peak`` (VmHWM: ru_maxrss is inherited
    from the parent across exec, which would hide a decode's growth)."""
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("VmHWM:")) << 10


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _say(**msg: Any) -> None:
    print(json.dumps(msg), flush=True)


def worker(name: str, seed: int, start: int, stop: int, minimum: int, seconds: float) -> None:
    """Cases ``start`` .. ``stop - 1`` (past ``minimum``, only for ``seconds``), one
    JSON line before and after each; exits early after a case that grew RSS past the cap
    (the supervisor restarts it, so the next case is measured from a fresh peak)."""
    with tempfile.TemporaryDirectory() as tmp:
        target = {**TARGETS, **_SELF_TEST}[name](Path(tmp))
        for s in target.samples:  # warm up (JIT) and check that the originals decode
            got = outcome(s, s.data)
            if got != "exact":
                _say(fatal=f"an unmutated sample decodes as: {got}")
                return
        _reset_peak()
        base = _maxrss()
        _say(ready=base)
        deadline = time.time() + seconds
        for case in range(start, stop):
            if case >= minimum and time.time() > deadline:
                break
            s, data, what, exact = mutate(target, seed, case)
            _say(case=case, mutation=what)
            t0 = time.perf_counter()
            got = outcome(target.samples[s], data, exact)
            rss = _maxrss()
            _say(case=case, outcome=got, seconds=time.perf_counter() - t0, rss=rss - base)
            if rss - base > RSS_CAP:
                return
        _say(done=True)


@dataclass
class Failure:
    case: int
    mutation: str
    problem: str

    def line(self, name: str, seed: int) -> str:
        return (f"{name} seed {seed} case {self.case}: {self.problem} -- {self.mutation} "
                f"[python tests/_fuzz.py {name} {seed} {self.case}]")


def _kind(f: Failure) -> str:
    """A failure's class: its problem without numbers and paths, and for wrong output the
    kind of mutation."""
    words = [w for w in f.problem.split() if "/" not in w]
    key = re.sub(r"\d+", "N", " ".join(words))[:90]
    if key.startswith(("WRONG", "hang", "worker")):
        key += " <- " + re.sub(r"\d+", "N", f.mutation.split(": ", 1)[-1])[:50]
    return key


@dataclass
class Report:
    cases: int = 0
    peak_rss: int = 0  # largest growth over the worker's baseline, bytes
    slowest: float = 0.0
    failures: list[Failure] | None = None

    def summary(self, name: str, seed: int, examples: int = 3) -> str:
        """The failures grouped by class, a few reproducible cases of each."""
        groups: dict[str, list[Failure]] = {}
        for f in self.failures or []:
            groups.setdefault(_kind(f), []).append(f)
        out = [f"{len(self.failures or [])} of {self.cases} cases failed, "
               f"{len(groups)} classes:"]
        for key, fs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            out.append(f"[{len(fs)}x] {key}")
            out += ["    " + f.line(name, seed) for f in fs[:examples]]
        return "\n".join(out)


def _reader(stream: Any, out: queue.Queue) -> None:
    for line in stream:
        out.put(line)
    out.put(None)


def campaign(name: str, seed: int, *, seconds: float, minimum: int,
             maximum: int = 1 << 30) -> Report:
    """Run cases of target ``name`` for about ``seconds`` (at least ``minimum`` of them,
    at most ``maximum``) in memory-limited workers; a hang or crash ends its worker and
    the next one resumes after that case."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(_ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
        # few threads and malloc arenas: the address-space limit is for the decode
        "MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:  # what a killed worker leaves goes with it
        return _campaign(name, seed, seconds, minimum, maximum, {**env, "TMPDIR": tmp})


def _campaign(name: str, seed: int, seconds: float, minimum: int, maximum: int,
              env: dict[str, str]) -> Report:
    rep = Report(failures=[])
    case, left = 0, float(seconds)  # start-up (artifacts, JIT) is not counted
    while case < maximum and (case < minimum or left > 0):
        errors = tempfile.TemporaryFile("w+")  # a file: a chatty worker cannot block on it
        proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker", name, str(seed),
             str(case), str(maximum), str(minimum), str(left)],
            stdout=subprocess.PIPE, stderr=errors, text=True, env=env, start_new_session=True)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()
        current: tuple[int, str] | None = None
        wait, ready, ended, hung = _START_LIMIT, False, False, False
        while not ended:
            try:
                line = lines.get(timeout=wait)
            except queue.Empty:
                hung = True
                break
            if line is None:
                break
            msg = json.loads(line)
            if "fatal" in msg:
                proc.kill()
                raise RuntimeError(f"fuzz target {name}: {msg['fatal']}")
            if "ready" in msg:
                ready, t_ready = True, time.time()
            wait = 6 * TIME_CAP  # the cap itself is judged by the worker's own clock
            if "mutation" in msg:
                current = (msg["case"], msg["mutation"])
            elif "outcome" in msg:
                rep.cases += 1
                rep.peak_rss = max(rep.peak_rss, msg["rss"])
                rep.slowest = max(rep.slowest, msg["seconds"])
                problems = [] if msg["outcome"] in ("corrupt", "exact") else [msg["outcome"]]
                if msg["seconds"] > TIME_CAP:
                    problems.append(f"took {msg['seconds']:.1f} s")
                if msg["rss"] > RSS_CAP:
                    problems.append(f"peak RSS grew {msg['rss'] >> 20} MiB")
                if problems:
                    rep.failures.append(Failure(*current, "; ".join(problems)))
                current = None
                case = msg["case"] + 1
            ended = "done" in msg
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        proc.wait()
        errors.seek(0)
        err = errors.read()
        errors.close()
        if not ready:
            raise RuntimeError(f"fuzz worker {name} did not start: {err[-2000:]}")
        left -= time.time() - t_ready
        if current is not None:  # the case in progress hung or killed the worker
            tail = (err.strip().splitlines() or ["(no output)"])[-1][:200]
            rep.failures.append(Failure(*current, f"hang: no result in {wait:.0f} s" if hung
                                        else f"worker died (exit {proc.returncode}): {tail}"))
            case = current[0] + 1
        elif ended:
            break
    return rep


def _repro(name: str, seed: int, case: int, write: str | None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        target = TARGETS[name](Path(tmp))
        s, data, what, exact = mutate(target, seed, case)
        outcome(target.samples[s], target.samples[s].data)  # warm up (JIT)
        if write:
            Path(write).write_bytes(data)
        t0 = time.perf_counter()
        got = outcome(target.samples[s], data, exact)
        print(f"{what}\n{got} ({time.perf_counter() - t0:.2f} s, peak RSS "
              f"{_maxrss() >> 20} MiB)")
        if got not in ("corrupt", "exact"):
            try:  # once more, for the traceback
                target.samples[s].decode(data)
            except Exception:  # noqa: BLE001
                traceback.print_exc()


if __name__ == "__main__":
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))
    if sys.argv[1] == "--worker":
        n, sd, a, b, m, sec = sys.argv[2:8]
        worker(n, int(sd), int(a), int(b), int(m), float(sec))
    else:
        argv = sys.argv[1:]
        out = argv[argv.index("--write") + 1] if "--write" in argv else None
        _repro(argv[0], int(argv[1]), int(argv[2]), out)
