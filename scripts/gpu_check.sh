#!/usr/bin/env bash
# The GPU check: on one H100/H200, from a fresh clone, in under 8 minutes.
#
#   TORCH=cuda make setup && scripts/gpu_check.sh          # a machine with package access
#   scripts/gpu_check.sh                                   # an image without it (see below)
#
# 1. the GPU tests (pytest -m gpu: every precision through recipes/pretrain.py, compile on and off,
#    flash-attn where installed, the grouped expert GEMM, a checkpoint resumed on the GPU), 4 at a
#    time on the one GPU;
# 2. benchmarks/gpu_train_step.py: train-step time, tokens/s, MFU, peak memory and first-step time
#    of dense ~1B and V3-style MoE ~0.8B, ours vs transformers, eager vs compile, bf16 vs FP8.
# 3. with REPRODUCE=1, `make reproduce` on the GPU: recipes/reproduce.py reproduce=gpu_small (under an
#    hour; its data and evaluate stages need `datasets` and `lm-eval`, so a machine set up with
#    TORCH=cuda make setup, or those two stages run elsewhere first: the run dir carries them).
# Each part runs under its own timeout; logs go to $GPU_CHECK_OUT (default gpu_check/).
#
# Without package access (an image with CUDA torch, lightning, transformers, triton but no hydra,
# torchao, datasets or wandb): bring the wheels of ../shared/gpu/prepare.sh in .gpu-wheels/, and
# this script installs them into /tmp/site and runs from the source tree.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${GPU_CHECK_OUT:-gpu_check}
mkdir -p "$OUT"
PY=${PY:-.venv/bin/python}
if [ ! -x "$PY" ]; then
  PY=python3
  if [ -d .gpu-wheels ] && ! "$PY" -c "import hydra, torchao" 2>/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu-wheels/*.whl
  fi
  export PYTHONPATH="/tmp/site:$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export WANDB_MODE=offline WANDB_SILENT=true TOKENIZERS_PARALLELISM=false
if ! "$PY" -c "import datasets" 2>/dev/null; then
  # no data pipeline here (datasets missing): the tests read the bundled data's build brought along
  export DSL_LIT_CACHE_ROOT=${DSL_LIT_CACHE_ROOT:-$PWD/.cache}
  if ! ls "$DSL_LIT_CACHE_ROOT"/bundled_corpus_v8192/shards/meta.json >/dev/null 2>&1; then
    echo "scripts/gpu_check.sh: 'datasets' is not installed and $DSL_LIT_CACHE_ROOT/bundled_corpus_v8192 holds no build:" \
         "run 'python recipes/pretrain.py trainer.max_steps=1 logger=csv' on a machine with it and bring .cache/ along" >&2
    exit 2
  fi
fi

"$PY" - <<'PYEOF' | tee "$OUT/device.txt"
import torch
assert torch.cuda.is_available(), "scripts/gpu_check.sh needs a CUDA GPU (torch.cuda.is_available() is False)"
print(f"device: {torch.cuda.get_device_name()} (sm{''.join(map(str, torch.cuda.get_device_capability()))}), "
      f"torch {torch.__version__}, CUDA {torch.version.cuda}")
for name in ("torchao", "lightning", "transformers", "triton", "flash_attn"):
    try:
        print(f"{name} {__import__(name).__version__}")
    except Exception as error:
        print(f"{name}: not available ({type(error).__name__})")
PYEOF
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 2

status=0
start=$(date +%s)
timeout "${GPU_TESTS_TIMEOUT:-200}" "$PY" -m pytest -m gpu -q -n "${GPU_TEST_WORKERS:-4}" --durations=10 tests/test_gpu.py \
  2>&1 | tee "$OUT/gpu_tests.log" || status=1
echo "GPU tests: $(( $(date +%s) - start )) s" | tee -a "$OUT/gpu_tests.log"

start=$(date +%s)
timeout "${GPU_BENCH_TIMEOUT:-260}" "$PY" -m benchmarks.gpu_train_step \
  --variants "ours bf16,ours bf16 compile,ours fp8_tensorwise compile,ours fp8_rowwise compile,ours fp8_blockwise,transformers bf16" \
  --moe-variants "ours bf16,ours bf16 compile,ours fp8_rowwise compile,transformers bf16" \
  2>&1 | tee "$OUT/gpu_train_step.log" || status=1
echo "benchmark: $(( $(date +%s) - start )) s" | tee -a "$OUT/gpu_train_step.log"

if [ "${REPRODUCE:-0}" = 1 ]; then
  start=$(date +%s)
  timeout "${GPU_REPRODUCE_TIMEOUT:-3600}" "$PY" recipes/reproduce.py reproduce=gpu_small \
    2>&1 | tee "$OUT/reproduce.log" || status=1
  echo "reproduce: $(( $(date +%s) - start )) s" | tee -a "$OUT/reproduce.log"
fi
exit $status
