#!/usr/bin/env bash
# The GPU checks of the Triton expert kernels, in one go on a CUDA machine (run from the repo root):
#   1. the `gpu`-marked kernel tests (bf16 correctness, NF4 bit-identity with bitsandbytes' CUDA
#      kernel, producer and consumer running concurrently on two streams);
#   2. benchmarks/kernels.py --json once, then its table.
# Writes everything under $OUT (default ./gpu_checks_out). Exit code: 0 when tests passed and the
# benchmark ran, else the first failure's.
set -u
OUT="${OUT:-gpu_checks_out}"
mkdir -p "$OUT"
PY="${PY:-python}"
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
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

# growtrain.kernels is the repo's kernels/ folder, importable once the package is installed.
if ! "$PY" -c "import growtrain.kernels.weights" 2>/dev/null; then
  "$PY" -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.txt" 2>&1 || { echo "could not install growtrain (see $OUT/install.txt)"; exit 2; }
fi

timeout 420 "$PY" -m pytest -q -m gpu -p no:cacheprovider \
  tests/test_kernels_nf4.py tests/test_kernels_grouped.py tests/test_kernels_combine.py 2>&1 | tee "$OUT/pytest_gpu.txt"
rc_tests=${PIPESTATUS[0]}

timeout 300 "$PY" benchmarks/kernels.py --json > "$OUT/bench.json" 2> "$OUT/bench.err"
rc_bench=$?
if [ "$rc_bench" -eq 0 ]; then
  "$PY" benchmarks/kernels.py --table "$OUT/bench.json" | tee "$OUT/bench_table.txt"
else
  echo "benchmark failed (exit $rc_bench):"; tail -30 "$OUT/bench.err"
fi

echo "gpu tests exit $rc_tests, benchmark exit $rc_bench"
[ "$rc_tests" -ne 0 ] && exit "$rc_tests"
exit "$rc_bench"
