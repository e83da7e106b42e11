"""Hostile and damaged compressed files: claimed sizes checked before anything is sized by
them (memory measured in a child process under an address-space limit), the segment cap,
JSON nesting, work linear in the tensor count, damaged records that must not pass for
plain files, the record checksum, and files written by the record v1 / v2 writer."""

from __future__ import annotations

import base64
import json
import re
import struct
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
import zstandard

import entropykit
from entropykit import CorruptDataError
from entropykit.cli import main as cli_main
from entropykit.container import files, header, record, segment
from entropykit.container.reader import Compressed

DATA = Path(__file__).parent / "data"
ROOT = Path(entropykit.__file__).parent.parent  # the entropykit under test


# -- building files by hand ------------------------------------------------------------

def _sign(rec: dict, edit=lambda body: body) -> str:
    """A version 3 record's text with its record_crc32 (docs/format.md), of the record
    text ``edit`` makes (before its checksum is computed)."""
    body = edit(json.dumps(rec, separators=(",", ":"), ensure_ascii=False)[:-1])
    return f'{body},"record_crc32":"{zlib.crc32(body.encode()):08x}"}}'


def _text(rec: dict, edit=lambda body: body) -> str:
    """The record's text, of the version it says: version 3 signed (``_sign``), older
    ones as they were written (no checksum)."""
    if rec["version"] == 3:
        return _sign(rec, edit)
    return edit(json.dumps(rec, separators=(",", ":"))[:-1]) + "}"


def _resign(blob: bytes, edit) -> bytes:
    """``blob`` with ``edit`` applied to its record (a dict), signed again if version 3."""
    n = struct.unpack("<Q", blob[:8])[0]
    outer = json.loads(blob[8 : 8 + n])
    rec = json.loads(outer["__metadata__"]["entropykit"])
    rec.pop("record_crc32", None)
    edit(rec)
    outer["__metadata__"]["entropykit"] = _text(rec)
    return _file(outer, blob[8 + n :])


def _file(outer: dict, data: bytes) -> bytes:
    raw = json.dumps(outer, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def _crafted(tensors: dict[str, tuple[str, list[int], list[list[str]], bytes]],
             segment_bytes: int, version: int = 1) -> bytes:
    """A compressed file: for each name (dtype, shape, codecs per segment, payload), with
    an original header claiming those tensors. Record version 1 by default: every
    reader reads it, so a hostile file made so reaches every reader's checks."""
    original, pos = {}, 0
    for name, (dtype, shape, _, _) in tensors.items():
        n = int(np.prod(shape, dtype=object)) * header.DTYPE_BITS[dtype] // 8
        original[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + n]}
        pos += n
    head = json.dumps(original, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    rec = {"format": "entropykit", "version": version, "segment_bytes": segment_bytes,
           "header_crc32": zlib.crc32(head), "header_size": len(head),
           "header": base64.b64encode(zstandard.ZstdCompressor().compress(head)).decode(),
           "tensors": {}}
    outer, data = {"__metadata__": {"entropykit": ""}}, b""
    for name, (dtype, shape, codecs, blob) in tensors.items():
        fields = segment.Split.of(dtype, None, header.DTYPE_BITS[dtype]).fields
        rec["tensors"][name] = {"dtype": dtype, "shape": shape, "layout": None,
                                "fields": [list(f) for f in fields], "codecs": codecs}
        outer[name] = {"dtype": "U8", "shape": [len(blob)],
                       "data_offsets": [len(data), len(data) + len(blob)]}
        data += blob
    outer["__metadata__"]["entropykit"] = _text(rec)
    return _file(outer, data)


def _zeros_frame(n: int, chunk: int) -> bytes:
    """A valid rANS frame of ``n`` zero symbols (one symbol at full frequency: each chunk
    is its 32 start states alone), the densest a frame can be."""
    chunks = -(-n // chunk)
    table = bytes([0, 0, 0x80, 0x20])  # one symbol present: 0, frequency 2^12 (LEB128)
    full, last = zlib.crc32(bytes(chunk)), zlib.crc32(bytes(n - (chunks - 1) * chunk))
    states = struct.pack("<32I", *[1 << 16] * 32)
    return (b"EKRA" + bytes([1, 12, 32, 0])
            + struct.pack("<QIII", n, chunk, chunks, len(table)) + table
            + struct.pack(f"<{chunks}I", *[len(states)] * chunks)
            + struct.pack(f"<{chunks}I", *[full] * (chunks - 1), last)
            + bytes(chunks) + states * chunks)


def _payload(*parts: bytes) -> bytes:
    """An EKT1 tensor payload (the layout of the version 1 records ``_crafted`` makes)."""
    return (b"EKT1" + struct.pack(f"<I{len(parts)}Q", len(parts), *map(len, parts))
            + b"".join(parts))


def _raw(sym: bytes) -> bytes:
    return struct.pack("<I", zlib.crc32(sym)) + sym


# -- a child process under a memory limit ------------------------------------------------

_CHILD = textwrap.dedent("""
    import json, resource, sys
    import entropykit
    from entropykit import CorruptDataError
    from entropykit.container import files
    from entropykit.container.reader import Compressed
    path, results = sys.argv[1], []
    with open("/proc/self/status") as f:
        vm = next(int(x.split()[1]) for x in f if x.startswith("VmSize:")) * 1024
    limit = vm + (1 << 30)  # a hostile size allocates far more than this and fails
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    def hwm():  # KiB: this process's own peak (ru_maxrss is inherited across exec)
        with open("/proc/self/status") as f:
            return next(int(x.split()[1]) for x in f if x.startswith("VmHWM:"))
    # Warm up on a valid file first: lazy imports (torch for load) and loading compiled
    # kernels cost memory once per process, whatever the file.
    import os, tempfile, torch
    warm = os.path.join(tempfile.mkdtemp(), "warm.ek.safetensors")
    entropykit.save_file({"w": torch.zeros(64, 64)}, warm)
    files.verify_file(warm, threads=1)
    files.decompress_file(warm, warm + ".out", threads=1)
    entropykit.load_file(warm, threads=1)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak restarts from here
    before = hwm()
    for action in sys.argv[2:]:
        try:
            if action == "open":
                Compressed(open(path, "rb").read())
            elif action == "verify":
                files.verify_file(path, threads=1)
            elif action == "decompress":
                files.decompress_file(path, path + ".out", threads=1)
            elif action == "load":
                entropykit.load_file(path, threads=1)
            results.append("ok")
        except CorruptDataError as e:
            results.append("CorruptDataError: " + str(e))
        except BaseException as e:
            results.append(type(e).__name__ + ": " + str(e)[:200])
    grew = hwm() - before
    print(json.dumps({"results": results, "grew_kib": grew}))
""")


def _child(path: Path, *actions: str) -> dict:
    """Run ``actions`` on ``path`` in a fresh process whose address space may grow by
    1 GiB at most: each action's outcome, and how much the peak RSS grew (KiB)."""
    done = subprocess.run([sys.executable, "-c", _CHILD, str(path), *actions],
                          capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- item: claimed sizes are checked before anything is sized by them ------------------

def test_huge_claimed_tensor_in_tiny_segments_costs_nothing(tmp_path: Path) -> None:
    # 2^40 bytes in 8-byte segments would be 2^37 segments; the record lists one.
    blob = _crafted({"w": ("U8", [1 << 40], [["raw"]], _payload(_raw(bytes(8))))}, 8)
    path = tmp_path / "huge.ek.safetensors"
    path.write_bytes(blob)
    assert len(blob) < 6000
    got = _child(path, "open", "verify", "load")
    for result in got["results"]:
        assert result.startswith("CorruptDataError: "), got
        assert "record lists 1 segments, 1099511627776 bytes make 137438953472" in result
    assert got["grew_kib"] < 64 << 10, got


def test_segment_count_is_checked_against_the_payload() -> None:
    # 4096 segments listed and claimed, but the payload cannot even hold their index.
    blob = _crafted({"w": ("U8", [4096 * 8], [["raw"]] * 4096, _payload(_raw(b"x")))}, 8)
    with pytest.raises(CorruptDataError, match="a payload of 21 bytes cannot index 4096 "
                                               "segments of 1 fields"):
        Compressed(blob)


def test_zeros_frame_is_valid() -> None:
    # The crafted frame below is a real one: it decodes (to zeros) through the container.
    frame = _zeros_frame(3000, 1024)
    blob = _crafted({"w": ("U8", [3000], [["rans"]], _payload(frame))}, 1 << 24)
    assert np.array_equal(Compressed(blob).tensor("w"), np.zeros(3000, np.uint8))


def test_segment_over_the_format_maximum_is_refused_with_little_memory(tmp_path: Path
                                                                       ) -> None:
    # One valid-looking 4 GiB segment of zeros in a 9 KB file: refused from the record,
    # before any decoding (so before any output is written).
    n = 1 << 32
    blob = _crafted({"w": ("U8", [n], [["rans"]], _payload(_zeros_frame(n, 1 << 26)))}, n)
    path = tmp_path / "seg.ek.safetensors"
    path.write_bytes(blob)
    assert len(blob) < 10_000
    got = _child(path, "open", "verify", "decompress", "load")
    for result in got["results"]:
        assert result.startswith("CorruptDataError: "), got
        assert ("entropykit record: segment_bytes 4294967296 exceeds the format's maximum "
                "67108864") in result, got
    assert got["grew_kib"] < 64 << 10, got
    assert not (tmp_path / "seg.ek.safetensors.out").exists()


def test_writer_never_writes_a_segment_over_the_maximum(tmp_path: Path) -> None:
    src = tmp_path / "a.safetensors"
    safetensors.torch.save_file({"a": torch.zeros(8)}, src)
    with pytest.raises(ValueError, match="segment_bytes must be a multiple of 8 from 8 to"):
        files.compress_file(src, tmp_path / "b", segment_bytes=record.MAX_SEGMENT_BYTES + 8)
    files.compress_file(src, tmp_path / "b", segment_bytes=record.MAX_SEGMENT_BYTES)
    assert Compressed(np.fromfile(tmp_path / "b", np.uint8)).record.segment_bytes == \
        record.MAX_SEGMENT_BYTES


def test_a_field_decodes_exactly_its_segment() -> None:
    # Each field's frame must record the segment's symbol count: a frame claiming more
    # is refused before its coder runs.
    blob = _crafted({"w": ("U8", [2048], [["rans"]], _payload(_zeros_frame(4096, 1024)))},
                    1 << 24)
    with pytest.raises(CorruptDataError, match="field 'byte0' .*declares 4096 symbols, more "
                                               "than the 2048 its field can hold"):
        Compressed(blob).tensor("w")


def test_record_fields_must_be_the_split() -> None:
    blob = _crafted({"w": ("U8", [8], [["raw"]], _payload(_raw(bytes(8))))}, 64)
    assert np.array_equal(Compressed(blob).tensor("w"), np.zeros(8, np.uint8))
    bad = _resign(blob, lambda r: r["tensors"]["w"].update(fields=[["byte9", None]]))
    with pytest.raises(CorruptDataError, match=r"tensor 'w': fields \[\('byte9', None\)\] "
                                               "are not those of U8"):
        Compressed(bad)


# -- item: JSON nesting -------------------------------------------------------------------

def test_json_depth_limit() -> None:
    ok = "[" * header.MAX_JSON_DEPTH + "]" * header.MAX_JSON_DEPTH
    assert header.loads(ok) is not None
    for bad in ("[" + ok + "]", '{"a":' * 65 + "1" + "}" * 65, "[" * 100_000,
                "[]" * 1000 + "[" * 65 + "]" * 65):
        with pytest.raises(ValueError, match="nested deeper than 64 levels"):
            header.loads(bad)
    with pytest.raises(json.JSONDecodeError):  # malformed but shallow: the parser says so
        header.loads("{]}")
    # Brackets inside strings (escaped quotes included) are text, not nesting.
    assert header.loads(json.dumps(["[" * 500 + '\\"{' * 500])) == ["[" * 500 + '\\"{' * 500]
    assert header.loads(b'{"a":"\\\\","b":[[1]]}') == {"a": "\\", "b": [[1]]}


def test_json_depth_counts_brackets_outside_strings_as_the_lexer_does() -> None:
    # Strings with escaped quotes and backslashes, brackets in them, keys and values.
    rng = np.random.default_rng(5)
    pieces = ['"', "\\", "[", "]", "{", "}", "a", ",", "\n", "\u005b"]

    def text() -> str:
        return "".join(pieces[i] for i in rng.integers(0, len(pieces), rng.integers(0, 12)))

    def nest(level: int) -> object:
        if level == 0 or rng.random() < 0.3:
            return text()
        if rng.random() < 0.5:
            return [nest(level - 1) for _ in range(rng.integers(1, 3))]
        return {text(): nest(level - 1) for _ in range(rng.integers(1, 3))}

    for _ in range(300):
        doc = nest(8)
        raw = json.dumps(doc).encode()
        # What is left outside strings is the document's own brackets, commas and colons.
        outside = header._outside_strings(raw)
        assert b'"' not in outside and b"\\" not in outside
        assert outside.translate(None, header._NOT_BRACKET) == json.dumps(
            _skeleton(doc)).encode().translate(None, header._NOT_BRACKET)
        assert header.loads(raw) == doc
    # An unterminated string holds the rest: the parser stops there, nesting no deeper.
    with pytest.raises(json.JSONDecodeError):
        header.loads('["' + "[" * 100_000)
    # An escaped backslash ends its string: the brackets after it nest.
    with pytest.raises(ValueError, match="nested deeper than 64 levels"):
        header.loads('["\\\\",' + "[" * 100 + '"\\"' + "]" * 100 + "]")


def _skeleton(doc: object) -> object:
    # The document with every string emptied: the same brackets, none inside strings.
    if isinstance(doc, list):
        return [_skeleton(v) for v in doc]
    if isinstance(doc, dict):
        return {str(k): _skeleton(v) for k, v in enumerate(doc.values())}
    return ""


def _deep(levels: int) -> str:
    return "[" * levels + "]" * levels


@pytest.mark.parametrize("where", ["outer", "record", "original"])
def test_deep_json_is_corrupt_data_in_every_verb(tmp_path: Path, where: str,
                                                 capsys: pytest.CaptureFixture) -> None:
    good = _crafted({"w": ("U8", [8], [["raw"]], _payload(_raw(bytes(8))))}, 64)
    n = struct.unpack("<Q", good[:8])[0]
    outer = json.loads(good[8 : 8 + n])
    rec = json.loads(outer["__metadata__"]["entropykit"])
    if where == "outer":
        outer["__metadata__"]["x"] = "y"
        text = json.dumps(outer, separators=(",", ":"))
        raw = text.replace('"x":"y"', '"x":' + _deep(1000)).encode()
    else:
        if where == "record":
            rec["header"] = "@"
            text = _text(rec, lambda body: body.replace('"@"', _deep(1000)))
        else:
            head = ('{"__metadata__":{"x":' + _deep(1000) + "}}").encode()
            rec.update(header_crc32=zlib.crc32(head), header_size=len(head),
                       header=base64.b64encode(zstandard.ZstdCompressor().compress(head))
                       .decode())
            text = _text(rec)
        outer["__metadata__"]["entropykit"] = text
        raw = json.dumps(outer, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path = tmp_path / "deep.ek.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + good[8 + n :])
    for verb in (lambda: files.verify_file(path), lambda: entropykit.load_file(path),
                 lambda: files.decompress_file(path, tmp_path / "out")):
        with pytest.raises(CorruptDataError, match="nested deeper than 64 levels"):
            verb()
    for argv in (["info", str(path)], ["verify", str(path)]):
        assert cli_main(argv) == 1
        err = capsys.readouterr().err
        assert "nested deeper than 64 levels" in err and err.count("\n") == 1, err


# -- item: work linear in the tensor count ---------------------------------------------

def _many(tmp_path: Path, n: int) -> Path:
    path = tmp_path / f"many{n}.ek.safetensors"
    entropykit.save_file({f"layers.{i}.b": torch.full((2,), float(i)) for i in range(n)},
                         path, threads=1)
    return path


def _lines(fn) -> int:
    """Lines of entropykit's own code that ``fn`` runs (deterministic, unlike time)."""
    count = 0
    pkg = str(ROOT / "entropykit")

    def local(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return local

    def trace(frame, event, arg):
        return local if frame.f_code.co_filename.startswith(pkg) else None

    sys.settrace(trace)
    try:
        fn()
    finally:
        sys.settrace(None)
    return count


def test_open_info_and_load_are_linear_in_tensor_count(tmp_path: Path) -> None:
    def work(path: Path) -> None:
        c = Compressed(np.fromfile(path, np.uint8))
        for name in c.keys():  # what `info` reads of each tensor
            c.entry(name), c.record.tensors[name], c.payload_size(name)
        got = entropykit.load_file(path, threads=1)
        assert len(got) == len(c.keys())

    small, large = _many(tmp_path, 150), _many(tmp_path, 1500)
    work(small)  # warm up: first calls compile and cache
    a, b = _lines(lambda: work(small)), _lines(lambda: work(large))
    # Linear: 10x the tensors, 10x the lines (plus a constant); a search per tensor
    # through all of them would be 100x.
    assert b < 11 * a, (a, b)


# -- item: a file that says it is compressed never loads as plain ----------------------

@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("packed")
    src = d / "m.safetensors"
    g = torch.Generator().manual_seed(13)
    safetensors.torch.save_file({"w": torch.randn(64, 32, generator=g).to(torch.bfloat16),
                                 "ids": torch.arange(100)}, src, metadata={"format": "pt"})
    out = d / "m.ek.safetensors"
    files.compress_file(src, out)
    return out


def _edit_header(blob: bytes, edit) -> bytes:
    n = struct.unpack("<Q", blob[:8])[0]
    raw = edit(blob[8 : 8 + n].rstrip(b" "))
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + blob[8 + n :]


_DAMAGED_KEY = [
    ("flipped key", lambda h: h.replace(b'"entropykit":', b'"entropykiu":', 1),
     r"__metadata__\['entropykiu'\] is an entropykit record, but no 'entropykit' record"),
    ("key case", lambda h: h.replace(b'"entropykit":', b'"EntropyKit":', 1),
     "__metadata__ has the key 'EntropyKit'"),
    ("null metadata", lambda h: json.dumps({**json.loads(h), "__metadata__": None}).encode(),
     "every tensor is an entropykit payload"),
    ("no metadata", lambda h: json.dumps({k: v for k, v in json.loads(h).items()
                                          if k != "__metadata__"}).encode(),
     "every tensor is an entropykit payload"),
]


@pytest.mark.parametrize("what, edit, message", _DAMAGED_KEY, ids=[d[0] for d in _DAMAGED_KEY])
def test_damaged_record_key_never_loads_as_plain(packed: Path, tmp_path: Path, what: str,
                                                 edit, message: str) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(_edit_header(packed.read_bytes(), edit))
    safetensors.torch.load_file(bad)  # it is a valid safetensors file (of U8 payloads)
    with pytest.raises(CorruptDataError, match=f"damaged entropykit file: {message}"):
        entropykit.load_file(bad)
    for verb in (files.verify_file, lambda p: files.decompress_file(p, tmp_path / "out")):
        with pytest.raises(CorruptDataError, match="damaged entropykit file"):
            verb(bad)


@pytest.mark.parametrize("edit", [
    lambda h: h.replace(b'"__metadata__":{', b'"__metadata__":{"entropykit":"x",', 1),
    lambda h: h.replace(b'"ids":', re.search(rb'"ids":\{[^}]*\},', h)[0] + b'"ids":', 1),
], ids=["metadata key", "tensor"])
def test_duplicate_keys_never_load(packed: Path, tmp_path: Path, edit) -> None:
    # safetensors takes one of the duplicates; which one is ambiguous, so it is refused.
    bad = tmp_path / "dup.safetensors"
    bad.write_bytes(_edit_header(packed.read_bytes(), edit))
    with pytest.raises(CorruptDataError, match="not a valid safetensors file: duplicate key"):
        entropykit.load_file(bad)


def test_mentions_of_entropykit_are_not_claims(tmp_path: Path) -> None:
    # Plain files may mention the tool; compress() blobs keep their kind under
    # "entropykit.kind" in the original: these restore to files that load as plain.
    t = {"a": torch.arange(6, dtype=torch.float32)}
    src = tmp_path / "a.safetensors"
    safetensors.torch.save_file(t, src, metadata={"note": "entropykit", "json": '{"a": 1}'})
    assert torch.equal(entropykit.load_file(src)["a"], t["a"])
    files.compress_file(src, tmp_path / "a.ek")
    blob = tmp_path / "blob.ek"
    blob.write_bytes(entropykit.compress(np.arange(5)))
    files.decompress_file(blob, tmp_path / "blob.safetensors")
    assert np.array_equal(entropykit.load_file(tmp_path / "blob.safetensors")["data"].numpy(),
                          np.arange(5))


@pytest.mark.parametrize("metadata, why", [
    ({"ENTROPYKIT": "x"}, "__metadata__ has the key 'ENTROPYKIT'"),
    ({"r": '{"format": "EntropyKit"}'}, r"__metadata__\['r'\] is an entropykit record"),
    ({"r": '{"tensors": {}, "segment_bytes": 8}'}, r"__metadata__\['r'\] is an entropykit"),
])
def test_writer_refuses_input_that_claims_to_be_compressed(tmp_path: Path, metadata: dict,
                                                           why: str) -> None:
    src = tmp_path / "a.safetensors"
    safetensors.torch.save_file({"a": torch.zeros(4)}, src, metadata=metadata)
    with pytest.raises(ValueError, match=f"already entropykit-compressed \\({why}"):
        files.compress_file(src, tmp_path / "b")


def test_writer_refuses_payloads_without_their_record(packed: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bare.safetensors"
    bad.write_bytes(_edit_header(packed.read_bytes(), _DAMAGED_KEY[2][1]))
    with pytest.raises(ValueError, match="every tensor is an entropykit payload"):
        files.compress_file(bad, tmp_path / "again")


# -- item: the record checksum -------------------------------------------------------------

def _record_edit(blob: bytes, edit) -> bytes:
    """``blob`` with its record text edited (not signed again)."""
    n = struct.unpack("<Q", blob[:8])[0]
    outer = json.loads(blob[8 : 8 + n])
    outer["__metadata__"]["entropykit"] = edit(outer["__metadata__"]["entropykit"])
    return _file(outer, blob[8 + n :])


def test_swapped_field_names_are_caught_by_verify(packed: Path, tmp_path: Path) -> None:
    swap = (lambda t: t.replace('"exponent"', '"@"').replace('"sign_mantissa"', '"exponent"')
            .replace('"@"', '"sign_mantissa"'))
    bad = tmp_path / "swap.ek"
    bad.write_bytes(_record_edit(packed.read_bytes(), swap))
    with pytest.raises(CorruptDataError, match="record_crc32 does not match: the record was "
                                               "altered"):
        files.verify_file(bad)


def test_every_edit_of_the_record_is_caught(packed: Path) -> None:
    blob = packed.read_bytes()
    n = struct.unpack("<Q", blob[:8])[0]
    text = json.loads(blob[8 : 8 + n])["__metadata__"]["entropykit"]
    rng = np.random.default_rng(14)
    for i in rng.choice(len(text), 120, replace=False):
        for c in ("1", "e", " "):
            if text[i] != c:
                bad = _record_edit(blob, lambda t, i=i, c=c: t[:i] + c + t[i + 1 :])
                with pytest.raises(CorruptDataError, match="entropykit record: "):
                    Compressed(bad)
    # A version 3 record relabelled as an older version keeps a checksum it may not have.
    for v in ("1", "2"):
        bad = _record_edit(blob, lambda t, v=v: t.replace('"version":3', f'"version":{v}'))
        with pytest.raises(CorruptDataError, match="record_crc32 does not match"):
            Compressed(bad)
    unsigned = _record_edit(blob, lambda t: t[: -27].replace('"version":3', '"version":2')
                            + "}")
    with pytest.raises(CorruptDataError, match="version 2 record has no record_crc32"):
        Compressed(_record_edit(unsigned, lambda t: t[:-1] + ',"record_crc32":"0"}'))


@pytest.mark.parametrize("version", [1, 2])
def test_files_of_older_record_versions_decode_byte_identically(tmp_path: Path,
                                                                version: int) -> None:
    packed = DATA / f"legacy_v{version}.ek.safetensors"
    original = (DATA / "legacy.safetensors").read_bytes()
    c = Compressed(np.fromfile(packed, np.uint8))
    assert c.record.version == version
    assert ("rans2d" in str(c.record.tensors["w"].codecs)) == (version == 2)
    files.verify_file(packed, DATA / "legacy.safetensors")
    files.decompress_file(packed, tmp_path / "back.safetensors")
    assert (tmp_path / "back.safetensors").read_bytes() == original
    want = safetensors.torch.load_file(DATA / "legacy.safetensors")
    got = entropykit.load_file(packed)
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_values_of_the_wrong_json_type_are_corrupt_data() -> None:
    good = _crafted({"w": ("U8", [8], [["raw"]], _payload(_raw(bytes(8))))}, 64)
    n = struct.unpack("<Q", good[:8])[0]
    outer = json.loads(good[8 : 8 + n])
    outer["w"]["dtype"] = ["U8"]  # unhashable where a dtype name belongs
    with pytest.raises(CorruptDataError, match=r"tensor 'w': unknown dtype \['U8'\]"):
        Compressed(_file(outer, good[8 + n :]))
    bad = _resign(good, lambda r: r["tensors"]["w"].update(fields=[["a", None], ["b", ["a"]]]))
    with pytest.raises(CorruptDataError, match="tensor 'w' entry is malformed"):
        Compressed(bad)


def test_no_payload_has_its_tensors_shape(tmp_path: Path) -> None:
    """A payload as long as its 1-D tensor has elements would load, in a plain loader
    that reads no metadata (transformers 5), as that tensor's values: such a tensor is
    stored raw, so every payload's shape differs from its tensor's."""
    n = 1000
    a = np.random.default_rng(1).integers(0, 170, n, dtype=np.uint8)
    coded = segment.encode("U8", None, a, segment.Split.of("U8", None, 8))
    assert 8 + 12 + sum(map(len, coded.parts)) == n  # coded as usual, it would collide
    src, out = tmp_path / "a.safetensors", tmp_path / "a.ek.safetensors"
    safetensors.torch.save_file({"a": torch.from_numpy(a), "b": torch.ones(3)}, src)
    entropykit.compress_file(src, out)
    plain = safetensors.torch.load_file(out)
    assert list(plain["a"].shape) == [8 + 12 + 4 + n]  # index, raw field: CRC + bytes
    assert json.loads(safetensors.safe_open(out, "np").metadata()["entropykit"]
                      )["tensors"]["a"]["codecs"] == [["raw"]]
    assert torch.equal(entropykit.load_file(out)["a"], torch.from_numpy(a))
    entropykit.decompress_file(out, tmp_path / "back.safetensors")
    assert (tmp_path / "back.safetensors").read_bytes() == src.read_bytes()
