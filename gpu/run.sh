#!/bin/bash
# The GPU-machine suite in one command: the cuda tests (gpu/tests), then the benchmarks on
# whatever data is here, then a short summary. Logs and results go to $OUT (default
# /tmp/entropykit-gpu): summary.txt, tests.log, bench.log, bench_gpu.json/.md, kv.log,
# load.log, load.json, resident.log, offload.log. Exits non-zero when a test fails or skips or a step
# fails.
#   STEPS=tests,bench,kv,load,resident   the steps to run (default these; a step lacking its data
#                               is left out and says so); also "check" (device_check.py's
#                               timings per build) and "ncu" (Nsight Compute on two
#                               launches), both on the MiniLM file, and "offload"
#                               (kv_offload_bench.py: generate() with KV offloading)
#   BENCH_ARGS=...              more arguments for bench_gpu.py
#   RESIDENT_ARGS=...           more arguments for resident_check.py (--size 8b-blocks)
# Git-ignored folders it uses where present:
#   .whl/ .gpu-bench/whl/ .gpu-load/whl/   *.whl the machine lacks, unpacked into
#       /tmp/site: zstandard (entropykit imports it) for the tests; nvidia-nvcomp-cu13,
#       nvidia-libnvcomp-cu13, dfloat11 and dahuffman for bench_gpu.py's peers
#   .gpu-bench/minilm_bf16.ek.safetensors   bench_gpu.py's MiniLM sets (else synthetic only)
#   .gpu-load/load/*.ek.safetensors          load_check.py's files (else no load step)
set -o pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/entropykit-gpu}
STEPS=${STEPS:-tests,bench,kv,load,resident}
mkdir -p "$OUT"
python3 -c "import glob, zipfile
for f in sorted(glob.glob('.whl/*.whl') + glob.glob('.gpu-*/whl/*.whl')):
    zipfile.ZipFile(f).extractall('/tmp/site')" || exit 1
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}

rows=()
ran=
status=0
step() {  # step NAME LOG COMMAND...: run COMMAND into $OUT/LOG, keep a summary row
    local name=$1 log=$2 t0=$SECONDS rc
    shift 2
    echo "== $name: $*"
    "$@" > "$OUT/$log" 2>&1
    rc=$?
    ran+=" $name"
    tail -n 3 "$OUT/$log"
    [[ $rc == 0 ]] || status=1
    rows+=("$(printf '| %-6s | %-4s | %5ds | %s |' "$name" \
        "$([[ $rc == 0 ]] && echo ok || echo "rc=$rc")" $((SECONDS - t0)) "$log")")
}
skip() {
    rows+=("$(printf '| %-6s | %-4s | %6s | %s |' "$1" "-" "" "left out: $2")")
}

if [[ $STEPS == *tests* ]]; then
    step tests tests.log python3 -m pytest -m cuda gpu/tests tests/test_df11_compat.py -q -rs -p no:cacheprovider
    if tail -n 1 "$OUT/tests.log" | grep -q skipped; then  # a GPU machine runs them all
        status=1
        rows[${#rows[@]}-1]="| tests  | skip |        | a test skipped: see tests.log |"
    fi
fi
data=.gpu-bench/minilm_bf16.ek.safetensors
if [[ $STEPS == *check* ]]; then
    if [[ -f $data ]]; then
        step check check.log python3 gpu/device_check.py --data "$data" --out "$OUT"
    else
        skip check "no $data"
    fi
fi
if [[ $STEPS == *bench* ]]; then
    args=(--out "$OUT")
    [[ -f $data ]] && args+=(--data "$data")
    # shellcheck disable=SC2086 # BENCH_ARGS: several words
    step bench bench.log python3 gpu/bench_gpu.py "${args[@]}" $BENCH_ARGS
fi
if [[ $STEPS == *ncu* ]]; then
    if [[ -f $data ]] && command -v ncu > /dev/null; then
        step ncu ncu.log timeout 240 ncu --clock-control none -k regex:rans_decode -c 3 \
            --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
            --section LaunchStats --section WarpStateStats --section InstructionStats \
            --section SchedulerStats --section ComputeWorkloadAnalysis \
            --metrics dram__bytes_read.sum,dram__bytes_write.sum,smsp__inst_executed.sum \
            python3 gpu/bench_gpu.py --profile --data "$data"
    else
        skip ncu "no $data or no ncu"
    fi
fi
if [[ $STEPS == *kv* ]]; then
    step kv kv.log python3 gpu/kv_check.py --occupancy --out "$OUT"
fi
if [[ $STEPS == *load* ]]; then
    if compgen -G ".gpu-load/load/*.ek.safetensors" > /dev/null; then
        step load load.log python3 gpu/load_check.py --data .gpu-load/load --out "$OUT"
    else
        skip load "no .gpu-load/load/*.ek.safetensors"
    fi
fi
if [[ $STEPS == *resident* ]]; then
    step resident resident.log python3 gpu/resident_check.py $RESIDENT_ARGS
fi
if [[ $STEPS == *offload* ]]; then
    step offload offload.log python3 gpu/kv_offload_bench.py
fi

{
    if command -v nvidia-smi > /dev/null; then
        nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
        echo
    fi
    echo "| step   | rc   | time   | log |"
    echo "|---|---|---:|---|"
    printf '%s\n' "${rows[@]}"
    [[ $ran == *tests* ]] && echo && tail -n 1 "$OUT/tests.log"
    [[ $ran == *check* ]] && echo && sed -n '/^variant/,$p' "$OUT/check.log"
    [[ $ran == *bench* && -f $OUT/bench_gpu.md ]] && echo && cat "$OUT/bench_gpu.md"
    [[ $ran == *kv* ]] && echo && grep -E '^\|' "$OUT/kv.log"
    [[ $ran == *load* ]] && echo && sed -n '/ CPUs$/,$p' "$OUT/load.log"
    [[ $ran == *offload* ]] && echo && grep -E '^\||^random|^identical' "$OUT/offload.log"
} | tee "$OUT/summary.txt"
exit $status
