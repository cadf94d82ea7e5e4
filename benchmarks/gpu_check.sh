#!/usr/bin/env bash
# One-command GPU check (<= 7 minutes): environment, parity of each GPU backend, latency percentiles with the
# host's share, kernel time, and the targets with their measured values. Writes OUT/gpu_check.{json,md}.
#
#   bash benchmarks/gpu_check.sh [OUT]            # ENGINE=engines/smollm2 DEVICE=cuda by default
#
# One call on a bare GPU machine (PyTorch, transformers, tokenizers; no weights, <= 64 MiB brought along):
#   here:  python benchmarks/gpu_shape.py pack .gpu/shape        (config + tokenizer, ~3.5 MiB)
#   there: carry .gpu/shape, command: SHAPE=.gpu/shape bash benchmarks/gpu_check.sh "$OUT"
# With SHAPE set and no engine at ENGINE, the engine is made in memory from the default model's shape: seeded random
# weights of its real dimensions drawn on the device, no export (gpu_check.py --shape); the torch variants are
# compared with the reference decoder on the same weights. Latency is the real model's; its answers are not, and
# random weights hide precision error (the report says RANDOM). The real weights need benchmarks/gpu_carry.sh's two
# calls, the second step. Every import on this path is in the H200 image (benchmarks/h200_image.txt):
# tests/test_gpu_check.py rehearses this script on a CPU (DEVICE=cpu) with nothing else importable.
#
# Needs: torch with CUDA, numpy, tokenizers, transformers (a config's reader) and either SHAPE or an engine
# directory (`onepass export --out engines/smollm2`; onnx then too: the torch backend reads the weights from the
# engine's ONNX initializers, and the Hugging Face baseline is built from them, SKIP_HF=1 skips it). OUT holds only
# the reports (the TensorRT engine copy goes to the temp directory).
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
if [ ! -f "$ENGINE/manifest.json" ] && [ -n "${SHAPE:-}" ]; then
  extra+=(--shape "$SHAPE")
elif [ ! -f "$ENGINE/manifest.json" ]; then
  echo "no engine at $ENGINE: export one (onepass export --out $ENGINE) or set SHAPE (see the top of this script)" >&2
  exit 2
fi
[ "${SKIP_HF:-0}" = 1 ] && extra+=(--skip-hf)
[ "${RANDOM_WEIGHTS:-0}" = 1 ] && extra+=(--random-weights)
[ "${ALL_VARIANTS:-0}" = 1 ] && extra+=(--all-variants)  # on a CPU: every variant the GPU run times (a rehearsal)
left=$((${LIMIT_S:-420} - SECONDS))  # the whole script stays within LIMIT_S (7 minutes)
budget=$((left - 60 < ${BUDGET_S:-360} ? left - 60 : ${BUDGET_S:-360}))
exec timeout "$left" "$PY" benchmarks/gpu_check.py --engine "$ENGINE" --out "$OUT" --device "$DEVICE" \
  --budget-s "$budget" --iters "${ITERS:-50}" "${extra[@]}"
