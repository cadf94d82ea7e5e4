"""The GPU decision pass: the decoder as a dozen fused half-precision kernels per block, over one device workspace.

On a GPU a 13-question pass of a 135M model is ~120 GFLOP, ~0.3 ms of H200 tensor-core time: the pass is bound by
kernel launches and memory traffic, not arithmetic. So this pass is built for few launches, and the same code runs on
CPU torch (the tests' stand-in) and on the ``meta`` device (the launch count, ``launches.py``):

* one dtype end to end (fp16, bf16 or fp32): weights, residual stream, K/V; no casts inside a block;
* q, k, v and their rotate-half images come out of **one GEMM** (the rotation, a signed permutation of each head's
  rows, is folded into extra weight rows), so rotary embedding is two elementwise kernels that write q, k and v
  straight into the workspace (value heads take cos 1, sin 0: unchanged);
* attention is **one kernel** over the state rows and the packed rows of the workspace, the tree mask a broadcast
  bias built once per pass on the device from 2N numbers (``batch.intervals``); grouped K/V heads are a stride-0
  batch axis, never repeated;
* gate and up are one GEMM; the o and down projections add into the residual stream in place (``addmm_``);
* RMSNorm is one fused kernel; the vocabulary read-out is one GEMM over the read-out rows only, with fp32 output and a
  log-softmax of one kernel.

Per block: rms_norm, qkv GEMM, 2 rotary, attention, 1 layout copy, o GEMM, rms_norm, gate/up GEMM, silu, mul,
down GEMM = 12 launches for Llama and Qwen2 (Qwen3's per-head q/k norms add 3); the reference decoder of
``torch_decoder.py`` launches ~58 with fp16 GEMMs.

The workspace ``ws`` [L, Z, rows, D] (Z = H + 2 Hkv head rows per layer: query heads, key heads, value heads) is the
device slot of the pass: rows [0, S) of the key and value heads hold the state's K/V, rows [Sb, Sb + N) of every head
the packed tokens' q, k and v (Sb >= S: the state bucket; rows S..Sb-1 are masked). A prefill chunk is the same pass
with Sb = its past: its K/V land in the rows the state keeps.
"""

from __future__ import annotations

import logging

import torch
from torch.nn import functional as F

from .torch_decoder import PackedDecoder

log = logging.getLogger("onepass.fused")

NEG = float("-inf")


class Kernels:
    """The fused operations the pass is made of, chosen once per (device, dtype).

    On CUDA (and on ``meta``, where the launches are counted): ``aten._fused_rms_norm``, the memory-efficient
    attention kernel called directly (one launch; ``scaled_dot_product_attention`` would first pad or copy a bias it
    finds misaligned) and a half GEMM with fp32 output for the read-out. Each is tried on small tensors first and
    replaced by the portable call (logged) where this torch lacks it or it disagrees with the reference. On CPU:
    ``aten._fused_rms_norm`` where torch has it, ``F.scaled_dot_product_attention``, and an fp32 GEMM over the
    half-precision weights (what a half GEMM with fp32 output computes, up to accumulation order).
    """

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        fused = device.type in ("cuda", "meta")
        self.fused_norm = self.efficient = self.out_fp32 = False  # the portable calls until a probe passes
        self.fused_norm = hasattr(torch.ops.aten, "_fused_rms_norm") and self._works(self._probe_norm)
        self.efficient = fused and self._works(self._probe_attention)
        self.out_fp32 = fused and dtype != torch.float32 and self._works(self._probe_readout)

    def describe(self) -> dict:
        """What was chosen (for reports)."""
        if self.out_fp32 or self.dtype == torch.float32:
            readout = "half GEMM, fp32 output" if self.out_fp32 else "fp32 GEMM"
        else:
            readout = "fp32 GEMM of the half weights" if self.device.type == "cpu" else "half GEMM, half output"
        return {"rms_norm": "fused" if self.fused_norm else "F.rms_norm",
                "attention": "efficient" if self.efficient else "F.scaled_dot_product_attention", "readout": readout}

    def _works(self, probe) -> bool:
        try:
            return bool(probe())
        except (RuntimeError, NotImplementedError, TypeError, AttributeError) as err:
            log.warning("%s on %s/%s unavailable (%s): the portable call is used", probe.__name__, self.device,
                        self.dtype, str(err).splitlines()[0][:200])
            return False

    def _close(self, got, want, atol: float) -> bool:
        if self.device.type == "meta":
            return got.shape == want.shape
        ok = torch.allclose(got.float(), want.float(), rtol=0, atol=atol)
        if not ok:
            log.warning("a fused kernel disagrees with its reference on %s: the portable call is used", self.device)
        return ok

    def _probe_norm(self) -> bool:
        x = torch.randn(5, 64, device=self.device).to(self.dtype)
        w = torch.rand(64, device=self.device).to(self.dtype)
        got = torch.ops.aten._fused_rms_norm(x, [64], w, 1e-5)[0]
        return self._close(got, F.rms_norm(x.float(), [64], w.float(), 1e-5), 0.05)

    def _probe_attention(self) -> bool:
        """The direct kernel on the pass's own layouts: q a strided view of a workspace, K/V a stride-0 batch of
        its rows, the bias a sliced, broadcast buffer; against softmax(q k^T / sqrt(D) + bias) v written out in
        fp32."""
        g, h, n, s, d = 3, 2, 24, 40, 64
        ws = torch.randn(g * h + 2 * h, s, d, device=self.device).to(self.dtype)  # one layer's workspace
        q = ws[:g * h, s - n:].unflatten(0, (h, g)).transpose(0, 1)  # [G, H, N, D], as _block views it
        k, v = (ws[g * h + i * h:g * h + (i + 1) * h].expand(g, -1, -1, -1) for i in (0, 1))  # [G, H, S, D]
        keep = torch.rand(n, s, device=self.device) < 0.7
        keep[:, 0] = True
        bias = torch.empty(n, 48, device=self.device, dtype=self.dtype)[:, :s]
        torch.where(keep, torch.zeros((), device=self.device, dtype=self.dtype),
                    torch.full((), NEG, device=self.device, dtype=self.dtype), out=bias)
        got = self.attend(q, k, v, bias.expand(g, h, n, s), force=True)
        scores = q.float() @ k.float().transpose(-1, -2) * d ** -0.5 + bias.float()
        return self._close(got, torch.softmax(scores, dim=-1) @ v.float(), 0.02)

    def _probe_readout(self) -> bool:
        h = torch.randn(5, 64, device=self.device).to(self.dtype)
        w = torch.randn(100, 64, device=self.device).to(self.dtype)
        got = torch.mm(h, w.t(), out_dtype=torch.float32)
        return got.dtype == torch.float32 and self._close(got, h.float() @ w.float().t(), 0.05)

    def rms(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        """RMSNorm over the last axis, in x's dtype (statistics in fp32 inside the kernel)."""
        if self.fused_norm:
            return torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)[0]
        return F.rms_norm(x, [x.shape[-1]], weight, eps)

    def attend(self, q, k, v, bias, force: bool = False) -> torch.Tensor:
        """Softmax(q k^T / sqrt(D) + bias) v: q [B, H, N, D], k/v [B, H, S, D], bias [B, H, N, S] -> [B, H, N, D]."""
        if self.efficient or force and self.device.type in ("cuda", "meta"):
            return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, False)[0]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    def logits(self, h: torch.Tensor, head: torch.Tensor, head32: torch.Tensor | None) -> torch.Tensor:
        """[R, d] x [V, d] -> [R, V] float32 (half inputs, fp32 accumulation and output)."""
        if self.out_fp32:
            return torch.mm(h, head.t(), out_dtype=torch.float32)
        if h.dtype == torch.float32:
            return torch.mm(h, head.t())
        if head32 is not None:  # CPU: the half weights upcast once; products of halves are exact in fp32
            return torch.mm(h.float(), head32.t())
        return torch.mm(h, head.t()).float()

    @staticmethod
    def log_softmax(logits: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(logits, dim=-1)


def _rotated_rows(w: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """The rows that give rotate_half of each head's output: [heads*D, ...] -> the same with each head's halves
    swapped and the new first half negated (exact: a signed permutation)."""
    w = w.reshape(heads, 2, head_dim // 2, *w.shape[1:])
    return torch.cat([-w[:, 1:2], w[:, 0:1]], dim=1).reshape(heads * head_dim, *w.shape[3:])


class FusedDecoder:
    """The pass over a workspace; weights fused and cast once from the reference decoder's."""

    def __init__(self, reference: PackedDecoder, dtype: torch.dtype, device: torch.device):
        d = self.dims = reference.dims
        self.dtype, self.device = dtype, torch.device(device)
        self.kernels = Kernels(self.device, dtype)
        self.heads = d.num_heads + 2 * d.num_kv_heads  # Z: query, key and value head rows per layer
        self.group = d.num_heads // d.num_kv_heads
        self.rot_width = (d.num_heads + d.num_kv_heads) * d.head_dim  # columns of the rotated q and k
        self.eps = d.rms_norm_eps
        put = lambda t: t.detach().to(self.device, dtype)  # noqa: E731
        blocks = list(reference.blocks)
        self.norm1 = put(torch.stack([b.input_norm.weight for b in blocks]))  # [L, d]
        self.norm2 = put(torch.stack([b.post_norm.weight for b in blocks]))  # [L, d]
        self.w_qkv = put(torch.stack([self._qkv(b, "weight") for b in blocks]))  # [L, (2H+3Hkv)*D, d]
        self.b_qkv = put(torch.stack([self._qkv(b, "bias") for b in blocks])) if d.qkv_bias else None
        self.w_o = put(torch.stack([b.o.weight for b in blocks]))  # [L, d, H*D]
        self.w_gu = put(torch.stack([torch.cat([b.gate.weight, b.up.weight]) for b in blocks]))  # [L, 2F, d]
        self.w_down = put(torch.stack([b.down.weight for b in blocks]))  # [L, d, F]
        self.qk_norm = self._qk_norm(blocks) if d.qk_norm else None  # [L, 2(H+Hkv), D]
        self.embed = put(reference.embed)  # [V, d]
        self.head = self.embed if reference.tied else put(reference.lm_head)  # [V, d]
        self.head32 = (self.head.float() if self.device.type == "cpu" and dtype != torch.float32 else None)
        self.norm = put(reference.norm.weight)  # [d]
        self.cos, self.sin = self._rope_tables(reference.inv_freq)  # [P, 2, D] each
        self.kind = torch.tensor([0] * (d.num_heads + d.num_kv_heads) + [1] * d.num_kv_heads,
                                 device=self.device)  # [Z]: 1 for value heads (cos 1, sin 0)
        self.zero = torch.zeros((), device=self.device, dtype=dtype)  # the bias's two values
        self.neg = torch.full((), NEG, device=self.device, dtype=dtype)
        self.decision_head = (reference.head.float().to(self.device).eval() if reference.head is not None else None)

    def _qkv(self, block, what: str) -> torch.Tensor:
        """[q_rot, k_rot, q, k, v] rows (or bias entries) of one block: the rotated rows first."""
        d = self.dims
        q, k, v = (getattr(getattr(block, name), what).detach().float() for name in ("q", "k", "v"))
        rot = [_rotated_rows(q, d.num_heads, d.head_dim), _rotated_rows(k, d.num_kv_heads, d.head_dim)]
        return torch.cat([*rot, q, k, v])

    def _qk_norm(self, blocks) -> torch.Tensor:
        """Per-head q/k norm weights in the GEMM's head order (a rotated head's weight is rotated unsigned)."""
        d = self.dims

        def rotated(w):
            return torch.cat([w[d.head_dim // 2:], w[:d.head_dim // 2]])
        rows = [[rotated(b.q_norm.weight)] * d.num_heads + [rotated(b.k_norm.weight)] * d.num_kv_heads
                + [b.q_norm.weight] * d.num_heads + [b.k_norm.weight] * d.num_kv_heads for b in blocks]
        return torch.stack([torch.stack(r) for r in rows]).detach().to(self.device, self.dtype)

    def _rope_tables(self, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin per position, computed in fp32 as the reference does, with a second row (1 and 0) that value
        heads take: [P, 2, D] in the pass's dtype."""
        pos = torch.arange(self.dims.max_position, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq.float().cpu()[None, :]  # [P, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
        cos = torch.stack([emb.cos(), torch.ones_like(emb)], 1)
        sin = torch.stack([emb.sin(), torch.zeros_like(emb)], 1)
        return cos.to(self.device, self.dtype), sin.to(self.device, self.dtype)

    # -- the workspace ----------------------------------------------------------------------------------------

    def workspace(self, rows: int) -> torch.Tensor:
        """A zeroed workspace of ``rows`` rows: [L, Z, rows, D] (zeros: padding rows are masked, never NaN)."""
        d = self.dims
        return torch.zeros(d.num_layers, self.heads, rows, d.head_dim, device=self.device, dtype=self.dtype)

    def kv_rows(self, ws: torch.Tensor) -> torch.Tensor:
        """The key and value heads of every layer: [L, 2 Hkv, rows, D] (a view)."""
        return ws[:, self.dims.num_heads:]

    # -- the passes -------------------------------------------------------------------------------------------

    def score(self, ws, past_rows: int, ids, positions, order, past_length, readout_index, readout_target):
        """One packed pass over the state in ``ws`` rows [0, past_length) (a state bucket of ``past_rows`` rows).

        ids, positions [N] int64; order [N, 2] int64 (``batch.intervals``); past_length 0-d int64; readout_index,
        readout_target [R] int64 -> (target log-probs [R] fp32, decision-head scores [R] fp32 or None)."""
        bias = self._tree_bias(order, past_length, past_rows)  # [N, Sb+N]
        x = self._blocks(ws, past_rows, ids, positions, bias)  # [N, d]
        h = self.kernels.rms(x.index_select(0, readout_index), self.norm, self.eps)  # [R, d]
        logprobs = self.kernels.log_softmax(self.kernels.logits(h, self.head, self.head32))  # [R, V] fp32
        target = logprobs.gather(1, readout_target[:, None])[:, 0]  # [R]
        head = self.decision_head(h.float()) if self.decision_head is not None else None
        return target, head

    def prefill(self, ws, past_rows: int, ids, positions) -> None:
        """One causal chunk after ``past_rows`` rows of state: its K/V are written into ws rows [past, past + N)."""
        n = ids.shape[0]
        rows = torch.arange(past_rows, past_rows + n, device=self.device)  # [N]: each token's own row
        cols = torch.arange(past_rows + n, device=self.device)  # [Sb+N]
        self._blocks(ws, past_rows, ids, positions, self._bias(cols[None, :] <= rows[:, None]))

    def _bias(self, seen: torch.Tensor) -> torch.Tensor:
        """[N, W] bool -> [N, W] in the pass dtype, 0 where seen and -inf elsewhere, its rows 16-element aligned
        (what the attention kernel reads)."""
        n, width = seen.shape
        bias = torch.empty(n, -(-width // 16) * 16, device=self.device, dtype=self.dtype)[:, :width]
        torch.where(seen, self.zero, self.neg, out=bias)
        return bias

    def _tree_bias(self, order, past_length, past_rows: int) -> torch.Tensor:
        """[N, Sb+N]: 0 where a token sees a column (a real state row, itself, an ancestor), -inf elsewhere."""
        n = order.shape[0]
        pre, last = order[:, 0], order[:, 1]
        tree = (pre[None, :] <= pre[:, None]) & (pre[:, None] <= last[None, :])  # [N, N]
        state = torch.arange(past_rows, device=self.device) < past_length  # [Sb]
        return self._bias(torch.cat([state.expand(n, past_rows), tree], dim=1))  # [N, Sb+N]

    def _blocks(self, ws, past_rows: int, ids, positions, bias) -> torch.Tensor:
        """Every block over the packed tokens; returns the residual stream [N, d]."""
        x = self.embed.index_select(0, ids)  # [N, d]
        cos = self.cos[positions[:, None], self.kind[None, :]]  # [N, Z, D]
        sin = self.sin[positions[:, None], self.kind[None, :]]  # [N, Z, D]
        n = ids.shape[0]
        bias = bias.expand(self.group, self.dims.num_kv_heads, n, bias.shape[-1])  # [G, Hkv, N, Sb+N]
        for layer in range(self.dims.num_layers):
            x = self._block(layer, x, ws[layer], past_rows, cos, sin, bias)
        return x

    def _block(self, layer: int, x, ws, past_rows: int, cos, sin, bias) -> torch.Tensor:
        """One decoder block; ``ws`` [Z, rows, D] is this layer's workspace."""
        d, k = self.dims, self.kernels
        n, heads, hkv, hd = x.shape[0], d.num_heads, d.num_kv_heads, d.head_dim
        h = k.rms(x, self.norm1[layer], self.eps)  # [N, d]
        if self.b_qkv is None:
            y = torch.mm(h, self.w_qkv[layer].t())  # [N, (2H+3Hkv)*D]
        else:
            y = torch.addmm(self.b_qkv[layer], h, self.w_qkv[layer].t())
        if self.qk_norm is not None:  # Qwen3: per-head norms of q and k (and their rotated images) before rotary
            qk = y[:, :2 * self.rot_width].unflatten(1, (-1, hd))  # [N, 2(H+Hkv), D]
            qk.copy_(k.rms(qk, None, self.eps) * self.qk_norm[layer])
        rot = y[:, :self.heads * hd].unflatten(1, (self.heads, hd))  # [N, Z, D]: q_rot, k_rot, (unused, sin 0)
        main = y[:, self.rot_width:].unflatten(1, (self.heads, hd))  # [N, Z, D]: q, k, v
        new = ws[:, past_rows:past_rows + n].transpose(0, 1)  # [N, Z, D], a view of the workspace
        torch.mul(main, cos, out=new)
        new.addcmul_(rot, sin)  # q, k rotated; v unchanged (cos 1, sin 0)
        q = ws[:heads, past_rows:past_rows + n].unflatten(0, (hkv, self.group)).transpose(0, 1)  # [G, Hkv, N, D]
        keys = ws[heads:heads + hkv, :past_rows + n].expand(self.group, -1, -1, -1)  # [G, Hkv, Sb+N, D] stride 0
        values = ws[heads + hkv:, :past_rows + n].expand(self.group, -1, -1, -1)  # [G, Hkv, Sb+N, D]
        a = k.attend(q, keys, values, bias)  # [G, Hkv, N, D]
        a = a.permute(2, 1, 0, 3).reshape(n, heads * hd)  # [N, H*D], head kvh*G + g as in the weights
        x.addmm_(a, self.w_o[layer].t())  # residual += o(a), in place: one GEMM
        h = k.rms(x, self.norm2[layer], self.eps)
        gu = torch.mm(h, self.w_gu[layer].t())  # [N, 2F]
        width = gu.shape[1] // 2
        act = F.silu(gu[:, :width])
        act.mul_(gu[:, width:])
        x.addmm_(act, self.w_down[layer].t())  # residual += down(act)
        return x
