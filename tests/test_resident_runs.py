"""Resident mode's launches coded as runs, and its device bytes counted on the host.

A launch's consecutive weights of one dtype are coded as one tensor (one frame per
field: one set of decode tables, chunks across the weights, the alignment gaps between
them zero), in chunks chosen per launch by block; exact on the CPU backend and on the
CUDA backend's kernel emulator. ``_cuda.planned_parts`` splits ``planned_bytes`` by
part, and ``gpu/resident_check.py``'s ``account`` adds up a model's device bytes on the
host as the CUDA backend's classes hold them.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from test_torch_resident import (  # noqa: E402
    _bits,
    _FakeRuntime,
    _Fp8Linear,
    _llama_vocab,
    _logits,
    _resident_check,
)
from torch import nn  # noqa: E402

import entropykit.torch as ekt  # noqa: E402
from entropykit.coding import frame  # noqa: E402
from entropykit.rans import cuda as rans_cuda  # noqa: E402
from entropykit.rans.static import CODER  # noqa: E402
from entropykit.torch import _coded, _cuda, _resident  # noqa: E402


class _GapBlock(nn.Module):
    """bf16 Linears around an fp8 one with its bf16 scale, sizes not multiples of 512
    bytes: with ``min_elements=1`` its launch holds runs of two dtypes (bf16, fp8,
    bf16) with alignment gaps between its weights."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(60, 100, bias=False).to(torch.bfloat16)
        self.b = nn.Linear(100, 60, bias=False).to(torch.bfloat16)
        self.c = _Fp8Linear(60, 70)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x)))[..., :60]


class _GapNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(_GapBlock() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x)
        return x


def _x() -> torch.Tensor:
    return torch.randn(4, 60, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)


@pytest.fixture(params=["cpu", "emulated-cuda"])
def backend(request, monkeypatch):
    """The CPU backend, or the CUDA backend's decoders with the kernel emulated."""
    if request.param == "emulated-cuda":
        monkeypatch.setattr(rans_cuda, "load_runtime", lambda device: _FakeRuntime)
        monkeypatch.setattr(_resident, "_backend", lambda device, units, sides: (
            _resident.CpuStreams(),
            lambda coded, region: _cuda.CudaDecoder(coded, region, device)))
    return request.param


def test_runs_of_a_launch(monkeypatch) -> None:
    """Each launch decodes one coded tensor per run of one dtype, over the run's bytes
    in the region (gaps included, as zeros), in one frame per field: a block of two bf16
    Linears and an fp8 one with its scale codes three runs (bf16, fp8, bf16)."""
    runs = []
    real = _resident.CpuDecoder.__init__

    def init(self, coded, region) -> None:
        runs.append([(c.dtype, c.offset, c.nbytes) for c in coded])
        real(self, coded, region)

    monkeypatch.setattr(_resident.CpuDecoder, "__init__", init)
    model = _GapNet()
    ekt.compress_model(model, min_elements=1)
    state = model._entropykit_resident
    assert len(runs) == 3
    a, b = 100 * 60 * 2, 60 * 100 * 2  # bf16 bytes, then c: fp8 weight and bf16 scale
    at_b = _coded.ALIGN * -(-a // _coded.ALIGN)
    at_c = at_b + _coded.ALIGN * -(-b // _coded.ALIGN)
    at_s = at_c + _coded.ALIGN * -(-70 * 60 // _coded.ALIGN)
    assert runs[0] == [(torch.bfloat16, 0, at_b + b), (torch.float8_e4m3fn, at_c, 70 * 60),
                       (torch.bfloat16, at_s, 70 * 2)]
    u = state.units[0]
    assert [w.coded.offset for w in u.weights] == [0, at_b, at_c, at_s]
    assert all(w.coded.fields == () for w in u.weights)  # the runs hold them
    first = u.decoder.coded[0]
    assert [frame.parse(CODER, f.data).n for f in first.fields if f.coded] == [
        (at_b + b) // 2]


def test_runs_exact_with_gaps_and_dtypes(backend) -> None:
    """Outputs bit for bit with runs across alignment gaps and dtypes, also after the
    scratch buffer is poisoned; decompress_model gives every weight back."""
    model, ref = _GapNet(), _GapNet()
    ekt.compress_model(model, min_elements=1)
    state = model._entropykit_resident
    state.scratch.fill_(0xFF)
    with torch.no_grad():
        assert torch.equal(_bits(model(_x())), _bits(ref(_x())))
    ekt.decompress_model(model)
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(_bits(p), _bits(q)), n


def test_runs_share_tables_in_a_block() -> None:
    """A Llama block's bf16 weights (five of this size: k and v are below
    ``min_elements``) decode from one frame per field (one set of decode tables instead
    of five), the logits exact."""
    model, ref = _llama_vocab(256), _llama_vocab(256)
    ekt.compress_model(model)
    state = model._entropykit_resident
    blocks = [u for u in state.units if u.block]
    assert len(blocks) == 3 and all(len(u.weights) == 5 for u in blocks)
    assert all(len(u.decoder.coded) == 1 for u in blocks)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))
    assert torch.equal(_logits(model, ids), _logits(ref, ids))


def test_planned_parts_add_up() -> None:
    """``planned_parts`` sums to ``planned_bytes``; its states are 128 bytes a coded
    chunk, its payload and states the frames' chunk bytes."""
    t = torch.randn(300, 200).to(torch.bfloat16)
    c = _coded.code_tensor(t, 0, 4096)
    parts = _cuda.planned_parts([c])
    assert sum(parts.values()) == _cuda.planned_bytes([c])
    (exp,) = [f for f in c.fields if f.coded]
    info = frame.parse(CODER, exp.data)
    assert parts["states"] == 128 * len(info.lengths) == 128 * 15
    plain = sum(f.data.nbytes for f in c.fields if not f.coded)
    assert parts["payload"] + parts["states"] == sum(info.lengths) + plain


@pytest.mark.parametrize("opts", [{}, {"granularity": "weight"}], ids=["block", "weight"])
def test_account_is_what_the_cuda_backend_holds(opts, monkeypatch) -> None:
    """``account`` of a tied Llama on the host: its parts add up to the coded and
    scratch bytes, and, but for the streams' descriptor buffers, to what the CUDA
    backend's decoders, gathered and tied lookups hold under the kernel emulator."""
    rc = _resident_check()
    acc = rc.account(rc.llama("tiny-tied", "cpu"), dict(opts))
    assert sum(acc["parts"].values()) == acc["total"]
    assert acc["parts"]["scratch"] > 0 and acc["parts"]["lookup buffers"] > 0
    monkeypatch.setattr(rans_cuda, "load_runtime", lambda device: _FakeRuntime)
    monkeypatch.setattr(_resident, "_backend", lambda device, units, sides: (
        _resident.CpuStreams(),
        lambda coded, region: _cuda.CudaDecoder(coded, region, device)))
    monkeypatch.setattr(_resident, "_gatherer", lambda device: (
        lambda coded, chunk, slots, region: _cuda.GatherDecoder(coded, chunk, slots,
                                                                region, device)))
    model = rc.llama("tiny-tied", "cpu")
    ekt.compress_model(model, verify=False, **opts)
    mem = ekt.resident_memory(model)
    assert acc["total"] - acc["parts"]["stream descriptor buffers"] == (
        mem.coded_bytes + mem.scratch_bytes)
    assert acc["plain"] == mem.uncompressed_bytes
    assert acc["ratio"] > mem.ratio


@pytest.mark.parametrize("granularity", ["block", "weight"])
def test_nothing_ahead_takes_one_launch_of_scratch(backend, granularity) -> None:
    """``ahead=0``: no launch is prefetched, the scratch buffer is the largest launch's
    bytes (a block, or by weight the largest Linear), and the logits stay exact with
    the buffer poisoned."""
    model, ref = _llama_vocab(4096), _llama_vocab(4096)
    ekt.compress_model(model, granularity=granularity, ahead=0)
    state = model._entropykit_resident
    sizes = [state.units[g].place.numel() for g in state.leads]
    assert ekt.resident_memory(model).scratch_bytes == max(sizes)
    assert not any(u.prefetch for u in state.units) and state.ahead == 0
    state.scratch.fill_(0xFF)
    ids = torch.randint(0, 4096, (2, 9), generator=torch.Generator().manual_seed(4))
    assert torch.equal(_logits(model, ids), _logits(ref, ids))


def test_sweep_memo_codes_each_run_once(monkeypatch) -> None:
    """resident_check's coding memo: models sharing their weights, compressed one after
    the other, code each launch's run of weights once (the run joined once, so found
    again), and stay exact."""
    rc = _resident_check()
    plain = _llama_vocab(256)
    calls = []
    real = _resident.code_tensor
    monkeypatch.setattr(_resident, "code_tensor",
                        lambda *a: calls.append(a[0].shape) or real(*a))
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(5))
    with rc._coding_memo():
        for _ in range(2):
            model = rc._sharing(plain)
            ekt.compress_model(model)
            assert torch.equal(_logits(model, ids), _logits(plain, ids))
    assert len(calls) == 5  # the embedding, three blocks' runs, the head
