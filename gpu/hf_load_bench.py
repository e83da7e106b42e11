"""Benchmark of ``from_pretrained``: a compressed checkpoint directory against the plain one.

What it is: the load-time side of "run a compressed model". Each model is saved plain
(safetensors, sharded as transformers does), compressed with ``entropykit.compress_file``
(default options, and ``target="gpu"``), and loaded with
``AutoModel*.from_pretrained(dir, dtype=..., device_map={"": DEVICE})`` alternately
plain and compressed, ``--repeat`` times each, the files in the page cache; the table
shows the best time of each and the ratio (plain / compressed: above
1 means the compressed checkpoint loads faster). Every compressed load is checked bit for
bit against the plain load. On the CPU the table also gives the time ``load_file`` takes to
decode the compressed shards, the part of the load that compression adds; on a GPU, where
one GPU load of all the shards spends its host time (the loader's own accounting), and
``load_file`` onto the device against ``safetensors.torch.load_file`` of the plain shards.
For the best compressed load it prints the wall time of the quantizer's steps (``_Steps``:
opening the shards, decoding batches, transformers waiting for them) and, on a GPU, the
loader's host accounting during that load (one GPU load of every shard's tensors: plan
wait, fill, launches; ``--plan-threads`` sets its planning threads): the rest of the
load is transformers' own work (building the model, reading payload bytes, placing
tensors).
Models: ``llm`` — a Llama-shaped bf16 model (hidden 4096, 14336 MLP, 32000 vocabulary,
``--layers`` blocks; random weights at the model's own initialization, so synthetic);
``minilm`` — real MiniLM-L6 weights cast to bf16 (``--minilm DIR`` holding its
config.json and a bf16 model.safetensors; ``bench/data.py`` writes one).
What it is not: a test (tests/test_hf_load.py and gpu/hf_check.py check correctness).

    python3 gpu/hf_load_bench.py --device cuda:0 --models llm,minilm --minilm DIR
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout

import entropykit  # noqa: E402

_LLM = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
            num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
            tie_word_embeddings=False)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _load(cls: type, path: Path, device: str) -> tuple[float, transformers.PreTrainedModel]:
    _sync(device)
    t0 = time.perf_counter()
    placed = {} if device == "cpu" else {"device_map": {"": device}}  # cpu: no accelerate
    model = cls.from_pretrained(path, dtype=torch.bfloat16, **placed)
    _sync(device)
    return time.perf_counter() - t0, model


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(
        sa[k].dtype == sb[k].dtype and torch.equal(_bits(sa[k]), _bits(sb[k])) for k in sa)


def _size(d: Path) -> int:
    return sum(p.stat().st_size for p in d.iterdir() if p.suffix == ".safetensors")


class _Steps:
    """Wall seconds of the entropykit quantizer's steps during compressed loads (its
    methods wrapped while the benchmark runs): ``open`` the shards (safe_open, before
    transformers reads weights; with a one-device map on a GPU, also the first group's
    plan and launch), ``decode`` the batches decoded when asked for (a
    shard's tensors at once), ``wait`` transformers' thread blocked for a batch
    (decoding it itself, or waiting for the one ahead), ``tensors`` every tensor handed
    to transformers (the waits, tensors decoded alone, casts). The batches decoded ahead
    on the GPU are one GPU load of every shard: its own accounting (``loader``; ``busy``
    its host time) says where that went."""

    _WRAPPED = {"_process_model_before_weight_loading": "open", "_decode_batch": "decode",
                "_batch": "wait", "decode": "tensors"}

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._runs: list[dict[str, float]] = []  # each GPU load's own accounting

    def __enter__(self) -> _Steps:
        from entropykit.hf import _quantizer

        cls = _quantizer.EntropyKitQuantizer
        self._saved = {name: cls.__dict__[name] for name in self._WRAPPED}
        for name, key in self._WRAPPED.items():
            setattr(cls, name, self._timed(self._saved[name], key))
        self._load = self._loader()
        if self._load is not None:
            self._load.stream = self._accounted(self._load.stream)
        return self

    @property
    def loader(self) -> dict[str, float]:
        """The GPU loads' own accounting, summed."""
        total: dict[str, float] = {}
        for run in self._runs:
            for k, v in run.items():
                total[k] = total.get(k, 0.0) + v
        return total

    def __exit__(self, *exc: object) -> None:
        from entropykit.hf import _quantizer

        for name, fn in self._saved.items():
            setattr(_quantizer.EntropyKitQuantizer, name, fn)
        if self._load is not None:
            self._load.stream = self._load.stream.__wrapped__

    @staticmethod
    def _loader():  # noqa: ANN205
        """The GPU loader's module, or None where it cannot be imported (no CuPy)."""
        try:
            from entropykit.container.cuda import load
        except ImportError:
            return None
        return load

    def _accounted(self, fn):  # noqa: ANN001, ANN202
        def accounted(*args, **kw):  # noqa: ANN002, ANN003, ANN202
            # a generator: its running totals are read when the benchmark reads them
            if kw.get("seconds") is None:
                kw["seconds"] = {}
            self._runs.append(kw["seconds"])
            return fn(*args, **kw)
        accounted.__wrapped__ = fn
        return accounted

    def _timed(self, fn, key: str):  # noqa: ANN001, ANN202
        def timed(*args, **kw):  # noqa: ANN002, ANN003, ANN202
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - t
        return timed


def _bench(name: str, cls: type, plain: Path, ek: Path, device: str, repeat: int,
           target: str) -> dict:
    best = {"plain": float("inf"), "ek": float("inf")}
    steps: dict[str, float] = {}
    inside: dict[str, float] = {}  # the loader's accounting during the best compressed load
    ref = None
    for _ in range(repeat):
        for kind, path in (("plain", plain), ("ek", ek)):
            with _Steps() as timed:
                t, model = _load(cls, path, device)
            if kind == "ek" and t < best[kind]:
                steps = dict(timed.seconds, total=t)
                inside = dict(timed.loader)
            best[kind] = min(best[kind], t)
            if kind == "plain":
                ref = model
            elif not _same(ref, model):
                raise SystemExit(f"{name}: the compressed load differs from the plain one")
            del model
            gc.collect()
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
        ref = None
        gc.collect()
    row = dict(model=name, target=target, device=device, plain_mb=_size(plain) / 1e6,
               ek_mb=_size(ek) / 1e6,
               plain_s=best["plain"], ek_s=best["ek"], speedup=best["plain"] / best["ek"],
               steps=steps, inside=inside)
    if device.startswith("cuda"):
        row["host"] = _host_seconds(ek, device)
        row["load_file"] = _load_file_seconds(plain, ek, device, repeat)
    if device == "cpu":  # the decode the compressed load adds, at the CPU's decode speed
        t0 = time.perf_counter()
        for p in sorted(ek.glob("*.safetensors")):
            entropykit.load_file(p)
        row["decode_s"] = time.perf_counter() - t0
        row["vs_bound"] = best["ek"] / (best["plain"] + row["decode_s"])
    return row


def _host_seconds(ek: Path, device: str) -> dict[str, float]:
    """Where one GPU load of every shard (``container.cuda.load.stream``, as
    from_pretrained's with a one-device map) spends its host time (the loader's own
    accounting: waiting for the plan, for a staging buffer, filling it, launching, the
    waits for each shard's checks; "total" the whole load), best of 3; empty (and a line
    saying why) if it fails: the table stands without it."""
    from entropykit.coding.parallel import resolve
    from entropykit.container import source
    from entropykit.container.cuda import load
    from entropykit.container.reader import Compressed
    from entropykit.dtypes import torch_types

    def once() -> dict[str, float]:
        seconds: dict[str, float] = {}
        with contextlib.ExitStack() as opened:
            shards = [Compressed(opened.enter_context(source.FileBytes(p)))
                      for p in sorted(ek.glob("*.safetensors"))]
            _sync(device)
            t0 = time.perf_counter()
            for _ in load.stream([(c, None) for c in shards], device, torch_types(),
                                 resolve(None), seconds=seconds):
                pass  # each shard's tensors dropped when the next is made
            _sync(device)
            seconds["total"] = time.perf_counter() - t0
        return seconds

    try:
        return min((once() for _ in range(3)), key=lambda g: g["total"])
    except Exception as e:  # noqa: BLE001
        print(f"{ek.name}: host breakdown failed: {e!r}", flush=True)
        return {}


def _load_file_seconds(plain: Path, ek: Path, device: str, repeat: int
                       ) -> tuple[float, float]:
    """Best seconds of ``safetensors.torch.load_file`` of the plain shards and of
    ``entropykit.load_file`` of the compressed ones onto ``device`` (each shard in turn,
    its tensors dropped before the next; alternately, ``repeat`` times each, after one
    warm-up of each)."""
    import safetensors.torch

    def timed(load, d: Path) -> float:
        _sync(device)
        t0 = time.perf_counter()
        for p in sorted(d.glob("*.safetensors")):
            load(p, device=device)
        _sync(device)
        return time.perf_counter() - t0

    best = [float("inf"), float("inf")]
    for k in range(repeat + 1):
        for i, (load, d) in enumerate(((safetensors.torch.load_file, plain),
                                       (entropykit.load_file, ek))):
            t = timed(load, d)
            if k:
                best[i] = min(best[i], t)
    return best[0], best[1]


def _llm(work: Path, layers: int) -> tuple[type, Path]:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=layers, **_LLM)
    with torch.device("cpu"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    d = work / "llm"
    model.save_pretrained(d, max_shard_size="500MB")
    return transformers.AutoModelForCausalLM, d


def _minilm(work: Path, src: Path) -> tuple[type, Path]:
    d = work / "minilm"
    d.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(src / name, d / name)
    return transformers.AutoModel, d


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda:0", help="cuda:N or cpu")
    ap.add_argument("--models", default="llm,minilm")
    ap.add_argument("--layers", type=int, default=2, help="blocks of the llm model")
    ap.add_argument("--minilm", type=Path, help="dir with config.json + bf16 model.safetensors")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--targets", default="cpu,gpu", help="compress targets (default: both)")
    ap.add_argument("--work", type=Path, help="scratch directory (default: a temporary one)")
    ap.add_argument("--plan-threads", type=int,
                    help="the GPU load's planning threads (default: the loader's choice)")
    ap.add_argument("--later", action="store_true",
                    help="start the GPU load on the quantizer's side thread, as before it "
                         "planned and launched its first group on the calling thread (an A/B)")
    args = ap.parse_args()
    if args.later:
        from entropykit import api

        many = api._load_many
        api._load_many = lambda jobs, device, threads, now=False: many(jobs, device, threads)
    if args.plan_threads is not None:
        from entropykit.container.cuda import fileplan

        fileplan.plan_threads = lambda c, entries, threads: min(threads, args.plan_threads)
    transformers.utils.logging.disable_progress_bar()
    if args.work is not None:
        args.work.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=args.work))
    rows = []
    try:
        for name in args.models.split(","):
            if name == "minilm" and args.minilm is None:
                print("minilm: left out (no --minilm)")
                continue
            cls, plain = _llm(work, args.layers) if name == "llm" else _minilm(work, args.minilm)
            for target in args.targets.split(","):
                ek = work / f"{name}.{target}.ek"
                t0 = time.perf_counter()
                entropykit.compress_file(plain, ek, target=target)
                print(f"{name}: compressed for {target} {_size(plain) / 1e6:.0f} -> "
                      f"{_size(ek) / 1e6:.0f} MB in {time.perf_counter() - t0:.1f} s", flush=True)
                rows.append(_bench(name, cls, plain, ek, args.device, args.repeat, target))
                shutil.rmtree(ek)
            shutil.rmtree(plain)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("| model | target | device | plain MB | ek MB | plain s | ek s | plain/ek | decode s | "
          "ek/(plain+decode) |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        extra = (f"{r['decode_s']:.3f} | {r['vs_bound']:.2f}" if "decode_s" in r else "- | -")
        print(f"| {r['model']} | {r['target']} | {r['device']} | {r['plain_mb']:.0f} | "
              f"{r['ek_mb']:.0f} | "
              f"{r['plain_s']:.3f} | {r['ek_s']:.3f} | {r['speedup']:.2f}x | {extra} |")
    for r in rows:
        print(f"{r['model']} ({r['target']}): the best compressed from_pretrained, quantizer "
              "steps ms: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in r["steps"].items()))
    for r in rows:
        if r.get("inside"):
            print(f"{r['model']} ({r['target']}): the GPU loader inside that from_pretrained, "
                  "host ms: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in r["inside"].items()))
    for r in rows:
        if r.get("load_file"):
            st, ek = r["load_file"]
            print(f"{r['model']} ({r['target']}): load_file onto {r['device']}, safetensors "
                  f"{st * 1e3:.1f} ms, entropykit {ek * 1e3:.1f} ms ({st / ek:.2f}x)")
    for r in rows:
        if r.get("host"):
            print(f"{r['model']} ({r['target']}): load_file of the shards onto {r['device']}, "
                  "host ms: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in r["host"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
