"""Counting the kernels a PyTorch pass launches, without a GPU.

``count(fn)`` runs ``fn`` under a ``TorchDispatchMode`` and counts the ATen operations that write device memory
(they launch a kernel): every call but views (a ``reshape`` that can view, a slice, a transpose) and bare
allocations (``empty``), which launch nothing. Run on the ``meta`` device at a model's real
dimensions, it counts what the same code launches on CUDA, where the fused decoder picks the same operations
(``fused_decoder.Kernels``: on ``meta`` as on CUDA). What it cannot see: an ATen operation that launches two kernels
on CUDA counts as one (the pass avoids the ones known to: ``addmm`` into a new tensor copies its input first, so the
residual stream is updated in place with ``addmm_``).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# operations that allocate memory without writing it: no kernel
ALLOCATIONS = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "resize_"}


def _launches(func, args, out) -> bool:
    """Whether a call wrote memory: it mutated an argument, or returned a tensor that is no view of its inputs (a
    ``reshape`` that had to copy counts; one that could view does not), and it is not a bare allocation."""
    if func.overloadpacket.__name__ in ALLOCATIONS:
        return False
    if func._schema.is_mutable:
        return True
    inputs = [a for a in args if isinstance(a, torch.Tensor)]
    outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]
    return any(not any(torch._C._is_alias_of(o, i) for i in inputs) for o in outs)


class LaunchCounter(TorchDispatchMode):
    """Counts kernel-launching ATen operations by name while active."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _launches(func, args, out):
            self.ops[func.overloadpacket.__name__] += 1
        return out

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def count(fn) -> LaunchCounter:
    """The launches of ``fn()`` (run now, under the counter)."""
    with LaunchCounter() as counter:
        fn()
    return counter
