#!/usr/bin/env bash
# DeepPart's checks on a machine with a CUDA GPU, in one run (docs/GPU.md):
# the CUDA tests, then bench/gpu.py; everything it writes goes under OUTDIR.
#
#   bash scripts/gpu-check.sh OUTDIR [all|tests|bench]
#
# It uses the machine's python3 and its torch (the lent H200 has no network):
# the wheels that travel with the tree in .whl/ are installed first (build
# them here with `bash scripts/gpu-check.sh --wheels`): DeepPart's own wheel
# (its Rust extension goes into deeppart/ when the tree has none) and the
# packages that machine lacks (zstandard, lz4, torch_checkpointing).
# GPU_BENCH_ARGS adds arguments to bench/gpu.py; GPU_BENCH_BUDGET_S is its
# time budget (default 330 s). GPU_CHECK_PYTHON: the interpreter (python3).
# GPU_CHECK_CPU=1 rehearses the whole script on a machine without a GPU (the
# CUDA tests skip, the bench runs on the CPU at a tiny size).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

if [ "${1:-}" = "--wheels" ]; then
  # Here, with network: the wheels the GPU machine needs (Python 3.12, x86-64).
  set -e
  mkdir -p .whl
  rm -f .whl/*.whl
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl zstandard==0.25.0 lz4==4.4.5 torch-checkpointing==0.1.1
  VIRTUAL_ENV="$ROOT/.venv" PATH="$ROOT/.venv/bin:$PATH" .venv/bin/maturin build --release -q -o .whl
  ls -l .whl
  exit 0
fi

OUT="${1:?usage: bash scripts/gpu-check.sh OUTDIR [all|tests|bench]   (or --wheels, to build .whl/)}"
WHAT="${2:-all}"
mkdir -p "$OUT"
PY="${GPU_CHECK_PYTHON:-python3}"
CPU="${GPU_CHECK_CPU:-}"
log() { printf '[gpu-check] %s\n' "$*" | tee -a "$OUT/summary.txt" >&2; }

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv 2>&1
  $PY -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
  nproc; free -g; df -h . /dev/shm
} > "$OUT/machine.txt" 2>&1
log "machine: $(head -3 "$OUT/machine.txt" | tail -1)"

# The wheels that travel with the tree.
if ls .whl/*.whl >/dev/null 2>&1; then
  others=$(ls .whl/*.whl | grep -v '/deeppart-' || true)
  if [ -n "$others" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site $others > "$OUT/pip.log" 2>&1 || log "pip install failed (see pip.log)"
  fi
  if ! ls deeppart/_planner*.so >/dev/null 2>&1; then
    wheel=$(ls .whl/deeppart-*.whl 2>/dev/null | head -1)
    [ -n "$wheel" ] && $PY -m zipfile -e "$wheel" /tmp/deeppart-wheel \
      && cp /tmp/deeppart-wheel/deeppart/_planner*.so deeppart/
  fi
fi
export PYTHONPATH="/tmp/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
$PY -c "import deeppart, torch; assert torch.cuda.is_available() or '$CPU'; print('deeppart', deeppart.__file__)" \
  >> "$OUT/machine.txt" 2>&1 || { log "deeppart or CUDA unusable: see machine.txt"; exit 1; }
bench_args=()
[ -z "$CPU" ] || bench_args=(--cpu --gb 0.02 --dim 256 --batch 64 --saves 1 --steps 2)

# DCP's writer process stages through /dev/shm: room for a 10 GB state.
if [ "$(id -u)" = 0 ]; then mount -o remount,size=80G /dev/shm 2>/dev/null || true; fi

status=0
if [ "$WHAT" = all ] || [ "$WHAT" = tests ]; then
  t0=$SECONDS
  timeout "${GPU_TESTS_TIMEOUT_S:-150}" $PY -m pytest -q -p no:cacheprovider -rs tests/state/test_cuda.py tests/state/test_staging.py \
    > "$OUT/tests.log" 2>&1
  rc=$?
  log "CUDA tests: exit $rc in $((SECONDS - t0)) s: $(tail -1 "$OUT/tests.log")"
  [ $rc = 0 ] || status=1
fi
if [ "$WHAT" = all ] || [ "$WHAT" = bench ]; then
  t0=$SECONDS
  budget="${GPU_BENCH_BUDGET_S:-330}"
  # shellcheck disable=SC2086
  timeout $((budget + 40)) $PY bench/gpu.py --budget-s "$budget" --json "$OUT/gpu.json" \
    --out "$OUT/gpu.txt" "${bench_args[@]}" ${GPU_BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
  rc=$?
  log "bench/gpu.py: exit $rc in $((SECONDS - t0)) s"
  [ $rc = 0 ] || status=1
  cat "$OUT/gpu.txt" 2>/dev/null || tail -20 "$OUT/bench.log"
fi
exit $status
