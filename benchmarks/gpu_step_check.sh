#!/usr/bin/env bash
# The GRPO step benchmark (benchmarks/grpo_step.py) on a GPU machine without network, as one command run from
# the repository's root:
#
#     bash benchmarks/gpu_step_check.sh          # about 6 minutes: the installs, then a 330 s budget
#
# It needs .gpu-wheels/ (`make gpu-step-wheels` on a machine with network, then copy the folder across): trl,
# liger-kernel, datasets, dill and multiprocess are installed from it where missing, offline and without their
# requirements, so the machine's torch, triton and transformers stay as they are. Then the Qwen2-0.5B shape and
# the Qwen2-1.5B shape, each variant's completions doubling from 1024 tokens until memory runs out. The rows go
# to $OUT/grpo_step.jsonl and the printed table to $OUT/grpo_step.log when OUT is set (else benchmarks/results/).
# Options of grpo_step.py may follow and win over these, e.g. `--gradient-checkpointing --budget 200`, or
# `--device cpu --quick` for the command's own check on a CPU. BENCH_PYTHON picks the Python (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
python=${BENCH_PYTHON:-python3}
results=${OUT:-benchmarks/results}
mkdir -p "$results"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
    "$python" benchmarks/grpo_step.py --wheels .gpu-wheels --budget 330 --shapes qwen2-0.5b,qwen2-1.5b \
        --out "$results/grpo_step.jsonl" "$@"
} 2>&1 | tee "$results/grpo_step.log"
