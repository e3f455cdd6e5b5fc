#!/usr/bin/env bash
# What a GPU session measures, as one command for a machine without network, run from the repository's root:
#
#     bash benchmarks/gpu_session.sh                 # every part: at most 14 minutes (each command has a limit)
#     bash benchmarks/gpu_session.sh checks hidden   # at most 7 minutes; then `plain step`, at most 7 minutes
#
# Parts, in this order, each under its own time limit, each printing its rows as they are measured:
#   checks  the Triton kernels on CUDA against float64 and compiled by the machine's Triton (`make gpu-check` adds
#           every loss call under CUDA's host-sync check)
#   plain   the plain loss against verl at B = 64, T = 4096 (metrics read one by one, as verl's actor reads them)
#           and B = 256, T = 8192 (read in one copy): eager, compiled, CUDA graphs, with where each step's time goes;
#           then its kernel launches on CUDA
#   hidden  the loss from hidden states at both shapes of BENCHMARKS.md, the library's routes beside Cut
#           Cross-Entropy and Liger (warmed up on another shape and on the timed one)
#   step    TRL's GRPO step on the Qwen2-1.5B shape with gradient checkpointing: TRL's loss, pgloss's, pgloss fused
#
# It needs .gpu-wheels/ (`make gpu-step-wheels` on a machine with network, then copy the folder across): what is
# missing of trl, liger-kernel, datasets, dill, multiprocess, cut-cross-entropy and verl is installed from it,
# offline and without requirements, so the machine's torch, triton and transformers stay. Every part's output goes
# to a log in $OUT when it is set, else in a new folder benchmarks/results/session-<time>/: nothing is overwritten,
# and a part cut short by its limit (or by a signal) keeps what it printed. BENCH_PYTHON picks the Python.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${BENCH_PYTHON:-python3}
out=${OUT:-benchmarks/results/session-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$out"
export PYTHONPATH="$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
parts=${*:-checks plain hidden step}

# run NAME SECONDS COMMAND...: the command's output printed and kept in $out/NAME.log, stopped after SECONDS. A
# command that fails does not stop the session (the next part still measures); the session's status says it failed.
failed=0
run() {
    local name=$1 limit=$2 status
    shift 2
    echo "== $name (at most $limit s): $*" | tee -a "$out/$name.log"
    timeout --signal=INT --kill-after=15 "$limit" "$@" 2>&1 | tee -a "$out/$name.log"
    status=${PIPESTATUS[0]}
    echo "== $name: exit $status ($(date -u +%H:%M:%S))" | tee -a "$out/$name.log"
    [ "$status" -eq 0 ] || failed=1
}

{
    date -u +%Y-%m-%dT%H:%M:%SZ
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
    "$python" - <<'EOF'
import dataclasses, grpo_step, peers
# the step's peers, and Cut Cross-Entropy (without its requirements, as those) and verl for the other parts
wanted = {**grpo_step.STEP_PEERS, "cce": dataclasses.replace(peers.PEERS["cce"], no_deps=True), "verl": peers.PEERS["verl"]}
print("installed from .gpu-wheels:", peers.install_missing(".gpu-wheels", wanted) or "nothing was missing")
print("versions:", peers.versions())
EOF
} 2>&1 | tee "$out/setup.log"

xdist=$("$python" -c "import xdist" 2>/dev/null && echo "-n 8")
small=(--tokens 4096 --seq-len 256 --hidden 896 --vocab 151936)
large=(--tokens 16384 --seq-len 256 --hidden 3584 --vocab 152064)
for part in $parts; do
    case $part in
    checks)
        run checks 150 "$python" -m pytest -q -p no:cacheprovider $xdist tests/vocab/test_kernels.py \
            tests/vocab/test_head_kernel.py tests/vocab/test_autocast.py tests/vocab/test_kernels_compile.py
        ;;
    plain)
        run plain 90 "$python" benchmarks/plain.py --device cuda --batch 64 --length 4096 --repeats 30 --profile
        run plain 90 "$python" benchmarks/plain.py --device cuda --batch 256 --length 8192 --repeats 20 \
            --read once --profile
        run plain 40 "$python" benchmarks/launches.py --device cuda --batch 64 --length 4096 --repeats 15
        ;;
    hidden)
        run hidden 105 "$python" benchmarks/fused.py --device cuda --dtype bfloat16 "${small[@]}" --repeats 5 \
            --timeout 40 --variants floor,naive,fused,fused-head-kernel,tiled,trl,cce,liger,liger-static
        run hidden 105 "$python" benchmarks/fused.py --device cuda --dtype bfloat16 "${large[@]}" --repeats 3 \
            --timeout 45 --variants floor,fused,fused-head-kernel,tiled,cce
        run hidden 60 "$python" benchmarks/fused.py --device cuda --dtype bfloat16 "${large[@]}" --repeats 3 \
            --timeout 45 --variants fused-head-kernel --head-blocks 128,128,64,8   # twice the rows a block
        ;;
    step)
        run step 200 "$python" benchmarks/grpo_step.py --budget 160 --shapes qwen2-1.5b --variants trl,pgloss,fused \
            --gradient-checkpointing --out "$out/grpo_step.jsonl"
        ;;
    *)
        echo "unknown part $part: the parts are checks, plain, hidden, step" >&2
        exit 2
        ;;
    esac
done
echo "== done: $out"
exit $failed
