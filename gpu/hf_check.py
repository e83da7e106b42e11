"""Device check of ``from_pretrained`` on compressed checkpoint directories.

What it is: the script a GPU machine runs for the transformers loader. Tiny random Llama
(bf16, sharded) and GPT-2 (fp32, tied embeddings) models are saved, compressed for the
CPU and for the GPU (``target="gpu"``), and loaded with
``AutoModelForCausalLM.from_pretrained(dir, device_map={"": DEVICE})``; every compressed
load must give the state dict of the plain checkpoint's load bit for bit, the same logits
bit for bit, and (on a CUDA device) must have decoded every shard's tensors on the GPU in
one batch per shard (counted). Prints one line per case and ALL OK or FAILED.
What it is not: a benchmark or a CPU test (tests/test_hf_load.py is).

    python3 gpu/hf_check.py --device cuda:0     # needs accelerate (device_map), CuPy
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout

import entropykit  # noqa: E402
from entropykit import api  # noqa: E402

_SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()


def _same(a: transformers.PreTrainedModel, b: transformers.PreTrainedModel, device: str
          ) -> str | None:
    sa, sb = a.state_dict(), b.state_dict()
    if sa.keys() != sb.keys():
        return "state dict names differ"
    for k in sa:
        if sa[k].dtype != sb[k].dtype or str(sb[k].device) != str(sa[k].device):
            return f"{k}: {sb[k].dtype} on {sb[k].device}, plain {sa[k].dtype} on {sa[k].device}"
        if not torch.equal(_bits(sa[k]), _bits(sb[k])):
            return f"{k}: bits differ"
    x = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        if not torch.equal(_bits(a(x).logits), _bits(b(x).logits)):
            return "logits differ"
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda:0")
    args = ap.parse_args()
    batches = []  # (device, tensors) of each batch the quantizer decoded
    load = api._load_compressed

    def counted(c, device, threads, names=None):  # noqa: ANN001, ANN202
        if names is not None:
            batches.append((str(device), len(names)))
        return load(c, device, threads, names)

    api._load_compressed = counted
    kwargs = {"device_map": {"": args.device}} if args.device != "cpu" else {}
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        models = {
            "llama-bf16-sharded": (transformers.LlamaConfig(**_SMALL), torch.bfloat16, "40KB"),
            "gpt2-f32-tied": (transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=2,
                                                      n_head=4, n_positions=64),
                              torch.float32, None),
        }
        for name, (cfg, dtype, shard) in models.items():
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)
            plain_dir = root / name
            model.save_pretrained(plain_dir, **({"max_shard_size": shard} if shard else {}))
            plain = transformers.AutoModelForCausalLM.from_pretrained(plain_dir, **kwargs)
            for target in ("cpu", "gpu"):
                ek = root / f"{name}.{target}.ek"
                entropykit.compress_file(plain_dir, ek, target=target)
                batches.clear()
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    packed = transformers.AutoModelForCausalLM.from_pretrained(ek, **kwargs)
                fallback = [str(w.message) for w in caught if "decoded on the CPU" in
                            str(w.message)]
                err = _same(plain, packed, args.device)
                on_gpu = [n for dev, n in batches if dev.startswith("cuda")]
                shards = len(list(ek.glob("*.safetensors")))
                if err is None and args.device.startswith("cuda") and (
                        len(on_gpu) != len(batches) or len(on_gpu) != shards):
                    err = f"GPU batches {on_gpu} of {batches}, expected one per shard ({shards})"
                if err is None and fallback:
                    err = fallback[0]
                failed += err is not None
                print(f"{name} target={target} device={args.device}: "
                      f"{'ok' if err is None else 'FAILED: ' + err} "
                      f"({sum(on_gpu)} tensors decoded on the GPU in {len(on_gpu)} "
                      "batches)")
    print("ALL OK" if not failed else f"FAILED ({failed})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
