#!/usr/bin/env bash
# The GPU check: what main does on one H100/H200, in about 5 minutes once the machine is up, so that a
# 15-minute reservation (node start included) holds it with room for a rerun.
#
#   TORCH=cuda make setup && scripts/gpu_check.sh          # a machine with package access
#   scripts/gpu_check.sh                                   # an image without it (see below)
#
# Parts, each under its own deadline (seconds; override with the variable named), each reporting as it
# goes, a failure or timeout in one never stopping the next:
#   1. exclusive GPU tests (GPU_EXCLUSIVE_TIMEOUT=45, 200 with GPU_CHECK_SLOW=1), alone on the GPU:
#      torchao's modules counted, a training step with no host sync (22 s on an H200);
#   2. recipe GPU tests (GPU_TESTS_TIMEOUT=110, 330 with GPU_CHECK_SLOW=1), 4 at a time:
#      recipes/pretrain.py for 20 steps per precision, compile on and off, FP8 losses against bf16,
#      compiled against eager, a checkpoint resumed, the grouped expert GEMM (backward included); each
#      recipe run has its own deadline (GPU_RUN_TIMEOUT=110); V3's FP8 runs are opt-in (torchao's
#      Triton autotune: 109 s for 20 eager steps on an H200);
#   3. benchmarks/gpu_train_step.py (GPU_BENCH_TIMEOUT=120): dense ~1B and V3-style MoE ~0.8B, 4 x 2048
#      tokens, bf16 eager / compile and FP8 + compile; each headline figure printed when measured, and
#      the MFU floors a fallback to a slow path would break (--floors: the part fails on one);
#   4. with GPU_CHECK_SLOW=1, what takes over a minute: V3's FP8 runs and blockwise FP8 (Triton
#      autotune) in the tests and the benchmark, the transformers rows (GPU_SLOW_TIMEOUT=240);
#   5. with REPRODUCE=1, `make reproduce` on the GPU: reproduce=gpu_short, ~10.5 min estimated (its first
#      three stages measured on an H200), outputs in outputs/reproduce/gpu_short/, finished stages kept for
#      a rerun (GPU_REPRODUCE_TIMEOUT=720).
# Then one summary table (device, versions, each test pass/fail/timeout with its first error line, each
# benchmark figure): $OUT/summary.md, also printed. Everything goes under $GPU_CHECK_OUT, else the
# caller's $OUT, else gpu_check/; recipe run dirs under $GPU_CHECK_RUNS (default $OUT/runs).
#
# Without package access (an image with CUDA torch, lightning, transformers, triton but no hydra,
# omegaconf or torchao): bring the wheels of ../shared/gpu/prepare.sh in .gpu-wheels/ (3.8 MB) and the
# bundled corpus's data build .cache/bundled_corpus_v8192 (5.6 MB; README "The GPU check" says how to
# make it); this script installs the wheels into /tmp/site and runs from the source tree.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${GPU_CHECK_OUT:-${OUT:-gpu_check}}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
RUNS=${GPU_CHECK_RUNS:-$OUT/runs}
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
fail() { echo "scripts/gpu_check.sh: $*" >&2; exit 2; }

# The reasons not to start, each one line, before anything slow.
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)" 2>/dev/null
case $? in
  0) ;;
  3) fail "needs a CUDA GPU (torch.cuda.is_available() is False with $PY): run it on the GPU machine" ;;
  *) fail "$PY cannot import torch: set PY=<a python with CUDA torch>" ;;
esac
if ! "$PY" -c "import hydra, omegaconf, torchao" 2>/dev/null && [ -d .gpu-wheels ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu-wheels/*.whl \
    || fail "installing .gpu-wheels/*.whl into /tmp/site failed (make them again with ../shared/gpu/prepare.sh)"
  export PYTHONPATH="/tmp/site:$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$PY" -c "import hydra, omegaconf, torchao" 2>/dev/null; then
  for module in hydra omegaconf torchao; do
    error=$("$PY" -c "import $module" 2>&1) \
      || fail "cannot import $module (${error##*$'\n'}): bring the wheels of ../shared/gpu/prepare.sh in .gpu-wheels/"
  done
fi
mkdir -p "$RUNS"  # pytest's --basetemp needs its parent
export WANDB_MODE=offline WANDB_SILENT=true TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
if ! "$PY" -c "import datasets" 2>/dev/null; then
  # no data pipeline here (datasets missing): the tests read the bundled data's build brought along
  export DSL_LIT_CACHE_ROOT=${DSL_LIT_CACHE_ROOT:-$PWD/.cache}
  ls "$DSL_LIT_CACHE_ROOT"/bundled_corpus_v8192/shards/meta.json >/dev/null 2>&1 \
    || fail "'datasets' is not installed and $DSL_LIT_CACHE_ROOT/bundled_corpus_v8192 holds no build: run" \
            "'python recipes/pretrain.py trainer.max_steps=1 logger=csv' on a machine with it and bring .cache/bundled_corpus_v8192 along"
fi

"$PY" - <<'PYEOF' | tee "$OUT/device.txt"
import torch
print(f"device: {torch.cuda.get_device_name()} (sm{''.join(map(str, torch.cuda.get_device_capability()))}), "
      f"torch {torch.__version__}, CUDA {torch.version.cuda}")
for name in ("torchao", "lightning", "transformers", "triton", "hydra", "flash_attn"):
    try:
        print(f"{name} {__import__(name).__version__}")
    except Exception as error:
        print(f"{name}: not available ({type(error).__name__})")
PYEOF

# each part's pytest appends the tests it selected (collected.txt) and each outcome as it ends (tests.tsv)
export DSL_LIT_TEST_RESULTS="$OUT/tests.tsv" DSL_LIT_TEST_COLLECTED="$OUT/collected.txt" GPU_CHECK_RUNS="$RUNS" \
  GPU_RUN_TIMEOUT=${GPU_RUN_TIMEOUT:-110}
: > "$OUT/tests.tsv"
: > "$OUT/collected.txt"
: > "$OUT/parts.tsv"
SLOW=${GPU_CHECK_SLOW:-0}
long_tests=$([ "$SLOW" = 1 ] && echo "" || echo " and not gpu_long")

# part NAME SECONDS LOG COMMAND...: run under its deadline, log as it goes, record how it ended
part() {
  local name=$1 seconds=$2 log=$3 start status
  shift 3
  start=$(date +%s)
  echo "== $name (deadline ${seconds} s)" | tee -a "$OUT/$log"
  timeout --kill-after=15 "$seconds" "$@" 2>&1 | tee -a "$OUT/$log"
  status=${PIPESTATUS[0]}
  case $status in 0) result=passed ;; 124|137) result=timeout ;; *) result="failed (exit $status)" ;; esac
  printf '%s\t%s\t%s\n' "$name" "$result" "$(( $(date +%s) - start ))" >> "$OUT/parts.tsv"
  echo "== $name: $result in $(( $(date +%s) - start )) s" | tee -a "$OUT/$log"
}
PYTEST=("$PY" -m pytest -v -rfE -p no:cacheprovider tests/e2e/gpu/test_gpu.py)

part "exclusive GPU tests" "${GPU_EXCLUSIVE_TIMEOUT:-$([ "$SLOW" = 1 ] && echo 200 || echo 45)}" gpu_tests.log \
  "${PYTEST[@]}" -m "gpu and exclusive$long_tests" --basetemp="$RUNS/exclusive"
part "recipe GPU tests" "${GPU_TESTS_TIMEOUT:-$([ "$SLOW" = 1 ] && echo 330 || echo 110)}" gpu_tests.log \
  "${PYTEST[@]}" -m "gpu and not exclusive$long_tests" -n "${GPU_TEST_WORKERS:-4}" --basetemp="$RUNS/tests"
part "train-step benchmark" "${GPU_BENCH_TIMEOUT:-120}" gpu_train_step.log \
  "$PY" -m benchmarks.gpu_train_step --repeats 6 \
  --variants "ours bf16 compile,ours fp8_tensorwise compile,ours bf16" \
  --moe-variants "ours bf16 compile,ours bf16" --floors
if [ "$SLOW" = 1 ]; then
  part "train-step benchmark, slow rows" "${GPU_SLOW_TIMEOUT:-240}" gpu_train_step.log \
    "$PY" -m benchmarks.gpu_train_step --repeats 6 \
    --variants "ours fp8_rowwise compile,ours fp8_blockwise,transformers bf16" \
    --moe-variants "ours fp8_rowwise compile,transformers bf16"
fi
if [ "${REPRODUCE:-0}" = 1 ]; then
  part "make reproduce (gpu_short)" "${GPU_REPRODUCE_TIMEOUT:-720}" reproduce.log \
    "$PY" recipes/reproduce.py reproduce=gpu_short
fi

"$PY" scripts/gpu_check_summary.py "$OUT" | tee "$OUT/summary.md"
grep -qv $'\tpassed\t' "$OUT/parts.tsv" && exit 1
exit 0
