#!/usr/bin/env bash
# One-command GPU check (<= 8 minutes): environment, parity of each GPU backend with the golden
# file, latency percentiles side by side with HF transformers eager. Writes OUT/gpu_check.{json,md}.
#
#   bash benchmarks/gpu_check.sh [OUT]            # ENGINE=engines/smollm2 DEVICE=cuda by default
#
# One call on a bare GPU machine (PyTorch, transformers, onnx; no weights, <= 64 MiB brought along):
#   here:  python benchmarks/gpu_shape.py pack .gpu/shape        (config + tokenizer, ~3.5 MiB)
#   there: carry .gpu/shape, command: SHAPE=.gpu/shape bash benchmarks/gpu_check.sh "$OUT"
# With SHAPE set and no engine at ENGINE, the engine is exported from the default model's shape with
# seeded random weights (benchmarks/gpu_shape.py): latency is the real model's; its answers are not, and random
# weights hide precision error (the report says RANDOM). The real weights need benchmarks/gpu_carry.sh's two calls.
# Every import on this path is in the H200 image (benchmarks/h200_image.txt): tests/test_gpu_check.py rehearses
# this script on a CPU (DEVICE=cpu) with nothing else importable.
#
# Needs: torch with CUDA, numpy, tokenizers, onnx (the torch backend reads the weights from the
# engine's ONNX initializers) and an engine directory (`onepass export --out engines/smollm2`);
# transformers for the HF baseline, built from the engine's own weights (SKIP_HF=1 skips it). OUT holds
# only the reports (the TensorRT engine copy goes to the temp directory).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-gpu_check_out}}"
ENGINE="${ENGINE:-engines/smollm2}"
DEVICE="${DEVICE:-cuda}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
if ! "$PY" -c "import onepass" 2>/dev/null; then
  export PYTHONPATH="$(mktemp -d):${PYTHONPATH:-}"  # the checkout as package onepass, no install needed
  ln -s "$PWD" "${PYTHONPATH%%:*}/onepass"
fi
command -v nvidia-smi >/dev/null && nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
if [ ! -f "$ENGINE/manifest.json" ] && [ -n "${SHAPE:-}" ]; then
  work=$(mktemp -d)
  cp -r "$SHAPE" "$work/smollm2-shape"
  timeout 120 "$PY" benchmarks/gpu_shape.py build "$work/smollm2-shape"
  timeout 180 "$PY" -m onepass export --model "$work/smollm2-shape" --out "$work/engine" --adapter none \
    > "$OUT/export.log" 2>&1 || { tail -5 "$OUT/export.log"; exit 1; }
  ENGINE="$work/engine"
  RANDOM_WEIGHTS=1
elif [ ! -f "$ENGINE/manifest.json" ]; then
  echo "no engine at $ENGINE: export one (onepass export --out $ENGINE) or set SHAPE (see the top of this script)" >&2
  exit 2
fi
extra=()
[ "${SKIP_HF:-0}" = 1 ] && extra+=(--skip-hf)
[ "${RANDOM_WEIGHTS:-0}" = 1 ] && extra+=(--random-weights)
left=$((${LIMIT_S:-480} - SECONDS))  # the whole script, export included, stays within LIMIT_S (8 minutes)
budget=$((left - 80 < ${BUDGET_S:-400} ? left - 80 : ${BUDGET_S:-400}))
exec timeout "$left" "$PY" benchmarks/gpu_check.py --engine "$ENGINE" --out "$OUT" --device "$DEVICE" \
  --budget-s "$budget" --iters "${ITERS:-50}" "${extra[@]}"
