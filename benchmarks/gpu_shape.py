"""The default model's *shape* for a one-call GPU check: its config and tokenizer (~3 MB), weights made there.

The GPU machine lent for checks has PyTorch, transformers and onnx but no model weights, and one call
brings at most 64 MiB of files; the default model is 98 MB as a GGUF and 540 MB as float32. Parity
(a backend against the CPU golden file of the same weights) and latency (the same shapes, the same
kernels) do not depend on the weights' values, so one call can check them on the architecture with
seeded random weights:

    python benchmarks/gpu_shape.py pack .gpu/shape     # here: config + tokenizer of the default model
    python benchmarks/gpu_shape.py build .gpu/shape    # there: + seeded random float32 weights
    onepass export --model .gpu/shape --out ENGINE --adapter none

``benchmarks/gpu_check.sh`` does the last two when ``SHAPE`` names such a folder and ``ENGINE`` does not
exist. Answers of such an engine are meaningless; its parity and latency figures are the real ones.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")


def pack(out: Path) -> list[str]:
    """Copy the default model's config and tokenizer files (no weights) into ``out``."""
    from onepass.export.model_source import load_model

    loaded = load_model(None)  # converts the GGUF once (cached) and gives the HF folder's files
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    loaded.model.config.save_pretrained(tmp)
    loaded.tokenizer.save_pretrained(tmp)
    for path in tmp.iterdir():
        if path.suffix in WEIGHT_SUFFIXES:
            path.unlink()
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return sorted(p.name for p in out.iterdir())


def build(folder: Path, seed: int = 0) -> Path:
    """Seeded random float32 weights for the config in ``folder``, saved beside it (transformers' own init)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms start as ones: equal tensors would be merged into one ONNX initializer, and
        for name, p in model.named_parameters():  # a trained model's norms all differ; so perturb them
            if name.endswith("norm.weight"):
                p.add_(0.02 * torch.randn_like(p))
    model.save_pretrained(folder)
    return folder


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=["pack", "build"])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.action == "pack":
        files = pack(args.folder)
        size = sum(p.stat().st_size for p in args.folder.iterdir())
        print(f"{args.folder}: {', '.join(files)} ({size / 2**20:.1f} MiB)")
    else:
        build(args.folder, args.seed)
        print(f"{args.folder}: random weights (seed {args.seed}) written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
