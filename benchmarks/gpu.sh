#!/usr/bin/env bash
# One command on a GPU machine that has a Python with jax and its CUDA plugin,
# nanobind, scikit-build-core, cmake, optax, flax and pytest (no network
# needed): builds jaxcomp with its CUDA module and runs, each step's log in
# $LOGS (default build/gpu-logs):
#   build  the wheel with the CUDA module, installed (not editable: the
#          checkout then loads the installed kernels, jaxcomp/_ffi.py)
#   test   tests/test_gpu.py: the CUDA kernels and the twin on the GPU against
#          the CPU kernels, byte for byte; the golden vectors, the collectives
#          and a train step on the GPU
#   fast   the fast tier (pytest -m "not slow and not multiprocess"), as on a
#          CPU machine: the suite's default platform is the CPU there too
#   arith  benchmarks/xla_arith.py: which float32 operations XLA's GPU code
#          rounds as IEEE 754 does
#   bench  the codec throughput at 2^26 on the GPU (benchmarks/codecs.py), and
#          error feedback's one-pass kernels against the separate calls
#          (benchmarks/feedback.py)
#   step   the train step of a 67M-parameter MLP on a one-GPU mesh, plain
#          against every codec, PowerSGD and onebit_adam (benchmarks/train_step.py),
#          then QSGD-4's step without, with one and with two levels of error
#          feedback (--ablate)
#
#     bash benchmarks/gpu.sh [build|test|fast|arith|bench|step]...   # default: all
#
# About 7 minutes on one H200 with 16 cores (docs/gpu.md). CUDAARCHS picks the
# GPU architectures to build for (default: the one of the GPU present); each
# step has a time limit (seconds: TEST_S, FAST_S, BENCH_S, FEEDBACK_S, STEP_S),
# so that one slow step cannot take the others' time. STEP_PATHS: the paths
# of the GPU kernels each codec's step runs (benchmarks/train_step.py
# --paths; default "rule one-pass calls twins"); ABLATE: the codec of the
# error-feedback ablation (default qsgd:bits=4; empty: none). ARCHIVE: a
# tarball of $LOGS written after every step, so that a run cut short still
# leaves the logs of the steps it finished.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOGS=${LOGS:-build/gpu-logs}
mkdir -p "$LOGS"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(build test fast arith bench step)
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false JAXCOMP_REQUIRE_KERNELS=1
workers=${WORKERS:-$(nproc)}
failed=()
t_all=$SECONDS

run_step() {  # name, then the command; its output to $LOGS/name.log
  local name=$1 t0=$SECONDS rc
  shift
  "$@" >"$LOGS/$name.log" 2>&1
  rc=$?
  printf '%-6s rc %3d  %4d s\n' "$name" "$rc" "$((SECONDS - t0))" | tee -a "$LOGS/steps.txt"
  [ $rc -eq 0 ] || failed+=("$name")
  [ -z "${ARCHIVE:-}" ] || tar czf "$ARCHIVE" -C "$(dirname "$LOGS")" "$(basename "$LOGS")"
  return $rc
}

for step in "${steps[@]}"; do
  case $step in
  build)
    {
      nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
      nvcc --version | tail -n 2
      "$PY" -c 'import jax; print("jax", jax.__version__, jax.devices())'
      echo "cores: $(nproc)"
    } >"$LOGS/env.txt" 2>&1
    if [ -z "${CUDAARCHS:-}" ]; then
      cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1)
      export CUDAARCHS=${cap/./}
    fi
    run_step build env JAXCOMP_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
      "$PY" -m pip install --no-build-isolation --no-deps --no-index -v . ||
      { tail -n 60 "$LOGS/build.log"; exit 1; }
    "$PY" -c 'import jaxcomp; print(jaxcomp._ffi.kernels_line())' | tee -a "$LOGS/env.txt"
    ;;
  test)
    mkdir -p "$LOGS/diffs"
    run_step test_gpu env JAXCOMP_GPU_DIFFS="$LOGS/diffs" timeout "${TEST_S:-150}" \
      "$PY" -m pytest -q -p no:cacheprovider -n "$workers" tests/test_gpu.py \
      --junitxml="$LOGS/test_gpu.xml"
    cat "$LOGS"/diffs/*.jsonl >"$LOGS/test_gpu-diffs.jsonl" 2>/dev/null
    rm -rf "$LOGS/diffs"
    tail -n 30 "$LOGS/test_gpu.log"
    ;;
  fast)
    run_step fast_tier timeout "${FAST_S:-240}" \
      "$PY" -m pytest -q -p no:cacheprovider -n "$workers" -m "not slow and not multiprocess" \
      --ignore=tests/test_gpu.py --junitxml="$LOGS/fast_tier.xml"
    tail -n 30 "$LOGS/fast_tier.log"
    ;;
  arith)
    run_step xla_arith timeout 120 "$PY" benchmarks/xla_arith.py --platform gpu \
      --json "$LOGS/xla_arith.json"
    cat "$LOGS/xla_arith.log"
    ;;
  bench)
    run_step codecs timeout "${BENCH_S:-150}" "$PY" benchmarks/codecs.py --platform gpu \
      --log2-sizes ${SIZES:-26} --reps "${REPS:-3}" --json "$LOGS/codecs-gpu.json" --no-docs
    tail -n 50 "$LOGS/codecs.log"
    # Error feedback's compression: the CUDA one-pass kernels against the
    # separate kernels and the twins fused by XLA (Int8, QSGD, OneBit, SignSGD, Natural, FP8, MX, TernGrad).
    run_step feedback timeout "${FEEDBACK_S:-120}" "$PY" benchmarks/feedback.py --platform gpu --log2-n 26 \
      --reps 5 --skip-kernel-calls
    cat "$LOGS/feedback.log"
    ;;
  step)
    # shellcheck disable=SC2086 # the paths are words
    run_step train_step timeout "${STEP_S:-150}" "$PY" benchmarks/train_step.py --platform gpu \
      --paths ${STEP_PATHS:-rule one-pass calls twins} --json "$LOGS/train_step.json"
    cat "$LOGS/train_step.log"
    # A codec without, with one and with two levels of error feedback, and
    # the kernels of each compiled step (docs/gpu.md).
    if [ -n "${ABLATE-qsgd:bits=4}" ]; then
      run_step ablate timeout 60 "$PY" benchmarks/train_step.py --platform gpu \
        --ablate "${ABLATE-qsgd:bits=4}" --json "$LOGS/train_step-ablate.json" --hlo "$LOGS/step-ablate.hlo"
      cat "$LOGS/ablate.log"
    fi
    ;;
  *)
    echo "unknown step: $step" >&2
    exit 2
    ;;
  esac
done
echo "all: $((SECONDS - t_all)) s; failed: ${failed[*]:-none}" | tee -a "$LOGS/steps.txt"
[ ${#failed[@]} -eq 0 ]
