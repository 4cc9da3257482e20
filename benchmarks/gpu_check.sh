#!/bin/bash
# The GPU checks of docs/gpu.md in one run, on a machine with one CUDA GPU; logs go to $OUT.
#   OUT=/tmp/gpu-check bash benchmarks/gpu_check.sh
#   STEPS="cuda_tests digest" bash benchmarks/gpu_check.sh   # some of them
# Steps: install fxpar (no network: --no-index, carried wheels in .whl/ if any), calibrate the
# GPU, the Llama benchmark (benchmarks/gpu.py, alone on the GPU), the batch check's cost on the
# GPU, then, side by side, the CUDA tests, the property tests and the zoo on CUDA
# (FXPAR_TEST_DEVICE=cuda).
set -u
OUT=${OUT:-/tmp/gpu-check}
STEPS=${STEPS:-calibrate bench digest cuda_tests property zoo}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=ci
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . $(ls .whl/*.whl 2>/dev/null) > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
# pyproject's addopts ask for pytest-xdist, which the GPU machine may lack: run without it
# there, and spread the CUDA tests over 4 workers where it is.
PYTEST="python3 -m pytest -q -p no:cacheprovider -o addopts=-ra"
SPREAD=""
python3 -c "import xdist" 2>/dev/null && SPREAD="-n 4 --dist load"
wanted() { [[ " $STEPS " == *" $1 "* ]]; }
step() {  # step NAME SECONDS COMMAND...: run if wanted, log to $OUT/NAME.log, print its tail
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    wanted "$name" || return 0
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "=== $name: rc=$? in $((SECONDS - start)) s"
    tail -n "${TAIL:-14}" "$OUT/$name.log"
}
CLUSTER=()
wanted calibrate && CLUSTER=(--cluster-file "$OUT/cluster.json")
step calibrate 90 python3 -m fxpar calibrate --world 1 --cluster h100 --output "$OUT/cluster.json"
step bench "${BENCH_SECONDS:-200}" python3 benchmarks/gpu.py "${CLUSTER[@]}" ${BENCH_ARGS:-}
TAIL=8 step digest 120 python3 benchmarks/batch_digest.py --device cuda
TESTS=${TEST_SECONDS:-300}
TAIL=12 step cuda_tests "$TESTS" $PYTEST $SPREAD tests/test_cuda.py -rs &
FXPAR_TEST_DEVICE=cuda TAIL=6 step property "$TESTS" $PYTEST -x tests/test_property.py &
FXPAR_TEST_DEVICE=cuda TAIL=6 step zoo "$TESTS" $PYTEST tests/test_manual_plans_zoo.py -k "trains_like_one_device and not mixtral and not qwen2_moe and not bart" &
wait
