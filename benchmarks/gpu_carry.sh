#!/usr/bin/env bash
# Prepare what a GPU machine without network needs for `benchmarks/gpu_check.sh`, in carries of < 64 MiB.
#
#   bash benchmarks/gpu_carry.sh            # writes .gpu/part1/ and .gpu/part2/ (git-ignored)
#
# The lent H200 image has torch, onnx, onnxruntime, onnxscript, transformers and tokenizers but not
# gguf, and the default model's GGUF (98 MB) is larger than one carry. So:
#   call 1: carry .gpu/part1   command: mkdir -p /tmp/onepass && cp .gpu/part1/* /tmp/onepass/
#   call 2: carry .gpu/part2   command: bash benchmarks/gpu_carry.sh --assemble && \
#           PYTHONPATH=/tmp/site ENGINE=/tmp/onepass/engine bash benchmarks/gpu_check.sh "$OUT"
# (the machine keeps /tmp between calls while it stays warm). --assemble checks the sha256,
# unpacks the gguf wheel into /tmp/site and exports the engine from the GGUF into /tmp/onepass/engine.
# Rehearsed on a CPU with only the image's packages importable (benchmarks/results/gpu/rehearsal.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ "${1:-}" = "--assemble" ]; then
  cp .gpu/part2/* /tmp/onepass/
  cd /tmp/onepass
  cat model.gguf.part-* > model.gguf
  sha256sum -c model.gguf.sha256
  for wheel in ./*.whl; do "$PY" -m zipfile -e "$wheel" /tmp/site; done  # pure-Python wheels: no pip needed
  cd - >/dev/null
  tmp=$(mktemp -d); ln -s "$PWD" "$tmp/onepass"
  PYTHONPATH="$tmp:/tmp/site" "$PY" -m onepass export --model /tmp/onepass/model.gguf --out /tmp/onepass/engine
  exit 0
fi
gguf=$("$PY" -c "from onepass.export.model_source import default_gguf; print(default_gguf())")
rm -rf .gpu && mkdir -p .gpu/part1 .gpu/part2
split -n 2 -d "$gguf" .gpu/model.gguf.part-  # two halves: each carry stays well under 64 MiB with the tree
mv .gpu/model.gguf.part-00 .gpu/part1/
mv .gpu/model.gguf.part-* .gpu/part2/
(cd "$(dirname "$gguf")" && sha256sum "$(basename "$gguf")" | sed 's/ .*$/  model.gguf/') > .gpu/part2/model.gguf.sha256
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  -d .gpu/part2 gguf==0.19.0
du -sh .gpu/part1 .gpu/part2
