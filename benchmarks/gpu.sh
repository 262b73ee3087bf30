#!/usr/bin/env bash
# On a machine with a CUDA GPU and a Python that has jax with its CUDA plugin,
# nanobind, scikit-build-core, cmake, ninja, optax, flax and pytest: builds
# jaxcomp with its CUDA module, runs tests/test_gpu.py (CUDA kernels against
# the twins and the CPU kernels, byte for byte), then the codec throughput
# benchmark on the GPU.
#
#     bash benchmarks/gpu.sh [build|test|bench]...   # default: all three
#
# Logs go to $LOGS (default build/gpu-logs). CUDAARCHS picks the GPU
# architectures to build for (default: the one of the GPU present).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOGS=${LOGS:-build/gpu-logs}
mkdir -p "$LOGS"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(build test bench)
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
failed=0

for step in "${steps[@]}"; do
  case $step in
  build)
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$LOGS/env.txt"
    nvcc --version | tail -n 2 | tee -a "$LOGS/env.txt"
    "$PY" -c 'import jax; print("jax", jax.__version__, jax.devices())' | tee -a "$LOGS/env.txt"
    if [ -z "${CUDAARCHS:-}" ]; then
      cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1)
      export CUDAARCHS=${cap/./}
    fi
    start=$SECONDS
    JAXCOMP_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
      "$PY" -m pip install --no-build-isolation --no-deps --no-index -v -e . >"$LOGS/build.log" 2>&1 ||
      { tail -n 60 "$LOGS/build.log"; exit 1; }
    echo "build (CUDAARCHS=$CUDAARCHS): $((SECONDS - start)) s" | tee -a "$LOGS/env.txt"
    "$PY" -c 'import jaxcomp; assert jaxcomp.cuda_available(), "no CUDA module"; print("CUDA kernels registered")'
    ;;
  test)
    # A failing test does not stop the benchmark that follows; the exit
    # status of the whole script says whether any test failed.
    "$PY" -m pytest -q -p no:cacheprovider -n "${WORKERS:-8}" tests/test_gpu.py \
      --junitxml="$LOGS/test_gpu.xml" >"$LOGS/test_gpu.log" 2>&1 || failed=1
    tail -n 40 "$LOGS/test_gpu.log"
    ;;
  bench)
    # Writes benchmarks/results/codecs-gpu.json and the GPU section of
    # docs/benchmarks.md; copies of both go to $LOGS.
    "$PY" benchmarks/codecs.py --platform gpu --log2-sizes ${SIZES:-20 24 26} 2>&1 |
      tee "$LOGS/bench.log"
    cp benchmarks/results/codecs-gpu.json docs/benchmarks.md "$LOGS/"
    ;;
  *)
    echo "unknown step: $step" >&2
    exit 2
    ;;
  esac
done
exit $failed
