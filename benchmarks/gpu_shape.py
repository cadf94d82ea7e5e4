"""The default model's *shape* for a one-call GPU check: its config and tokenizer (~3 MB), weights made there.

The GPU machine lent for checks has PyTorch, transformers and onnx but no model weights, and one call
brings at most 64 MiB of files; the default model is 98 MB as a GGUF and 540 MB as float32. Parity
(a backend against the CPU golden file of the same weights) and latency (the same shapes, the same
kernels) do not depend on the weights' values, so one call can check them on the architecture with
seeded random weights:

    python benchmarks/gpu_shape.py pack .gpu/shape     # here: config + tokenizer of the default model
    python benchmarks/gpu_shape.py build .gpu/shape    # there: + seeded random float32 weights
    onepass export --model .gpu/shape --out ENGINE --adapter none

Or, with no export at all (what ``benchmarks/gpu_check.sh`` does when ``SHAPE`` names such a folder and
``ENGINE`` does not exist): ``shape_engine`` makes the engine in memory — its manifest from the config, the
tokenizer from the folder, seeded random weights drawn on the device itself — and the PyTorch backend runs them
(``TorchBackend(weights=...)``); parity is then the fused pass against the reference decoder on the same weights.
Answers of such an engine are meaningless; its parity and latency figures are the real ones.
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


def random_weights(dims, seed: int, device: str) -> dict:
    """Seeded random weights of a decoder of ``dims`` (``DecoderDims``) drawn on ``device``, by the reference
    decoder's state-dict names: linear maps N(0, 0.02), norms 1 + N(0, 0.02) (all distinct, as trained ones are);
    the vocabulary head tied to the embedding."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    h, f, d = dims.hidden_size, dims.intermediate_size, dims.head_dim
    q, kv = dims.num_heads * d, dims.num_kv_heads * d

    def draw(*shape, base=0.0):
        return base + 0.02 * torch.randn(*shape, generator=g, device=device, dtype=torch.float32)
    state = {"embed": draw(dims.vocab_size, h), "norm.weight": draw(h, base=1.0)}
    for i in range(dims.num_layers):
        for name, shape in (("q", (q, h)), ("k", (kv, h)), ("v", (kv, h)), ("o", (h, q)), ("gate", (f, h)),
                            ("up", (f, h)), ("down", (h, f))):
            state[f"blocks.{i}.{name}.weight"] = draw(*shape)
            if dims.qkv_bias and name in ("q", "k", "v"):
                state[f"blocks.{i}.{name}.bias"] = draw(shape[0])
        state[f"blocks.{i}.input_norm.weight"] = draw(h, base=1.0)
        state[f"blocks.{i}.post_norm.weight"] = draw(h, base=1.0)
        if dims.qk_norm:
            state[f"blocks.{i}.q_norm.weight"] = draw(d, base=1.0)
            state[f"blocks.{i}.k_norm.weight"] = draw(d, base=1.0)
    return state


def shape_engine(folder: Path, device: str, seed: int = 0) -> tuple:
    """(root, manifest, weights) of an engine of the model in ``folder`` (config and tokenizer, ``pack``'s) made in
    memory: no graph, no golden file; the manifest as the default engine's (the compact prompt form, summed
    log-likelihoods, the limits of the model's positions) and the weights ``random_weights`` on ``device``. Open it
    with ``Engine(root, manifest, TorchBackend(root, manifest, weights=weights, ...))``."""
    import dataclasses

    from transformers import AutoConfig

    from onepass.runtime.backends.torch_decoder import DecoderDims
    from onepass.runtime.core.manifest import Limits, Manifest, Scoring, sha256_file
    from onepass.runtime.core.prompt import FORMS

    dims = DecoderDims.from_hf_config(AutoConfig.from_pretrained(folder, local_files_only=True))
    files = {"tokenizer.json": sha256_file(folder / "tokenizer.json"), "none.onnx": "", "none.npz": ""}
    manifest = Manifest(name=f"{folder.name} (random weights)", model=dims.model_info(), tokenizer="tokenizer.json",
                        graph="none.onnx", golden="none.npz", files=files, limits=Limits.for_model(dims.max_position),
                        prompt=FORMS["compact"], scoring=Scoring("sum"),
                        source={"dims": dataclasses.asdict(dims), "random_weights": {"seed": seed}})
    return folder, manifest, random_weights(dims, seed, device)


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
