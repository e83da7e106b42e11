"""Resident mode's check of tiled Linears' products, on the CPU.

A tiled head computes its logits tile by tile, which is the whole product's bits only
where the matrix library sums a narrow product as it sums a column block of the whole
one. The CPU's products do; a GPU's may not (a split reduction for a narrow product at
a small batch). So these tests patch ``F.linear`` with a product whose reduction depends
on the number of output features, and check that ``compress_model`` finds it, grows the
tiles to a width whose products are exact or keeps the weight plain (with a warning),
and that the logits and the memory accounting are then exact.
"""

from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_torch_resident import (  # noqa: E402
    _aligned,
    _bits,
    _coded_weights,
    _llama_vocab,
    _resident_check,
)
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import entropykit.torch as ekt  # noqa: E402
from entropykit.torch import _resident  # noqa: E402

VOCAB = 4096  # the head: 4096 x 64 bf16, 512 KiB, above a block (tiles of 512 rows)


def _split_product(monkeypatch, narrow: int, at: int | None = None) -> None:
    """``F.linear`` (the plain modules' and the tiles' product) summing each output in
    two halves rounded apart where the product has fewer than ``narrow`` output
    features (and, with ``at``, an input of ``at`` rows): a split reduction for narrow
    products, as a GPU's matrix library may choose."""
    real = F.linear

    def linear(x, w, bias=None):
        if w.shape[0] >= narrow or (at is not None and x.numel() // x.shape[-1] != at):
            return real(x, w, bias)
        k = w.shape[1] // 2
        out = real(x[..., :k], w[:, :k]) + real(x[..., k:], w[:, k:])
        return out if bias is None else out + bias

    monkeypatch.setattr(F, "linear", linear)


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return _bits(model(ids).logits)


def _same_logits(plain: nn.Module, model: nn.Module, rows: int) -> bool:
    """Whether both give the same logits bits for inputs of ``rows`` tokens, and of 2 x 11."""
    g, vocab = torch.Generator().manual_seed(rows), plain.config.vocab_size
    return all(torch.equal(_logits(model, ids), _logits(plain, ids)) for ids in (
        torch.randint(0, vocab, (1, rows), generator=g),
        torch.randint(0, vocab, (2, 11), generator=g)))


def _head_rows(model: nn.Module) -> list[tuple[int, int]]:
    return [u.rows for u in model._entropykit_resident.units if u.module is model.lm_head]


@pytest.mark.parametrize("at", [None, 1, 2, 256], ids=["every-batch", "m1", "m2", "m256"])
def test_tiles_grow_until_their_products_are_the_whole_products(at, monkeypatch) -> None:
    """Products of fewer than 1024 features sum another way (at every input, or at one
    decode batch only): the head's 512-row tiles are found out at that batch and grow to
    1024 rows, whose products are exact; the logits are the plain model's, the scratch
    two slots of the larger tile, and the weights come back."""
    _split_product(monkeypatch, 1024, at)
    plain, model = _llama_vocab(VOCAB), _llama_vocab(VOCAB)
    ekt.compress_model(model)
    assert _same_logits(plain, model, at or 1)
    state = model._entropykit_resident
    assert state.tile_check.retiled == {"lm_head.weight": (512, 1024)}
    assert state.tile_check.kept_plain == [] and state.tile_check.checked == 1
    assert _head_rows(model) == [(a, a + 1024) for a in range(0, VOCAB, 1024)]
    embed = [u.rows for u in state.units if u.module is model.model.embed_tokens]
    assert embed == [(a, a + 512) for a in range(0, VOCAB, 512)]  # a lookup: not checked
    mem = ekt.resident_memory(model)
    assert mem.scratch_bytes == 2 * 1024 * 64 * 2
    assert mem.tensors == len(_coded_weights(plain))
    ekt.decompress_model(model)
    want = plain.state_dict()
    assert all(torch.equal(_bits(v), _bits(want[k])) for k, v in model.state_dict().items())


@pytest.mark.parametrize(("granularity", "narrow", "tied"), [
    ("block", VOCAB, False), ("block", VOCAB, True), ("weight", VOCAB, False),
    ("weight", 1024, False)], ids=["block", "block-tied", "weight", "weight-bounded"])
def test_a_head_no_tiling_computes_exactly_stays_plain(granularity, narrow, tied,
                                                       monkeypatch) -> None:
    """Only the whole product is exact (or, by weight, tiles wide enough to be exact
    would grow the scratch by more than a quarter of the weight): the head's weight stays
    a plain parameter (a tied embedding's with it), with a warning naming it, the logits
    are the plain model's and the accounting counts it as plain."""
    _split_product(monkeypatch, narrow)
    plain = _llama_vocab(VOCAB, tie_word_embeddings=tied)
    model = _llama_vocab(VOCAB, tie_word_embeddings=tied)
    with pytest.warns(RuntimeWarning, match="lm_head.weight stays plain: its product in "
                                            "row tiles is not the whole product's on cpu"):
        ekt.compress_model(model, granularity=granularity)
    assert _same_logits(plain, model, 1)
    state = model._entropykit_resident
    assert state.tile_check.kept_plain == ["lm_head.weight"]
    assert state.tile_check.retiled == {}
    head = model.lm_head.weight
    assert isinstance(head, nn.Parameter) and torch.equal(_bits(head),
                                                          _bits(plain.lm_head.weight))
    assert (model.model.embed_tokens.weight is head) == tied
    assert all(u.module is not model.lm_head for u in state.units)
    coded = _coded_weights(plain)
    mem = ekt.resident_memory(model)
    head_bytes = head.numel() * head.element_size()
    rest = sum(p.numel() * p.element_size() for n, p in plain.named_parameters()
               if n not in coded) + sum(b.numel() * b.element_size() for b in plain.buffers())
    assert mem.plain_bytes == rest + head_bytes
    assert mem.tensors == len(coded) - 1
    assert mem.uncompressed_bytes == sum(p.numel() * p.element_size()
                                         for p in coded.values()) - head_bytes
    if granularity == "block":  # two slots of a block: no head tiles
        block = max(sum(_aligned(p.numel() * 2) for n, p in coded.items()
                        if n.startswith(f"model.layers.{i}.")) for i in range(3))
        assert mem.scratch_bytes == 2 * block
    ekt.decompress_model(model)
    assert model.lm_head.weight is head


@pytest.mark.filterwarnings("ignore:entropykit.*stays plain")
def test_block_tiles_of_tile_bytes_are_checked_too(monkeypatch) -> None:
    """``tile_bytes`` cuts the blocks' Linears into row tiles: their products are checked
    the same way (tiles below 64 rows sum another way here) and the logits stay exact."""
    _split_product(monkeypatch, 64)
    plain, model = _llama_vocab(256), _llama_vocab(256)
    ekt.compress_model(model, tile_bytes=4096)
    assert _same_logits(plain, model, 1)
    check = model._entropykit_resident.tile_check
    assert check.checked > 0 and check.retiled
    assert all(b >= 64 for _, b in check.retiled.values())
    tiles = {}
    for u in model._entropykit_resident.units:
        if u.tiled is not None and isinstance(u.module, nn.Linear):
            tiles.setdefault(id(u.tiled), []).append(u.rows)
    assert tiles and all(len(rows) == 1 or rows[0][1] >= 64 for rows in tiles.values())
    assert all(a[1] == b[0] for rows in tiles.values() for a, b in itertools.pairwise(rows))


def test_exact_products_keep_their_tiles() -> None:
    """The CPU's own products are exact: every tiled head is checked and kept as cut."""
    model = _llama_vocab(VOCAB)
    ekt.compress_model(model, granularity="weight")
    check = model._entropykit_resident.tile_check
    assert (check.checked, check.retiled, check.kept_plain) == (1, {}, [])
    assert _head_rows(model) == [(a, a + 128) for a in range(0, VOCAB, 128)]


def test_tiles_exact_compares_every_checked_batch(monkeypatch) -> None:
    """``_tiles_exact`` finds a product that differs at any one of the checked row
    counts, and none where the tiles are the whole."""
    w = torch.randn(512, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    rows = [(0, 256), (256, 512)]
    assert _resident._tiles_exact(w, [None], rows)
    for m in _resident.CHECKED_ROWS:
        _split_product(monkeypatch, 512, m)
        assert not _resident._tiles_exact(w, [None], rows), m
        assert _resident._tiles_exact(w, [None], [(0, 512)])
    assert _resident.CHECKED_ROWS == (1, 2, 4, 8, 16, 32, 64, 128, 256)


def test_device_check_reports_what_the_check_changed(monkeypatch, capsys) -> None:
    """gpu/resident_check.py on the CPU backend, with a product that sums narrow outputs
    another way: its sweep row stays exact and says the head was kept plain; its
    ``--products`` comparison says which row counts differ for a tile size."""
    rc = _resident_check()
    _split_product(monkeypatch, 4096)
    with pytest.warns(RuntimeWarning, match="lm_head.weight stays plain"):
        assert rc.sweep("tiny", False, "cpu", [rc.DEFAULTS["weight"]]) == []
    out = capsys.readouterr().out.splitlines()
    row = next(i for i, r in enumerate(out) if r.startswith("tiny bf16 ") and "| " in r
               and "plain:" not in r)
    assert "| yes " in out[row]
    assert "retiled: none; kept plain: lm_head.weight" in out[row + 1]
    monkeypatch.undo()
    _split_product(monkeypatch, 4096, at=2)
    rc.tile_products("cpu", [1024, 4096], n=4096, k=64)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("tile rows 1024 (4 tiles): M=1: exact; M=2: DIFFER (4 tiles")
    assert "M=4: exact" in lines[0]
    assert lines[1].startswith("tile rows 4096 (1 tiles): M=1: exact; M=2: exact;")
