"""Device check of the predictive KV path with the model on a GPU.

What it is: a script for a GPU machine. With a tiny random Llama in bf16 on
``cuda:0`` it checks (1) ``compress_kv`` of a CUDA cache and ``decompress_kv(...,
device="cuda")`` give back every bit, bf16 and fp8, every residual model (see (5)); (2)
``model.generate`` with ``transformers.Cache(layers=[PredictiveOffloadedLayer...],
offloading=True)`` — transformers' own offloading, prefetch stream and all — and with
``PredictiveOffloadedCache`` gives the same tokens and logits at every step as a plain
``DynamicCache``; it prints the transformers version it ran with; (3) the offload codec's
GPU coder: its (mu, sigma) on the device are the CPU's bit for bit, its frames decode with
the CPU coder and the CPU coder's with it, and generate() is equal with it, with the
FP8-of-target predictor and with none; (4) per-layer offload and prefetch times of a
larger prompt's cache (plain copies, the GPU coder, the CPU coder), a short table; (5)
``compress_kv`` with the GPU coder writes the CPU coder's blob byte for byte (every model,
the conditional one's affine on the device included) and each decodes the other's, and
both coders' times on a larger cache. It
exits non-zero on any mismatch. What it is not: the coder's benchmark (``kv_check.py``).

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site python3 gpu/kv_hook_check.py
"""

from __future__ import annotations

import sys
import time

import torch
import transformers
from transformers.cache_utils import DynamicLayer

from entropykit import predictive as P
from entropykit.predictive.hook import (
    KVOffloadCodec,
    PredictiveOffloadedCache,
    PredictiveOffloadedLayer,
)

DEV = "cuda:0"


def tiny_model(seed: int = 0) -> torch.nn.Module:
    """A random 4-layer Llama (4 heads, 2 kv heads x 32) in bf16 on the device."""
    cfg = transformers.LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).to(DEV).eval()


def calibrated(model: torch.nn.Module, gen: torch.Generator
               ) -> tuple[P.Predictor, P.Calibration, list[torch.Tensor]]:
    """The FP8-of-target predictor and its calibration on six random 128-token prompts."""
    prompts = [torch.randint(0, 512, (128,), generator=gen) for _ in range(6)]
    pred = P.FP8Predictor(model)
    return pred, P.calibrate(model, pred, prompts), prompts


def compress_kv_checks(model: torch.nn.Module, pred: P.Predictor, cal: P.Calibration,
                       gen: torch.Generator) -> list[str]:
    """Check (1) and (5): compress_kv / decompress_kv of a CUDA cache on both coders, bf16
    and fp8, every residual model; the failures' names."""
    failures = []
    ids = torch.randint(0, 512, (2, 200), generator=gen).to(DEV)
    with torch.inference_mode():
        cache = P.from_transformers(model(ids, use_cache=True).past_key_values)
    for name, c in (("bf16", cache), ("fp8", P.to_fp8(cache))):
        c = P.KVCache([k.to(DEV) for k in c.keys], [v.to(DEV) for v in c.values], c.scales)
        for kind in P.KINDS:
            blob = P.compress_kv(c, ids, pred, cal, model=kind, coder="gpu")
            host = P.compress_kv(c, ids, pred, cal, model=kind, coder="cpu")
            back = P.decompress_kv(host, pred, cal, device=DEV, coder="gpu")
            back_cpu = P.decompress_kv(blob, pred, cal, device=DEV, coder="cpu")
            ok = (blob == host and back.equal(c) and back_cpu.equal(c)
                  and back.keys[0].device == c.keys[0].device)
            bits = 8 * len(blob) / (2 * len(c.keys) * c.keys[0].numel())
            print(f"compress_kv {name:4s} {kind:11s}: {bits:6.3f} bits/value; GPU blob == "
                  f"CPU blob {blob == host}, each decodes on the other's coder {ok}")
            if not ok:
                failures.append(f"compress_kv {name} {kind}")
            if kind == "conditional":  # later groups' models rest on a corrupt group's values
                failures += _corrupt_blob(host, pred, cal, name)
    return failures


def generate_checks(model: torch.nn.Module, pred: P.Predictor, cal: P.Calibration,
                    gen: torch.Generator) -> list[str]:
    """Check (2): generate() through both offloaded caches equals a DynamicCache's."""
    failures = []
    prompt = torch.randint(0, 512, (1, 300), generator=gen).to(DEV)

    def generate(c):
        return model.generate(prompt, max_new_tokens=12, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, past_key_values=c)

    ref = generate(transformers.DynamicCache())
    layers = model.config.num_hidden_layers
    for label, make in (
        ("transformers.Cache(offloading=True)",
         lambda codec: transformers.Cache(
             layers=[PredictiveOffloadedLayer(codec, i) for i in range(layers)],
             offloading=True)),
        ("PredictiveOffloadedCache", lambda codec: PredictiveOffloadedCache(codec, layers)),
    ):
        for kind in ("gaussian", "mixture"):
            codec = KVOffloadCodec(pred, cal, model=kind, method="distribution")
            codec.set_prompt(prompt)
            c = make(codec)
            out = generate(c)
            same = torch.equal(out.sequences, ref.sequences) and all(
                torch.equal(a, b) for a, b in zip(out.logits, ref.logits, strict=True))
            packed = sum(layer.compressed_bytes() for layer in c.layers)
            print(f"generate, {label}, {kind}: identical tokens and logits {same}; "
                  f"prompt cache {packed:,} bytes compressed")
            if not same or packed == 0:
                failures.append(f"generate {label} {kind}")
    return failures


def main() -> int:
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.cuda.get_device_name(0)}")
    model = tiny_model()
    gen = torch.Generator().manual_seed(1)
    t = time.perf_counter()
    pred, cal, prompts = calibrated(model, gen)
    print(f"calibrate on {DEV}: {time.perf_counter() - t:.1f} s")
    failures = compress_kv_checks(model, pred, cal, gen)
    failures += _codec_times(gen)
    failures += generate_checks(model, pred, cal, gen)
    none, none_cal = no_predictor(model, prompts)
    failures += offload_codec_checks(model, pred, cal, none, none_cal, gen)
    failures += _timings(model, pred, cal, none, none_cal, gen)
    print("FAILURES: " + ", ".join(failures) if failures else "ALL OK")
    return 1 if failures else 0


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def no_predictor(model: torch.nn.Module, prompts: list) -> tuple[P.Predictor, P.Calibration]:
    """No predictor, calibrated for bf16 caches."""
    none = P.NoPredictor()
    return none, P.calibrate(model, none, prompts, formats=("bf16",))


def offload_codec_checks(model: torch.nn.Module, pred: P.Predictor, cal: P.Calibration,
                         none: P.Predictor, none_cal: P.Calibration,
                         gen: torch.Generator) -> list[str]:
    """Check (3): the offload codec's GPU coder against its CPU coder, generate() with it,
    and a corrupt frame under it; the failures' names."""
    failures = []
    layers = model.config.num_hidden_layers
    prompt = torch.randint(0, 512, (2, 256), generator=gen).to(DEV)
    with torch.inference_mode():
        cache = model(prompt, use_cache=True).past_key_values
    for name, pr, cl in (("fp8-of-target", pred, cal), ("none", none, none_cal)):
        for kind in ("gaussian", "mixture"):
            gpu = KVOffloadCodec(pr, cl, model=kind, coder="gpu", method="distribution")
            cpu = KVOffloadCodec(pr, cl, model=kind, coder="cpu", method="distribution")
            gpu.set_prompt(prompt)
            cpu.set_prompt(prompt)
            ok = True
            for i in range(layers):
                a = [x.cpu().view(torch.int32) for x in gpu.layer_distribution(i, DEV)[:2]]
                b = [x.view(torch.int32) for x in cpu.layer_distribution(i)[:2]]
                same = all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
                k, v = cache.layers[i].keys, cache.layers[i].values
                fg, fc = gpu.encode(i, k, v), cpu.encode(i, k, v)
                back = (gpu.decode(i, fc, DEV), cpu.decode(i, fg, DEV), gpu.decode(i, fg, DEV))
                exact = all(torch.equal(_bits(x), _bits(k)) and torch.equal(_bits(y), _bits(v))
                            for x, y in back)
                ok = ok and same and exact and fg.is_pinned()
            print(f"offload codec, {name}, {kind}: GPU (mu, sigma) = CPU's, frames decode "
                  f"across coders: {ok}")
            if not ok:
                failures.append(f"gpu coder {name} {kind}")
            codec = KVOffloadCodec(pr, cl, model=kind, coder="gpu", method="distribution")
            codec.set_prompt(prompt[:1])
            ref = model.generate(prompt[:1], max_new_tokens=8, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True,
                                 past_key_values=transformers.DynamicCache())
            c = transformers.Cache(layers=[PredictiveOffloadedLayer(codec, i)
                                           for i in range(layers)], offloading=True)
            out = model.generate(prompt[:1], max_new_tokens=8, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True,
                                 past_key_values=c)
            same = torch.equal(out.sequences, ref.sequences) and all(
                torch.equal(a, b) for a, b in zip(out.logits, ref.logits, strict=True))
            print(f"generate, Cache(offloading=True), GPU coder, {name}, {kind}: identical "
                  f"tokens and logits {same}")
            if not same:
                failures.append(f"generate gpu coder {name} {kind}")
    failures += _corrupt(model, none, none_cal, cache, prompt)
    return failures


def _corrupt_blob(blob: bytes, pred: P.Predictor, cal: P.Calibration, name: str) -> list[str]:
    """A flipped payload byte mid-blob: decompress_kv raises CorruptDataError on both
    coders (the GPU's decodes are all queued first and checked in order)."""
    from entropykit import CorruptDataError

    bad = bytearray(blob)
    bad[len(bad) // 2] ^= 0x40
    msgs = {}
    for coder in ("gpu", "cpu"):
        try:
            P.decompress_kv(bytes(bad), pred, cal, device=DEV, coder=coder)
        except CorruptDataError as e:
            msgs[coder] = str(e)
    ok = len(msgs) == 2
    print(f"decompress_kv {name} conditional, a flipped byte mid-blob: CorruptDataError on "
          f"both coders {ok} ({msgs.get('gpu', 'no error')[:70]})")
    return [] if ok else [f"decompress_kv {name} corrupt blob"]


def _corrupt(model: torch.nn.Module, none: P.Predictor, none_cal: P.Calibration,
             cache: transformers.Cache, prompt: torch.Tensor) -> list[str]:
    """A flipped payload byte under the GPU coder: prefetch() only queues the decode; the
    first read of keys raises CorruptDataError, and so does every later one."""
    from entropykit import CorruptDataError

    codec = KVOffloadCodec(none, none_cal, coder="gpu", method="distribution")
    codec.set_prompt(prompt)
    layer = PredictiveOffloadedLayer(codec, 1)
    layer.update(cache.layers[1].keys.clone(), cache.layers[1].values.clone())
    layer.offload()
    frame = layer._frame.clone()
    frame[frame.numel() // 4] ^= 0x10  # in the keys' half
    layer._frame = frame
    layer.prefetch()
    raised = 0
    for _ in range(2):
        try:
            layer.keys  # noqa: B018 - the read is the check
        except CorruptDataError as e:
            raised += 1
            msg = str(e)
    ok = raised == 2 and "chunk" in msg
    print(f"GPU coder, corrupt frame: prefetch queued, each read of keys raised "
          f"CorruptDataError: {ok} ({msg[:80]})")
    return [] if ok else ["gpu coder corrupt frame"]


def _generate_times(model: torch.nn.Module, none: P.Predictor, none_cal: P.Calibration,
                    prompt: torch.Tensor, gen: torch.Generator) -> None:
    """generate() of 16 tokens after the 16 x 1024-token prompt: no offloading, transformers'
    offloading, and it with compressed layers (no predictor, GPU coder), best of 3."""
    layers = model.config.num_hidden_layers

    def run(make) -> float:
        def once():
            model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16,
                           do_sample=False, past_key_values=make())
        return _best(once, 3)

    def ours(chunk):
        def make():
            codec = KVOffloadCodec(none, none_cal, coder="gpu", chunk_size=chunk,
                                   method="distribution")
            codec.set_prompt(prompt)
            return transformers.Cache(layers=[PredictiveOffloadedLayer(codec, i)
                                              for i in range(layers)], offloading=True)
        return make

    rows = [("DynamicCache, no offloading", transformers.DynamicCache),
            ("Cache(offloading=True), plain layers",
             lambda: transformers.Cache(layers=[DynamicLayer()
                                                for _ in range(layers)], offloading=True)),
            ("Cache(offloading=True), compressed, default chunks (by layer size)", ours(None)),
            ("Cache(offloading=True), compressed, chunks of 16384", ours(16384))]
    print(f"\ngenerate(16 new tokens) after a {tuple(prompt.shape)} prompt, {layers} layers, "
          "best of 3:")
    print("| cache | s |")
    print("|---|---:|")
    for label, make in rows:
        print(f"| {label} | {run(make):.3f} |")


def _codec_times(gen: torch.Generator) -> list[str]:
    """compress_kv / decompress_kv of a larger cache on the GPU coder and the CPU's (16
    threads): a random 4-layer Llama (8 heads, 4 kv heads x 64), 2 x 2048 tokens, bf16."""
    cfg = transformers.LlamaConfig(
        vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096)
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).to(DEV).eval()
    none = P.NoPredictor()
    cal = P.calibrate(model, none, [torch.randint(0, 512, (512,), generator=gen)
                                     for _ in range(4)])
    ids = torch.randint(0, 512, (2, 2048), generator=gen).to(DEV)
    with torch.inference_mode():
        cache = P.from_transformers(model(ids, use_cache=True).past_key_values)
    n = 2 * len(cache.keys) * cache.keys[0].numel()
    failures = []
    print(f"\ncompress_kv / decompress_kv of {n:,} bf16 values ({2 * n / 2**20:.0f} MiB), "
          "NoPredictor, best of 3 (s):")
    print("| model | coder | compress s | decompress s | bits/value |")
    print("|---|---|---:|---:|---:|")
    for kind in ("mixture", "conditional"):
        blobs = {}
        for coder in ("gpu", "cpu"):
            blobs[coder] = P.compress_kv(cache, ids, none, cal, model=kind, coder=coder,
                                         threads=16)
            back = P.decompress_kv(blobs[coder], none, cal, device=DEV, coder=coder,
                                   threads=16)
            if not back.equal(cache):
                failures.append(f"codec timing round trip {kind} {coder}")
            enc = _best(lambda c=coder, k=kind: P.compress_kv(
                cache, ids, none, cal, model=k, coder=c, threads=16), 3)
            dec = _best(lambda c=coder, b=blobs[coder]: P.decompress_kv(
                b, none, cal, device=DEV, coder=c, threads=16), 3)
            print(f"| {kind} | {coder} | {enc:.3f} | {dec:.3f} | "
                  f"{8 * len(blobs[coder]) / n:.3f} |")
        if blobs["gpu"] != blobs["cpu"]:
            failures.append(f"codec timing blobs differ {kind}")
    return failures


def _best(fn, reps: int = 5) -> float:
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def _timings(model: torch.nn.Module, pred: P.Predictor, cal: P.Calibration,
             none: P.Predictor, none_cal: P.Calibration, gen: torch.Generator) -> list[str]:
    """Per layer of a 16 x 1024-token prompt (keys and values, 2 kv heads x 64: 2 x 2 M
    values, 8 MiB of bf16): offload (to host) and prefetch (back) times, best of 5."""
    prompt = torch.randint(0, 512, (16, 1024), generator=gen).to(DEV)
    with torch.inference_mode():
        layer = model(prompt, use_cache=True).past_key_values.layers[2]
    k, v = layer.keys, layer.values
    n = k.numel() + v.numel()
    mib = n * 2 / 2**20
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in (k, v)]
    pageable = [t.to("cpu") for t in (k, v)]
    rows = [("plain copy, pageable", lambda: (k.to("cpu"), v.to("cpu")),
             lambda: [t.to(DEV) for t in pageable]),
            ("plain copy, pinned", lambda: (host[0].copy_(k), host[1].copy_(v)),
             lambda: [t.to(DEV, non_blocking=True) for t in host])]
    failures = []
    for label, pr, cl, coder, threads, chunk in (
            ("none, GPU coder, default chunks (by layer size)", none, none_cal, "gpu", 1, None),
            ("none, GPU coder, chunks of 4096", none, none_cal, "gpu", 1, 4096),
            ("none, GPU coder, chunks of 16384", none, none_cal, "gpu", 1, 16384),
            ("fp8-of-target, GPU coder, default chunks", pred, cal, "gpu", 1, None),
            ("fp8-of-target, GPU coder, chunks of 16384", pred, cal, "gpu", 1, 16384),
            ("none, CPU coder, 16 threads", none, none_cal, "cpu", 16, None)):
        codec = KVOffloadCodec(pr, cl, model="mixture", coder=coder, threads=threads,
                               chunk_size=chunk, method="distribution")
        codec.set_prompt(prompt)
        frame = codec.encode(2, k, v)
        bk, bv = codec.decode(2, frame, DEV)
        if not (torch.equal(_bits(bk), _bits(k)) and torch.equal(_bits(bv), _bits(v))):
            failures.append(f"timing round trip {label}")
        rows.append((f"{label} ({8 * len(frame) / n:.2f} bits/value)",
                     lambda c=codec: c.encode(2, k, v),
                     lambda c=codec, f=frame: c.decode(2, f, DEV)))
    _generate_times(model, none, none_cal, prompt, gen)
    print(f"\nper layer (keys and values, one frame), {n:,} values ({mib:.0f} MiB bf16), "
          "best of 5:")
    print("| path | offload ms | prefetch ms | prefetch GB/s of cache |")
    print("|---|---:|---:|---:|")
    for label, off, pre in rows:
        a, b = _best(off), _best(pre)
        print(f"| {label} | {1e3 * a:.2f} | {1e3 * b:.2f} | {mib * 2**20 / b / 1e9:.1f} |")
    return failures


if __name__ == "__main__":
    sys.exit(main())
