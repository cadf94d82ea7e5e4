"""An independent PyTorch reference: each question asked alone, unpacked, with a plain HF forward."""

from __future__ import annotations

import numpy as np
import torch


def option_logprobs_alone(hf_model, state_ids, question) -> np.ndarray:
    """[K] float64: for each option, one plain causal forward over state + trunk + option (no cache, no mask)."""
    out = []
    for option in question.options:
        seq = list(state_ids) + list(question.trunk) + list(option)
        with torch.no_grad():
            logits = hf_model(torch.tensor([seq])).logits[0].double()  # [T, V]
        logprobs = torch.log_softmax(logits, dim=-1)
        start = len(seq) - len(option)
        out.append(sum(float(logprobs[start - 1 + k, t]) for k, t in enumerate(option)))
    return np.array(out)
