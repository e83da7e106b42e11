"""Device check of resident mode (``entropykit.torch.compress_model``) on a GPU.

What it is: a script for a GPU machine. With random Llama models built here (bf16, and
with fp8 e4m3 weights and per-row scales in the blocks) on ``cuda:0`` it checks that
(1) logits and greedy ``generate`` tokens of the resident model are the plain model's bit
for bit, also after the scratch buffer is poisoned with NaN, and ``decompress_model``
gives every weight back; (2) a decode step captured in a CUDA graph (``torch.cuda.graph``)
and replayed on new inputs, with the scratch buffer poisoned between replays, gives the
plain model's logits bit for bit (the whole ``model(...)`` forward where transformers'
forward can be captured, else embedding, layers, norm and head called in turn); then, for
each model size asked for (bf16 and fp8), it checks the decode step's logits at batch 1
and 64 bit for bit (the embedding and head decode in row tiles at these shapes) and
prints (3) memory: coded weights, scratch buffer, what they replace, their ratio against
the target, and the device memory the model takes before and after; (4) decode-step times
(one new token per sequence, batch 1 and 64) of the plain and the resident model, eager
and graph-replayed, and ``generate`` tokens/s; with ``--df11 DIR`` (a DFloat11 checkpoint
of the bf16 model that ``--save-plain DIR`` writes, compressed by DFloat11's own tool) the
same for DFloat11's ``DFloat11Model``. It prints ALL OK at the end, or the failures, and
exits non-zero on any. With ``--device cpu`` it runs (1) and (3) on the CPU backend (a
dry run of its logic).
What it is not: the CPU tests (tests/test_torch_resident.py) or a benchmark of record.

    PYTHONPATH=/tmp/site:. python3 gpu/resident_check.py [--size small 8b-blocks]
        [--tile-bytes block 16777216]
"""

from __future__ import annotations

import argparse
import copy
import itertools
import sys
import time
from collections.abc import Callable

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


def llama(size: str, device: str, fp8: bool = False) -> nn.Module:
    """A random Llama of ``size`` in bf16 (seeded: every call builds the same one); with
    ``fp8`` its blocks' Linear weights are fp8 e4m3 with scales."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(max_position_embeddings=256, **SIZES[size])
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    if fp8:
        for layer in model.model.layers:
            for parent in list(layer.modules()):
                for name, child in list(parent.named_children()):
                    if isinstance(child, nn.Linear):
                        setattr(parent, name, Fp8Linear(child))
    return model


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _poison(model: nn.Module) -> None:
    model._entropykit_resident.scratch.view(torch.bfloat16).fill_(float("nan"))


def _ids(vocab: int, batch: int, n: int, device: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, n), generator=g).to(device)


@torch.no_grad()
def exact_failures(make: Callable[[], nn.Module], device: str,
                   tile_bytes: int | None = None) -> list[str]:
    """(1): logits, generate tokens, poisoned buffers, restore; the failures found."""
    plain, model = make(), make()
    vocab = plain.config.vocab_size
    fails = []
    want_state = {k: _bits(v).clone() for k, v in plain.state_dict().items()}
    ekt.compress_model(model, tile_bytes=tile_bytes)
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
                   tile_bytes: int | None = None) -> tuple[list[str], str]:
    """(2): a captured step replayed on new inputs, the buffer poisoned between replays;
    the failures found and which step was captured."""
    plain, model = make(), make()
    vocab = plain.config.vocab_size
    ekt.compress_model(model, tile_bytes=tile_bytes)
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
    """Median milliseconds of ``fn``."""
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


def _weights_bytes(device: str) -> int:
    return torch.cuda.memory_allocated(device) if device.startswith("cuda") else 0


SMALL_TILES = 1 << 16  # tiny's blocks decode module by module, its Linears in tiles
TARGET = {False: 0.68, True: 0.84}  # (coded + scratch) / plain weights, bf16 / fp8


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


@torch.no_grad()
def report(size: str, fp8: bool, device: str, tile_bytes: int | None = None,
           df11: str | None = None) -> list[str]:
    """(3) and (4) for one model, printed; the failures found (logits at batch 1 and 64)."""
    cuda = device.startswith("cuda")
    name = f"{size} {'fp8 e4m3' if fp8 else 'bf16'}" + (
        f" tile_bytes={tile_bytes}" if tile_bytes is not None else "")
    if cuda:
        torch.cuda.empty_cache()
    base = _weights_bytes(device)
    model = llama(size, device, fp8)
    before = _weights_bytes(device) - base
    plain = copy.deepcopy(model)
    t = time.perf_counter()
    ekt.compress_model(model, tile_bytes=tile_bytes)
    took = time.perf_counter() - t
    after = _weights_bytes(device) - base - before  # the plain copy's share taken off
    mem = ekt.resident_memory(model)
    mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    units = model._entropykit_resident.units
    tiles = sum(u.tiled is not None for u in units)
    print(f"{name}: {mem.tensors} weights resident in {len(units)} units ({tiles} row "
          f"tiles; {sum(u.prefetch for u in units)} decoded during the unit before), "
          f"compress_model {took:.1f} s")
    verdict = "meets" if mem.ratio <= TARGET[fp8] else "misses"
    print(f"  coded {mib(mem.coded_bytes)} + scratch {mib(mem.scratch_bytes)} "
          f"vs uncompressed {mib(mem.uncompressed_bytes)}: {mem.ratio:.3f}x ({verdict} "
          f"<= {TARGET[fp8]}x); left plain {mib(mem.plain_bytes)}")
    if cuda:
        print(f"  device memory of the model: plain {mib(before)}, resident "
              f"{mib(after)} ({after / before:.3f}x)")
    fails = []
    for batch in (1, 64):
        ids = _ids(model.config.vocab_size, batch, 1, device, 1)
        if not torch.equal(_bits(_full_step(model, ids)), _bits(_full_step(plain, ids))):
            fails.append(f"{name}: decode-step logits differ at batch {batch}")
        print(f"  decode step, batch {batch}: " + "; ".join(
            _steps(label, m, device, batch) for label, m in
            (("plain", plain), ("resident", model))))
    del model
    if df11 and not fp8:
        fails += _df11_report(name, plain, df11, device)
    return fails


def _df11_report(name: str, plain: nn.Module, path: str, device: str) -> list[str]:
    """DFloat11's ``DFloat11Model`` of the same bf16 model: logits and step times."""
    try:
        from dfloat11 import DFloat11Model
    except ImportError as e:
        print(f"  DFloat11: not measured ({e})")
        return []
    try:
        model = DFloat11Model.from_pretrained(path, device=device,
                                              bfloat16_model=llama_skeleton(plain))
    except Exception as e:  # its API or the checkpoint: say so, the rest stands
        print(f"  DFloat11: not measured (DFloat11Model.from_pretrained: {e!r:.200})")
        return []
    fails = []
    for batch in (1, 64):
        ids = _ids(plain.config.vocab_size, batch, 1, device, 1)
        if not torch.equal(_bits(_full_step(model, ids)), _bits(_full_step(plain, ids))):
            fails.append(f"{name}: DFloat11's logits differ at batch {batch} (is {path} "
                         "this model?)")
        ids = _ids(plain.config.vocab_size, batch, 1, device, 0)
        row = [f"eager {_time(lambda ids=ids: _full_step(model, ids), device):.3f} ms",
               f"generate {_generate_rate(model, ids, device):.0f} tok/s"]
        print(f"  DFloat11 decode step, batch {batch}: " + " ".join(row))
    return fails


def llama_skeleton(plain: nn.Module) -> nn.Module:
    """A model of ``plain``'s config, for DFloat11 to load its weights into."""
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(plain.config).to(torch.bfloat16).eval()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--size", nargs="+", choices=sorted(SIZES),
                    default=["small", "8b-blocks"], help="models measured in (3) and (4)")
    ap.add_argument("--tile-bytes", nargs="+", default=["block"],
                    help="compress_model's tile_bytes to measure: bytes, or 'block' (the "
                         "default: the largest block's)")
    ap.add_argument("--df11", metavar="DIR",
                    help="a DFloat11 checkpoint of the first size's bf16 model, to compare")
    ap.add_argument("--save-plain", metavar="DIR",
                    help="save the first size's bf16 model there (for DFloat11) and stop")
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if args.save_plain:
        llama(args.size[0], "cpu").save_pretrained(args.save_plain)
        return 0
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.cuda.get_device_name(args.device) if cuda else 'CPU'}")
    failures = []
    for fp8, tile_bytes in itertools.product((False, True), (None, SMALL_TILES)):
        make = lambda fp8=fp8: llama("tiny", args.device, fp8)  # noqa: E731
        what = ("fp8" if fp8 else "bf16") + (f" tile_bytes={tile_bytes}" if tile_bytes else "")
        failures += [f"{what}: {f}" for f in exact_failures(make, args.device, tile_bytes)]
        if cuda:
            fails, how = graph_failures(make, args.device, tile_bytes=tile_bytes)
            print(f"{what}: CUDA graph captured: {how}")
            failures += [f"{what}: {f}" for f in fails]
    tiles = [None if t == "block" else int(t) for t in args.tile_bytes]
    for k, size in enumerate(args.size):
        for fp8 in (False, True):
            for j, tile_bytes in enumerate(tiles):
                failures += report(size, fp8, args.device, tile_bytes,
                                   args.df11 if k == j == 0 else None)
    print("FAILURES: " + "; ".join(failures) if failures else "ALL OK")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
