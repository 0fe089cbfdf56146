#!/usr/bin/env bash
# One prepared run on a GPU machine (the device tool's H200): build with CUDA, run the GPU tests,
# run the GPU benchmarks, and leave JSON under $OUT. The machine reaches no registry, so the
# install uses the image's pybind11 / scikit-build-core / cmake / ninja without isolation.
# Each capability is its own section; a failing section is recorded and the next one still runs.
#
#   OUT=/tmp/out scripts/gpu_check.sh            # on the GPU machine, from the repo root
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT="${OUT:-$(pwd)/out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
status="$OUT/sections.txt"
: >"$status"

section() {  # section NAME COMMAND...: run, log to $OUT/NAME.log, record rc
  local name=$1
  shift
  echo "== $name =="
  local t0=$SECONDS
  "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc seconds=$((SECONDS - t0))" | tee -a "$status"
  tail -n 25 "$OUT/$name.log"
}

# --- build: AWEX_FAST_CUDA=ON must find nvcc and compile the kernels for sm_90 ----------------
section build env AWEX_FAST_CUDA=ON AWEX_FAST_CUDA_ARCHS="${AWEX_FAST_CUDA_ARCHS:-90}" \
  "$PY" -m pip install --no-build-isolation --no-deps -v .
# Python runs from $OUT from here on: a checkout on sys.path (cwd) would shadow the installed
# package with a source tree that has no compiled extension.
repo=$(pwd)
section build_info bash -c "cd '$OUT' && '$PY' -c \"import awex_fast, json, torch; i = awex_fast.build_info(); \
print(json.dumps(i)); assert i['cuda'], 'CUDA part not built'; print(torch.__version__, torch.cuda.get_device_name())\""

# --- tests marked gpu (run outside the checkout so the installed build is imported) -----------
# Only the GPU test files are collected: the image lacks some CPU-test dependencies (tensordict).
section pytest_gpu bash -c "cd '$OUT' && '$PY' -m pytest -m gpu -q -p no:cacheprovider --rootdir '$repo' \
  '$repo'/tests/*/test_gpu_*.py --junitxml='$OUT/pytest_gpu.xml'"

# --- the CUDA kernels' self-checks (copy, cast, checksum, block-FP8 amax / quantize) on this GPU,
# and the block-FP8 kernels against torch on the GPU and vLLM's quantizer, on their own so a
# failure shows as its own section (pytest_gpu above runs the file too) ---------------------
section gpu_selfcheck bash -c "cd '$OUT' && '$PY' -c \"import torch; from awex_fast.transfer import boxcopy, cuda_selfcheck as c, fp8; \
[c.check(k, torch.device('cuda', 0)) or print(k, 'ok') for k in c.KERNELS]\""
section pytest_gpu_fp8 bash -c "cd '$OUT' && '$PY' -m pytest -m gpu -q -p no:cacheprovider --rootdir '$repo' \
  '$repo'/tests/transfer/test_gpu_fp8.py --junitxml='$OUT/pytest_gpu_fp8.xml'"
section bench_fp8 bash -c "cd '$OUT' && '$PY' '$repo'/benchmarks/bench_fp8_quantize.py"

# --- native batched copy against torch device-to-device copy ----------------------------------
section bench_copy bash -c "cd '$OUT' && '$PY' '$repo'/benchmarks/bench_copy.py --device cuda --samples 20 \
  --json '$OUT/bench_copy.json'"

# --- the README main job on this machine's cores (CPU ranks; one GPU cannot host two NCCL ranks),
# gloo and the shared-memory ipc transport, every method the image can run, JSON per backend -----
for backend in gloo ipc; do
  section "bench_sync_$backend" bash -c "cd '$OUT' && '$PY' -m awex_fast.cli bench --backend $backend \
    --iters 5 --json '$OUT/bench_sync_$backend.json'"
done

# Later capabilities (executor over native NCCL between GPUs) add their sections here.

cat "$status"
! grep -v " rc=0 " "$status" >/dev/null
