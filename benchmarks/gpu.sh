#!/usr/bin/env bash
# Every check that needs a CUDA GPU, in one run that fits a lent machine's lease: tests/gpu first (correctness),
# then the GPU benchmarks on Llama-2-7B's shape in bf16, most wanted first. Each part gets what is left of the
# budget (at most its own cap), so a slow part cuts the later ones short rather than the whole run; a part that
# cannot finish in what is left (its minimum: a report is written only at a benchmark's end) is skipped, and the
# time goes to the later ones.
#     benchmarks/gpu.sh OUT_DIR [BUDGET_SECONDS]      # summary.txt, log.txt and the JSON reports land in OUT_DIR
# On this workplace's device machine: ../shared/tools/gpu/prepare here once, then run with carry [".gpu"] and a
# budget that leaves the command's limit room for sourcing .gpu/env.sh (it installs wheels: 15-40 s) before it:
#     source .gpu/env.sh && benchmarks/gpu.sh $OUT 540         # (timeout_s 600)
set -uo pipefail
out=${1:?usage: benchmarks/gpu.sh OUT_DIR [BUDGET_SECONDS]}
grace=15  # what a part may run past its cap: SIGINT, then SIGKILL this much later
end=$(( $(date +%s) + ${2:-540} - grace ))
mkdir -p "$out"
part() {  # part NAME CAP MIN COMMAND...: run COMMAND with the smaller of CAP and what is left (skipped under MIN)
    local name=$1 cap=$2 min=$3 left=$(( end - $(date +%s) )); shift 3
    (( left < cap )) && cap=$left
    if (( cap < min )); then
        echo "$name: skipped, ${left}s of the budget left (it needs ${min}s)" | tee -a "$out/summary.txt"; return
    fi
    local start=$(date +%s)
    echo "=== $name: $*" >> "$out/log.txt"
    # SIGINT first: pytest then prints its summary and stops the servers a test started
    timeout -s INT -k "$grace" "$cap" "$@" >> "$out/log.txt" 2>&1
    echo "$name: exit $? in $(( $(date +%s) - start ))s (cap ${cap}s)" | tee -a "$out/summary.txt"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/summary.txt"
part tests 240 60 python3 -m pytest tests/gpu -p no:cacheprovider -rfEs --tb=short --timeout 150 \
    --ignore tests/gpu/test_serve_cuda_graphs.py
seven=(--device cuda --shape llama2-7b --dtype bfloat16)
# at most 8 files come back from a lent machine: summary.txt, log.txt and these six reports
part generate_b1 70 45 python3 benchmarks/bench_generate.py "${seven[@]}" --no-inseq --repeats 5 \
    --out "$out/generate_b1.json"
part generate_b16 80 50 python3 benchmarks/bench_generate.py "${seven[@]}" --no-inseq --repeats 5 --batch 16 \
    --out "$out/generate_b16.json"
part batching 150 100 python3 benchmarks/bench_batching.py "${seven[@]}" --cuda-graph --requests 32 \
    --out "$out/batching_cudagraphs.json"
part compiled 180 120 python3 benchmarks/bench_compiled.py "${seven[@]}" --repeats 3 --out "$out/compiled.json"
# two transformers serve processes (plain, then under nxl run) with CUDA graphs: after the figures, which are wanted first
part serve_tests 150 90 python3 -m pytest tests/gpu/test_serve_cuda_graphs.py -p no:cacheprovider -rfEs --tb=short \
    --timeout 140
# small models (hidden 512): the attached forward, and the 4-bit and offloaded paths, on CUDA
part forward 40 25 python3 benchmarks/bench_forward.py --device cuda --repeats 20 --out "$out/forward.json"
part big 60 40 python3 benchmarks/bench_big.py --device cuda --repeats 5 --out "$out/big.json"
