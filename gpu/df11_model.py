"""Make a DFloat11 checkpoint of a bf16 Llama-style model, for resident mode's side-by-side.

What it is: DFloat11's own ``compress_model`` (pip ``dfloat11``: its Huffman code, its
buffers and file layout, and its correctness check, which decodes every compressed block
with its own CUDA kernel and compares it with the original weights), with one substitution:
the per-block bit packing (``encode_weights``, a Python loop over every symbol) is done by
``df11_codec.encode``, the vectorized twin that ``bench_gpu.py --df11-selftest`` checks
byte for byte against the package's encoder. The output directory loads with
``DFloat11Model.from_pretrained(DIR, device=...)`` (on transformers 5 after
``df11_compat.install()``), which is what ``resident_check.py --df11 DIR`` does.
What it is not: part of entropykit, or a change to DFloat11's format.

    python3 gpu/resident_check.py --size 8b-blocks --save-plain /tmp/plain
    python3 gpu/df11_model.py /tmp/plain /tmp/df11
    python3 gpu/resident_check.py --size 8b-blocks --df11 /tmp/df11
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import df11_codec  # noqa: E402

# DFloat11's pattern for Llama-style models: embeddings and head whole, each block's seven
# projections coded together.
LLAMA_PATTERNS = {
    r"model\.embed_tokens": [],
    r"lm_head": [],
    r"model\.layers\.\d+": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                            "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                            "mlp.down_proj"],
}


def _code_of(codec) -> df11_codec.Code:
    """``df11_codec.Code`` of a dahuffman codec as ``get_32bit_codec`` returned it."""
    lengths = torch.zeros(256, dtype=torch.int64)
    values = torch.zeros(256, dtype=torch.int64)
    for k, (b, v) in codec._table.items():
        if isinstance(k, int):
            lengths[k], values[k] = b, v
    return df11_codec.Code(lengths, values, tuple(codec._table[codec._eof]), torch.empty(0))


def _encode_weights(weights, codec, bytes_per_thread, threads_per_block):
    """``dfloat11_utils.encode_weights``' results, packed on the GPU by the twin."""
    assert bytes_per_thread == df11_codec.BYTES_PER_THREAD
    assert threads_per_block == df11_codec.THREADS_PER_BLOCK
    split = torch.cumsum(torch.tensor([w.numel() for w in weights], dtype=torch.int64), 0)[:-1]
    bits = torch.cat(weights).view(torch.int16)
    exponents = ((bits >> 7) & 0xFF).to(torch.uint8)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    encoded, gaps, positions = df11_codec.encode(exponents.to(dev), _code_of(codec))
    return (encoded.cpu(), df11_codec.other_bits(bits), positions.cpu(), gaps.cpu(), split)


def build(model: torch.nn.Module, out: Path) -> int:
    """Write ``model`` (bf16, Llama-style; its coded weights are taken off it) as a
    DFloat11 checkpoint in ``out``; the number of blocks DFloat11's kernel checked (none
    without a GPU: ``df11_compat.weight_mismatches`` checks the loaded model instead)."""
    import df11_compat

    df11_compat.install()  # dfloat11 imports pkg_resources, which setuptools may lack
    check = torch.cuda.is_available()
    if not check:
        df11_compat.use_cpu_kernel()  # its import needs CuPy
    from dfloat11 import dfloat11 as D

    real = D.encode_weights
    D.encode_weights = _encode_weights
    out.mkdir(parents=True, exist_ok=True)
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):  # a code table and a line per block
            D.compress_model(model, LLAMA_PATTERNS, str(out), save_single_file=True,
                             check_correctness=check)
    finally:
        D.encode_weights = real
    # compress_model leaves a config.json holding only dfloat11_config; from_pretrained
    # reads the model's config from there too.
    model.config.save_pretrained(out)
    return log.getvalue().count("Correctness check passed")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("plain", type=Path, help="a bf16 model directory (save_pretrained)")
    ap.add_argument("out", type=Path, help="the DFloat11 checkpoint directory to write")
    args = ap.parse_args(argv)
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(args.plain,
                                                              dtype=torch.bfloat16)
    checks = build(model, args.out)
    size = sum(f.stat().st_size for f in args.out.glob("*.safetensors"))
    checked = (f"{checks} blocks checked by DFloat11's kernel" if torch.cuda.is_available()
               else "not checked here (no GPU): resident_check --df11 checks the model it loads")
    print(f"DFloat11 checkpoint {args.out}: {size / 2**20:,.0f} MiB, {checked}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
