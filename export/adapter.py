"""LoRA adapters (PEFT format): the default adapter shipped with onepass, saving one, merging them into a model.

An adapter is a standard PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``,
float16) targeting the Hugging Face module names of its base model, so peft and transformers
load it as they would any adapter, plus ``onepass_adapter.json``: the base model's sha256 and how
the adapter was trained. Export merges adapters into the weights (``merge_and_unload``): the
exported graph is an ordinary engine and the runtime does not change.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ..runtime.core.errors import ModelSourceError
from ..runtime.core.manifest import sha256_file

ADAPTERS = Path(__file__).parent / "adapters"
# The chat-form adapter, trained by `make train-default` on the decision mixture: the default stack's lower half, and
# alone (`--adapter default-chat`) the chat-form engine
CHAT_ADAPTER = ADAPTERS / "smollm2-135m-instruct"
# Trained on top of CHAT_ADAPTER in the compact prompt form (a third fewer packed tokens, 1.56x faster
# warm) from the labels and the chat engine's answers (`make train-default-compact`): the default engine is both,
# asking in the compact form. Accuracy kept within two standard errors of the chat engine's on 1,950 rows (as served
# -0.2 points, SE 0.9; calibrated +1.0, SE 0.9: benchmarks/studies/results/prompt_forms_taught.md)
COMPACT_ADAPTER = ADAPTERS / "smollm2-135m-instruct-compact"
CARD = "onepass_adapter.json"
WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def resolve(spec: str | None, model_spec) -> list[Path]:
    """The adapters to merge: ``"none"`` none; ``None``/``"default"`` the shipped stack for the default model (the
    chat-form adapter, then the compact one; none for other models); ``"default-chat"`` the chat-form adapter alone
    (the default model only); otherwise the folder given, on top of the adapters its card says it was trained on."""
    if spec == "none":
        return []
    if spec in (None, "default") and model_spec is not None:
        return []
    if spec == "default-chat":
        if model_spec is not None:
            raise ModelSourceError("--adapter default-chat is trained for the default model only; give --adapter none "
                                   "or a folder from `onepass tune` with --model")
        return [CHAT_ADAPTER]
    if spec == "default-compact":
        raise ModelSourceError("--adapter default-compact is no longer a name: the compact form is the "
                               "default ('default'); 'default-chat' gives the chat-form engine")
    path = COMPACT_ADAPTER if spec in (None, "default") else Path(spec).resolve()  # recorded: found from any folder
    if not (path / CONFIG).is_file() or not (path / WEIGHTS).is_file():
        raise ModelSourceError(f"{path} is not a LoRA adapter folder ({CONFIG} + {WEIGHTS}); give one written by "
                               "`onepass tune`, 'default', 'default-chat' or 'none'")
    return [*trained_on(path), path]


def trained_on(adapter: Path) -> list[Path]:
    """The adapters ``adapter`` was trained on top of (its card's ``tuning.adapters``: an engine tuned from the
    default engine carries the shipped adapter), in merge order, each matched by the sha256 of its weights: a shipped
    one where this installation keeps it (the recorded path may be another installation's), any other at its
    recorded path."""
    shipped = sorted(p for p in ADAPTERS.iterdir() if (p / WEIGHTS).is_file())
    below = []
    for recorded in _recorded_below(adapter):
        want = recorded.get("sha256")
        at = [Path(recorded["path"])] if recorded.get("path") else []
        found = [p for p in (*shipped, *at) if (p / WEIGHTS).is_file() and sha256_file(p / WEIGHTS) == want]
        if not found:
            raise ModelSourceError(f"adapter {adapter} was trained on top of the adapter {recorded.get('path')} "
                                   f"(weights sha256 {str(want)[:12]}...), which is not there or has changed; export "
                                   "with that adapter restored, or use the engine `onepass tune` wrote")
        below.append(found[0])
    return below


def _recorded_below(adapter: Path) -> list[dict]:
    """The adapters (path, sha256) its card says ``adapter`` was trained on top of, in merge order."""
    return (card(adapter).get("tuning") or {}).get("adapters") or []


def card(adapter: Path) -> dict:
    """The adapter's onepass card ({} when it has none)."""
    path = Path(adapter) / CARD
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def prompt_of(adapter: Path):
    """The prompt form the adapter was trained in (its card's ``prompt``; the default ``chat`` form for a card that
    records none, as every adapter did before the forms were named)."""
    from ..runtime.core.prompt import PromptTemplate

    recorded = card(adapter).get("prompt")
    try:
        return PromptTemplate(**recorded) if recorded is not None else PromptTemplate()
    except (TypeError, ValueError) as e:
        raise ModelSourceError(f"{Path(adapter) / CARD}: its prompt is not a prompt template ({e})") from e


def check_stack(adapter: Path, below) -> None:
    """Refuse to merge ``adapter`` on top of other adapters (``below``, in merge order) than those it was trained on
    top of (its card's ``tuning.adapters``, by the sha256 of their weights): its weights are a correction of those
    weights, and merged onto others it answers what no run measured."""
    wanted = [a.get("sha256") for a in _recorded_below(adapter)]
    merged = [sha256_file(Path(a) / WEIGHTS) for a in below]
    if wanted != merged:
        under = lambda shas: ", ".join(str(s)[:12] + "..." for s in shas) or "no adapter"  # noqa: E731
        raise ModelSourceError(f"adapter {adapter} was trained on top of {under(wanted)} and would be merged on top "
                               f"of {under(merged)}; merge the adapters it was trained on first (`onepass export "
                               "--adapter` finds them from its card; an engine whose manifest records only "
                               "DIR merged DIR alone: export it again)")


def provenance(adapter: Path) -> dict:
    """What the manifest records of an adapter: where it was, the sha256 of its weights, its card."""
    return {"path": str(adapter), "sha256": sha256_file(Path(adapter) / WEIGHTS), "card": card(adapter)}


def merge(model, adapter: Path, base_sha256: str | None = None):
    """``model`` with the LoRA adapter at ``adapter`` merged into its weights (peft ``merge_and_unload``).

    An adapter trained for another base model (its card names another sha256) is refused.
    """
    from peft import PeftModel

    adapter = Path(adapter)
    if not (adapter / WEIGHTS).is_file():
        raise ModelSourceError(f"adapter {adapter} has no {WEIGHTS}; restore it from the repository or export with "
                               "--adapter none")
    want = card(adapter).get("base_sha256")
    if want and base_sha256 and want != base_sha256:
        raise ModelSourceError(f"adapter {adapter} was trained on a base model with sha256 {want[:16]}..., not "
                               f"{base_sha256[:16]}...; export with --adapter none or tune an adapter for this model")
    return PeftModel.from_pretrained(model, str(adapter), is_trainable=False).merge_and_unload()


def lora_config(rank: int, alpha: float | None, layers: list[int] | None, dropout: float = 0.0):
    """The LoRA configuration onepass trains: attention and MLP projections of the chosen layers."""
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, lora_dropout=dropout,
                      target_modules=list(LORA_TARGETS), layers_to_transform=layers, bias="none")


def save(peft_model, out: Path, info: dict) -> Path:
    """Write the adapter in float16 (PEFT format) plus its card to ``out``, atomically."""
    import torch
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    out = Path(out)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weights = {k: v.detach().to(torch.float16).contiguous() for k, v in get_peft_model_state_dict(peft_model).items()}
    save_file(weights, str(tmp / WEIGHTS), metadata={"format": "pt"})
    peft_model.peft_config["default"].save_pretrained(str(tmp))
    (tmp / CARD).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out
