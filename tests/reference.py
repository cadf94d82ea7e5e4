"""An independent PyTorch reference: each question asked alone, unpacked, with a plain HF forward."""

from __future__ import annotations

import numpy as np
import torch


def option_logprobs_alone(hf_model, state_ids, question) -> np.ndarray:
    """[K] float64: for each option, one plain causal forward over state + trunk + option (no cache, no mask)."""
    out = []
    for option in question.options:
        seq = list(state_ids) + list(question.trunk) + list(option)
        with torch.no_grad():  # logits of the positions that predict the option's tokens only (the last L+1 but one)
            logits = hf_model(torch.tensor([seq]), logits_to_keep=len(option) + 1).logits[0, :-1].double()  # [L, V]
        logprobs = torch.log_softmax(logits, dim=-1)
        out.append(sum(float(logprobs[k, t]) for k, t in enumerate(option)))
    return np.array(out)
