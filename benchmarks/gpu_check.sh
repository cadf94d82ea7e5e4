#!/usr/bin/env bash
# One-command GPU check (<= 8 minutes): environment, parity of each GPU backend with the golden
# file, latency percentiles side by side with HF transformers eager. Writes OUT/gpu_check.{json,md}.
#
#   bash benchmarks/gpu_check.sh [OUT]            # ENGINE=engines/smollm2 DEVICE=cuda by default
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
extra=()
[ "${SKIP_HF:-0}" = 1 ] && extra+=(--skip-hf)
exec timeout 480 "$PY" benchmarks/gpu_check.py --engine "$ENGINE" --out "$OUT" --device "$DEVICE" \
  --budget-s "${BUDGET_S:-400}" --iters "${ITERS:-50}" "${extra[@]}"
