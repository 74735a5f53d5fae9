#!/usr/bin/env bash
# The one prepared call for a GPU machine (run from the repo root after `make setup`), under 9 min:
#   1. the `gpu`-marked kernel tests (bf16 correctness, NF4 bit-identity with bitsandbytes' CUDA
#      kernel, producer and consumer running concurrently on two streams);
#   2. benchmarks/kernels.py --json once, then its table (its targets gate the exit code);
#   3-5. benchmarks/gpu_train_checks.py: the shortened tiny recipe trained on cuda (Triton backend):
#      growth checks, losses vs a CPU fp32 run, kill -9 + resume, growth on the host (train.grow_on)
#      vs on the GPU; peak memory per stage vs the plan;
#      host syncs per step under torch.cuda.set_sync_debug_mode;
#   6. with 2+ GPUs: a short torchrun run (NCCL, expert parallelism, overlapped combine).
#   7. with 2+ GPUs: the same in the AF layout (interleaved schedule), and from 4 GPUs benchmarks/af_pipeline.py.
#   8. benchmarks/gpu_step.py: every stage of recipes/120b.yaml as one of its 8 ranks runs it
#      (tokens/s, TFLOP/s, MFU, peak memory against the plan, share of step time per part).
# `--cpu`: parts 3-5 only, on the CPU with the reference backend (CI runs this form, so the script
# cannot rot while no GPU is at hand). Writes everything under $OUT (default ./gpu_checks_out),
# with summary.txt; exit code 0 only when every part that ran passed.
#
# Order on a GPU: the benchmark first, on an idle GPU; then the kernel tests and the training
# checks side by side (their outputs in files, shown after). PARTS="1 3" runs only those parts;
# BENCH_ARGS passes options to benchmarks/kernels.py.
# Python packages the GPU image lacks (bitsandbytes) are taken from wheels in .whl/ when present
# (docs/gpus.md, GPU validation), since such a machine may reach no package index.
set -u
OUT="${OUT:-gpu_checks_out}"
mkdir -p "$OUT"
PY="${PY:-$(command -v python || command -v python3)}"
PARTS="${PARTS:-1 2 8 3 6}"
CPU=0
[ "${1:-}" = "--cpu" ] && CPU=1
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
declare -A RC
want() { [[ " $PARTS " == *" $1 "* ]]; }

if [ "$CPU" -eq 0 ]; then
  unset TRITON_INTERPRET  # compiled kernels here, not the interpreter
  {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
    "$PY" - <<'PYEOF'
import importlib
for name in ("torch", "triton", "bitsandbytes", "pytest", "hypothesis"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as exc:
        print(name, "MISSING", exc)
import torch
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else "")
PYEOF
  } > "$OUT/env.txt" 2>&1
  cat "$OUT/env.txt"
fi

if ! "$PY" -c "import bitsandbytes" 2>/dev/null && compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile .whl/*.whl > "$OUT/install_wheels.txt" 2>&1 || echo "could not install .whl/ (see $OUT/install_wheels.txt)"
fi
# growtrain is the repo, importable once the package is installed.
if ! "$PY" -c "import growtrain.kernels.weights, growtrain.train" 2>/dev/null; then
  "$PY" -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.txt" 2>&1 || { echo "could not install growtrain (see $OUT/install.txt)"; exit 2; }
fi

if [ "$CPU" -eq 0 ] && want 2; then
  # BENCH_ARGS="--sweep --profile" (with BENCH_TIMEOUT=300) adds the tile-config sweep and a kernel profile.
  timeout "${BENCH_TIMEOUT:-150}" "$PY" benchmarks/kernels.py --json ${BENCH_ARGS:-} > "$OUT/bench.json" 2> "$OUT/bench.err"
  RC[2_kernel_benchmark]=$?
  if [ -s "$OUT/bench.json" ]; then  # exit 1: a target missed, the figures are there
    "$PY" benchmarks/kernels.py --table "$OUT/bench.json" | tee "$OUT/bench_table.txt"
  else
    echo "benchmark failed (exit ${RC[2_kernel_benchmark]}):"; tail -30 "$OUT/bench.err"
  fi
fi

if [ "$CPU" -eq 0 ] && want 8; then  # on an idle GPU too: its figures are timings
  timeout "${STEP_TIMEOUT:-150}" "$PY" benchmarks/gpu_step.py --reps 2 --json > "$OUT/gpu_step.json" 2> "$OUT/gpu_step.err"
  RC[8_gpu_step]=$?
  if [ -s "$OUT/gpu_step.json" ]; then
    "$PY" -c "import json, sys; sys.path.insert(0, 'benchmarks'); import gpu_step; print(gpu_step.table(json.load(open('$OUT/gpu_step.json'))))" | tee "$OUT/gpu_step.txt"
  else
    echo "gpu_step failed (exit ${RC[8_gpu_step]}):"; tail -30 "$OUT/gpu_step.err"
  fi
fi

DEVICE=cuda
[ "$CPU" -eq 1 ] && DEVICE=cpu
if want 3; then
  timeout 360 "$PY" benchmarks/gpu_train_checks.py --device "$DEVICE" --out "$OUT/train" > "$OUT/train_checks.txt" 2>&1 &
  TRAIN_PID=$!
fi
if [ "$CPU" -eq 0 ] && want 1; then
  TIMEOUT_OPT=$("$PY" -c "import pytest_timeout" 2>/dev/null && echo "--timeout 90")  # a spinning kernel fails its test, not the part
  timeout 240 "$PY" -m pytest -v --tb=short -m gpu -p no:cacheprovider $TIMEOUT_OPT \
    tests/test_kernels_nf4.py tests/test_kernels_grouped.py tests/test_kernels_combine.py > "$OUT/pytest_gpu.txt" 2>&1
  RC[1_kernel_tests]=$?
  cat "$OUT/pytest_gpu.txt"
fi
if want 3; then
  wait "$TRAIN_PID"
  RC[3_5_training]=$?
  cat "$OUT/train_checks.txt"
fi

if [ "$CPU" -eq 0 ] && want 6; then
  NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  if [ "$NGPU" -ge 2 ]; then
    timeout 120 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NGPU" -m growtrain run tiny --out "$OUT/ep_run" \
      --set stages.0.steps=20 --set stages.1.steps=10 --set stages.2.steps=10 --set stages.3.steps=5 --set schedule.warmup_steps=5 \
      --set tracking.wandb.mode=disabled --set invariance.probe_batch_size=$(( NGPU > 4 ? NGPU : 4 )) 2>&1 | tail -40 | tee "$OUT/ep_run.txt"
    RC[6_torchrun_nccl]=${PIPESTATUS[0]}
    # The AF layout on the node: half the GPUs attention ranks, two micro-batches in flight on each
    # (interleaved: grad_accum 2); then every schedule against the planner (benchmarks/af_pipeline.py).
    timeout 120 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NGPU" -m growtrain run tiny --out "$OUT/af_run" \
      --set stages.0.steps=20 --set stages.1.steps=10 --set stages.2.steps=10 --set stages.3.steps=5 --set schedule.warmup_steps=5 \
      --set tracking.wandb.mode=disabled --set distributed.layout=af --set distributed.attention_ranks=$(( NGPU / 2 )) \
      --set distributed.af_schedule=interleaved --set stages.0.grad_accum=2 --set stages.1.grad_accum=2 --set stages.2.grad_accum=2 \
      --set stages.3.grad_accum=2 2>&1 | tail -40 | tee "$OUT/af_run.txt"
    RC[7_af_layout]=${PIPESTATUS[0]}
    if [ "$NGPU" -ge 4 ]; then
      timeout 150 "$PY" benchmarks/af_pipeline.py --nproc "$NGPU" --attention $(( NGPU / 2 )) --batch $(( 4 * NGPU )) --d-model 1024 \
        --json > "$OUT/af_pipeline.json" 2> "$OUT/af_pipeline.err"
      RC[7_af_pipeline]=$?
    fi
  else
    echo "6_torchrun_nccl, 7_af_layout: skipped, $NGPU GPU(s)" | tee "$OUT/ep_run.txt"
  fi
fi

status=0
{
  echo "part                 exit"
  for k in $(printf '%s\n' "${!RC[@]}" | sort); do
    printf '%-20s %s\n' "$k" "${RC[$k]}"
    [ "${RC[$k]}" -ne 0 ] && status=1
  done
} | tee "$OUT/summary.txt"
for k in "${!RC[@]}"; do [ "${RC[$k]}" -ne 0 ] && status=1; done
exit $status
