"""The file a trained decision head is saved in (`benchmarks/decision_head.py`, `onepass export --head FILE`).

One torch file: the head's state dict (its MLP under ``head.``, the weight of the zero-shot read-out as ``beta``),
its training config, the hidden size and its provenance. Written by the calibration side, read here by the exporter,
which needs only the graph's part of it (:class:`onepass.runtime.backends.torch_decoder.DecisionHead` and ``beta``).
"""

from __future__ import annotations

import pickle

import torch

from ..runtime.backends.torch_decoder import DecisionHead
from ..runtime.core.errors import OnepassError
from ..runtime.core.manifest import HeadInfo


def save(state_dict: dict, config: dict, hidden_size: int, path, info: dict) -> None:
    """A trained head (its ``HeadModel`` state dict, config as a dict, provenance) as one torch file."""
    torch.save({"state_dict": state_dict, "config": config, "hidden_size": hidden_size, "info": info}, path)


def read(path) -> dict:
    """The saved blob: state_dict, config, hidden_size, info."""
    return torch.load(path, weights_only=True)


def load_head_info(path) -> tuple[DecisionHead, HeadInfo]:
    """(the head as the graph holds it, its manifest HeadInfo) of a saved head; a missing or broken file is an
    OnepassError."""
    try:
        blob = read(path)
        hidden, width = int(blob["hidden_size"]), int(blob["config"]["width"])
        state = blob["state_dict"]
        head = DecisionHead(hidden, width)
        head.load_state_dict({k[len("head."):]: v for k, v in state.items() if k.startswith("head.")})
        beta = float(state["beta"])
    except (OSError, KeyError, RuntimeError, TypeError, ValueError, EOFError, pickle.UnpicklingError) as err:
        raise OnepassError(f"{path} is not a decision head saved by onepass: {err}") from None
    return head.eval(), HeadInfo(beta=beta, width=width, training=blob["info"])
