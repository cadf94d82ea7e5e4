"""Golden file: a real packed request's graph inputs and the PyTorch float32 outputs, versioned.

The runtime's graph is checked against it (runtime/core/selfcheck.py, at export and by ``onepass check``;
tests/test_graph.py): prefill K/V of the
state, then the packed score pass over that state.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..runtime.core.prompt import PromptEncoder
from ..runtime.core.questions import Choice, Noul, Score
from ..runtime.core.selfcheck import GOLDEN_VERSION
from ..runtime.core.tree import pack
from ..runtime.backends.batch import causal

SAMPLE_STATE = ("Hi, I was charged twice for my subscription this month and nobody answers my emails. "
                "Please refund the second payment today.")
SAMPLE_QUESTIONS = (
    Noul("Does the customer request a refund?"),
    Choice("Which team should handle this?", {"billing": "payments, refunds", "technical": None, "fraud": None,
                                               "fraud review": "suspicious payments"}),
    Score("How frustrated is the customer?", ["Calm", "Frustrated", "Very angry"]),
)


def _feed(batch, past) -> tuple:
    t = torch.from_numpy
    return (t(batch.input_ids), t(batch.position_ids), t(batch.tree_mask), *past,
            t(batch.readout_index), t(batch.readout_target))


def write_golden(decoder, encoder: PromptEncoder, path: Path) -> None:
    """Run the sample through the PyTorch decoder and save inputs and outputs to ``path`` (.npz)."""
    dims = decoder.dims
    state_ids = encoder.state(SAMPLE_STATE)
    empty = [torch.zeros(dims.num_kv_heads, 0, dims.head_dim) for _ in range(2 * dims.num_layers)]
    with torch.no_grad():
        prefill = decoder(*_feed(causal(state_ids, 0), empty))
        past = list(prefill[1:1 + 2 * dims.num_layers])
        batch = pack([encoder.question(q) for q in SAMPLE_QUESTIONS], len(state_ids))
        score = decoder(*_feed(batch, past))
    head = {"head_score": score[-1].numpy()} if decoder.head is not None else {}
    np.savez(
        path,
        version=np.array(GOLDEN_VERSION),
        state_ids=np.array(state_ids, dtype=np.int64),
        prefill_key_first=past[0].numpy(), prefill_value_last=past[-1].numpy(),
        input_ids=batch.input_ids, position_ids=batch.position_ids, tree_mask=batch.tree_mask,
        readout_index=batch.readout_index, readout_target=batch.readout_target,
        target_logprob=score[0].numpy(),
        **head,
    )
