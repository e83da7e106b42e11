#!/bin/bash
# One device run of the static decoder's checks and benchmarks (carrying .gpu-bench):
# unpack the carried wheels, check the kernel (device_check.py), run the side-by-side
# benchmark (bench_gpu.py), then profile two launches with Nsight Compute. Logs go to $OUT.
#   .gpu-bench/minilm_bf16.ek.safetensors   compressed MiniLM-L6 bf16 (bench/data.py's cast)
#   .gpu-bench/whl/*.whl   zstandard (cp312), nvidia-nvcomp-cu13 + nvidia-libnvcomp-cu13
#                          6.0.0.12 (trimmed to cp312 / the libraries), dfloat11 0.5.0,
#                          dahuffman 0.4.2
set -o pipefail
export PYTHONUNBUFFERED=1
DATA=.gpu-bench/minilm_bf16.ek.safetensors
python3 -c "import zipfile, glob
for f in glob.glob('.gpu-bench/whl/*.whl'): zipfile.ZipFile(f).extractall('/tmp/site')" || exit 1
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit \
    --format=csv | tee "$OUT/smi.txt"
STEPS=${STEPS:-check,bench,ncu}
if [[ $STEPS == *stress* ]]; then
    python3 gpu/stress_check.py > "$OUT/stress_check.log" 2>&1
    echo "stress_check rc=$?"; tail -n 20 "$OUT/stress_check.log"
fi
if [[ $STEPS == *check* ]]; then
    python3 gpu/device_check.py --data $DATA --out "$OUT" > "$OUT/device_check.log" 2>&1
    echo "device_check rc=$?"; tail -n 25 "$OUT/device_check.log"
fi
if [[ $STEPS == *bench* ]]; then
    python3 gpu/bench_gpu.py --data $DATA --out "$OUT" $BENCH_ARGS 2>&1 | tee "$OUT/bench.log" \
        | grep -v '^{' | tail -n 40
fi
if [[ $STEPS == *ncu* ]] && command -v ncu > /dev/null; then
    timeout 240 ncu --clock-control none -k regex:rans_decode -c 3 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
        --section LaunchStats --section WarpStateStats --section InstructionStats \
        --section SchedulerStats --section ComputeWorkloadAnalysis \
        --metrics dram__bytes_read.sum,dram__bytes_write.sum,smsp__inst_executed.sum \
        python3 gpu/bench_gpu.py --profile --data $DATA > "$OUT/ncu.txt" 2>&1
    echo "ncu rc=$?"
    grep -E 'rans_decode|Duration|DRAM Throughput|Memory Throughput|dram__bytes|inst_executed|Executed Ipc A|Issue Slots Busy|Achieved Occupancy|Registers Per|Theoretical Occ|Stall|exact' "$OUT/ncu.txt" | head -n 60
fi
