"""A compact decoder forward written for export: the packed-tree decision graph.

It re-implements the Llama / Qwen2 / Qwen3 block (RMSNorm, rotary attention with
grouped K/V heads, SwiGLU MLP) over weights taken from a Hugging Face model, with
the inputs and outputs of :mod:`onepass.runtime.backends.contract`. Transformers' own model
stays the independent reference the tests compare against.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from types import SimpleNamespace

import torch
from torch import nn

from .contract import PROJECTIONS
from .errors import ModelSourceError
from .model import ModelInfo

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class DecoderDims(ModelInfo):
    """Dimensions of a decoder, read from a Hugging Face config: the manifest's ``ModelInfo`` (what the runtime
    needs of any backend) and what only the PyTorch decoder needs to compute."""

    intermediate_size: int
    rope_theta: float
    rms_norm_eps: float
    qkv_bias: bool
    qk_norm: bool

    def model_info(self) -> ModelInfo:
        """The manifest's part."""
        return ModelInfo(**{f.name: getattr(self, f.name) for f in fields(ModelInfo)})

    @classmethod
    def from_hf_config(cls, config) -> "DecoderDims":
        """Validate and read a transformers config; unsupported models raise ModelSourceError."""
        arch = config.model_type
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelSourceError(
                f"model_type {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ModelSourceError(f"rope type {rope_type!r} is not supported; only plain RoPE ('default')")
        theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ModelSourceError(f"hidden_act {config.hidden_act!r} is not supported; only 'silu'")
        heads = config.num_attention_heads
        return cls(
            architecture=arch,
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            vocab_size=config.vocab_size,
            rope_theta=float(theta),
            rms_norm_eps=float(config.rms_norm_eps),
            max_position=int(config.max_position_embeddings),
            qkv_bias=arch == "qwen2" or bool(getattr(config, "attention_bias", False)),
            qk_norm=arch == "qwen3",
        )


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, as in the reference models."""

    def __init__(self, weight: torch.Tensor, eps: float, share: bool = False):
        super().__init__()
        self.weight = weight if share else nn.Parameter(weight.detach().float().clone(), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


def _linear(layer: nn.Linear) -> nn.Linear:
    out = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
    out.load_state_dict(layer.state_dict())
    return out.float().requires_grad_(False)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The rotate-half rotary convention of Llama/Qwen."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Block(nn.Module):
    """One decoder layer over a packed sequence with a past."""

    def __init__(self, hf_layer, dims: DecoderDims, share: bool = False):
        super().__init__()
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        self.dims = dims
        own = (lambda m: m) if share else _linear
        self.input_norm = RMSNorm(hf_layer.input_layernorm.weight, dims.rms_norm_eps, share)
        self.post_norm = RMSNorm(hf_layer.post_attention_layernorm.weight, dims.rms_norm_eps, share)
        self.q, self.k, self.v, self.o = (own(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj))
        if dims.qk_norm:
            self.q_norm = RMSNorm(attn.q_norm.weight, dims.rms_norm_eps, share)
            self.k_norm = RMSNorm(attn.k_norm.weight, dims.rms_norm_eps, share)
        self.gate, self.up, self.down = (own(m) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))

    def _proj(self, name: str, h, task):
        """The projection ``name`` of ``h``, plus each token's own task's low-rank update where ``task`` has one."""
        y = getattr(self, name)(h)
        if task is not None and name in task.weights:
            a, b = task.weights[name]  # [in, K], [K, out]: every task's slots side by side
            y = y + ((h @ a) * task.mask) @ b  # mask [N, K]: 1 on the slots of the token's task, else 0
        return y

    def forward(self, x, cos, sin, bias, past_k, past_v, task: "TaskSlots | None" = None):
        """x [N, d]; cos/sin [N, D]; bias [N, S+N]; past [Hkv, S, D] -> (x, new_k, new_v)."""
        d = self.dims
        n = x.shape[0]
        group = d.num_heads // d.num_kv_heads
        h = self.input_norm(x)
        q = self._proj("q", h, task).view(n, d.num_heads, d.head_dim).transpose(0, 1)  # [H, N, D]
        k = self._proj("k", h, task).view(n, d.num_kv_heads, d.head_dim).transpose(0, 1)  # [Hkv, N, D]
        v = self._proj("v", h, task).view(n, d.num_kv_heads, d.head_dim).transpose(0, 1)  # [Hkv, N, D]
        if d.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        keys = torch.cat([past_k, k], dim=1)  # [Hkv, S+N, D]
        values = torch.cat([past_v, v], dim=1)  # [Hkv, S+N, D]
        # Query heads of one K/V group are stacked on the row axis: no K/V repeat.
        qg = q.reshape(d.num_kv_heads, group * n, d.head_dim)  # [Hkv, G*N, D]
        scores = qg @ keys.transpose(1, 2) * (d.head_dim**-0.5)  # [Hkv, G*N, S+N]
        scores = scores + bias.repeat(group, 1)
        out = torch.softmax(scores, dim=-1) @ values  # [Hkv, G*N, D]
        out = out.reshape(d.num_heads, n, d.head_dim).transpose(0, 1).reshape(n, -1)  # [N, H*D]
        x = x + self._proj("o", out, task)
        h = self.post_norm(x)
        x = x + self._proj("down", nn.functional.silu(self._proj("gate", h, task)) * self._proj("up", h, task), task)
        return x, k, v


class PackedDecoder(nn.Module):
    """The decision graph: packed tree + state past -> target log-probs and new K/V."""

    def __init__(self, hf_model, share: bool = False):
        """Copy the weights of ``hf_model`` (frozen float32), or with ``share`` use its very modules and
        parameters, so that training this decoder (e.g. LoRA wrappers already in ``hf_model``) trains the
        Hugging Face model in place."""
        super().__init__()
        dims = DecoderDims.from_hf_config(hf_model.config)
        self.dims = dims
        base = hf_model.model
        own = (lambda w: w) if share else (lambda w: nn.Parameter(w.detach().float().clone(), requires_grad=False))
        self.embed = own(base.embed_tokens.weight)
        self.blocks = nn.ModuleList(Block(layer, dims, share) for layer in base.layers)
        self.norm = RMSNorm(base.norm.weight, dims.rms_norm_eps, share)
        head = hf_model.lm_head.weight
        self.tied = head.data_ptr() == base.embed_tokens.weight.data_ptr()
        if not self.tied:
            self.lm_head = own(head)
        inv_freq = 1.0 / (dims.rope_theta ** (torch.arange(0, dims.head_dim, 2, dtype=torch.float32) / dims.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.head: DecisionHead | None = None

    @classmethod
    def from_state_dict(cls, dims: DecoderDims, state: dict) -> "PackedDecoder":
        """The decoder rebuilt from its own state dict (e.g. the ONNX graph's initializers) and dims.

        A ``head.*`` entry set adds the decision head. No Hugging Face model is needed.
        """
        ns = SimpleNamespace

        def linear(prefix):
            w, b = state[prefix + ".weight"], state.get(prefix + ".bias")
            m = nn.Linear(w.shape[1], w.shape[0], bias=b is not None)
            m.weight.data = w
            if b is not None:
                m.bias.data = b
            return m

        def norm(name):
            return ns(weight=state[name]) if name in state else None

        layers = [ns(self_attn=ns(q_proj=linear(f"blocks.{i}.q"), k_proj=linear(f"blocks.{i}.k"),
                                  v_proj=linear(f"blocks.{i}.v"), o_proj=linear(f"blocks.{i}.o"),
                                  q_norm=norm(f"blocks.{i}.q_norm.weight"), k_norm=norm(f"blocks.{i}.k_norm.weight")),
                     mlp=ns(gate_proj=linear(f"blocks.{i}.gate"), up_proj=linear(f"blocks.{i}.up"),
                            down_proj=linear(f"blocks.{i}.down")),
                     input_layernorm=norm(f"blocks.{i}.input_norm.weight"),
                     post_attention_layernorm=norm(f"blocks.{i}.post_norm.weight"))
                  for i in range(dims.num_layers)]
        embed = ns(weight=state["embed"])
        config = ns(model_type=dims.architecture, rope_parameters={"rope_type": "default", "rope_theta": dims.rope_theta},
                    hidden_act="silu", num_attention_heads=dims.num_heads, num_key_value_heads=dims.num_kv_heads,
                    head_dim=dims.head_dim, hidden_size=dims.hidden_size, intermediate_size=dims.intermediate_size,
                    num_hidden_layers=dims.num_layers, vocab_size=dims.vocab_size, rms_norm_eps=dims.rms_norm_eps,
                    max_position_embeddings=dims.max_position, attention_bias=dims.qkv_bias)
        hf = ns(config=config, model=ns(embed_tokens=embed, layers=layers, norm=norm("norm.weight")),
                lm_head=ns(weight=state.get("lm_head", embed.weight)))
        decoder = cls(hf)
        if "head.out.weight" in state:
            width = state["head.inner.weight"].shape[0] if "head.inner.weight" in state else 0
            head = DecisionHead(dims.hidden_size, width)
            head.load_state_dict({k[len("head."):]: v for k, v in state.items() if k.startswith("head.")})
            decoder.attach_head(head)
        return decoder

    def attach_head(self, head: "DecisionHead | None") -> "PackedDecoder":
        """Add (or remove) a decision head: the graph then also outputs ``head_score`` [R]."""
        self.head = head
        return self

    def readout(self, input_ids, position_ids, tree_mask, *args, past_length=None, tasks: dict | None = None,
                exits=None):
        """(final-normed hidden states at the read-out rows [R, d], target log-probs [R], presents).

        ``args``: the 2L past tensors, readout_index, readout_target and optionally ``past_length`` (a 0-d int64
        tensor, the contract's last input; also a keyword): only the first ``past_length`` rows of the past are the
        state, the rest padding no token sees (a state padded to a length bucket). None: every row. ``exits`` [R]
        int64: the block count each read-out row is read after (1..L; None: every row after all L blocks)."""
        layers = self.dims.num_layers
        past = args[: 2 * layers]
        readout_index, readout_target = args[2 * layers], args[2 * layers + 1]
        if len(args) > 2 * layers + 2:
            past_length = args[2 * layers + 2]
        x = self.embed[input_ids]  # [N, d]
        tables = self.attention_tables(position_ids, tree_mask, past[0].shape[1], past_length)
        if exits is None:
            x, presents = self.run_blocks(x, tables, past, range(layers), tasks)
            h, target = self.final(x, readout_index, readout_target)
            return h, target, presents
        rows, presents = torch.zeros(readout_index.shape[0], x.shape[1], dtype=x.dtype, device=x.device), []
        for i in range(layers):  # each row keeps the residual stream after its own exit block
            x, present = self.run_blocks(x, tables, past[2 * i:2 * i + 2], range(i, i + 1), tasks)
            presents += present
            rows = torch.where((exits == i + 1)[:, None], x[readout_index], rows)
        h, target = self.final_rows(rows, readout_target)
        return h, target, presents

    def attention_tables(self, position_ids, tree_mask, past_rows: int, past_length=None):
        """(cos, sin, attention bias) of a pass: rotary tables [N, D] and the additive bias [N, S+N] (the past's
        first ``past_length`` rows and the tree mask seen, the rest not)."""
        freqs = position_ids.float()[:, None] * self.inv_freq[None, :]  # [N, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        n, s = position_ids.shape[0], past_rows
        tree_bias = torch.where(tree_mask, 0.0, torch.finfo(torch.float32).min)  # [N, N]
        past_bias = tree_bias.new_zeros(n, s)  # [N, S]
        if past_length is not None:  # padding rows of the past: never seen
            past_bias = torch.where(torch.arange(s, device=tree_bias.device) < past_length, 0.0,
                                    torch.finfo(torch.float32).min).expand(n, s)
        return emb.cos(), emb.sin(), torch.cat([past_bias, tree_bias], dim=1)  # bias fp32, on the inputs' device

    def run_blocks(self, x, tables, past, blocks, tasks: dict | None = None):
        """x [N, d] through the blocks numbered ``blocks`` (a range), each with its own past pair in ``past`` (2 per
        block, in the range's order) -> (x, presents of those blocks). ``tasks``: block number -> its ``TaskSlots``."""
        cos, sin, bias = tables
        presents = []
        for j, i in enumerate(blocks):
            x, k, v = self.blocks[i](x, cos, sin, bias, past[2 * j], past[2 * j + 1], (tasks or {}).get(i))
            presents += [k, v]
        return x, presents

    def final(self, x, readout_index, readout_target):
        """(final-normed hidden states at the read-out rows [R, d], log-probs of the read-out targets [R])."""
        return self.final_rows(x[readout_index], readout_target)

    def final_rows(self, rows, readout_target):
        """``final`` of the read-out rows' residual streams [R, d] already gathered."""
        h = self.norm(rows)  # [R, d]
        head = self.embed if self.tied else self.lm_head
        logits = h @ head.t()  # [R, V]
        logprobs = torch.log_softmax(logits, dim=-1)
        return h, logprobs.gather(1, readout_target[:, None])[:, 0]  # [R]

    def forward(self, input_ids, position_ids, tree_mask, *args, past_length=None):
        """See onepass.runtime.backends.contract for the inputs and outputs (``past_length``: see ``readout``)."""
        h, target, presents = self.readout(input_ids, position_ids, tree_mask, *args, past_length=past_length)
        if self.head is None:
            return (target, *presents)
        return (target, *presents, self.head(h))


@dataclass(frozen=True)
class TaskSlots:
    """The tuned tasks' low-rank updates of one block, side by side: for each adapted projection,
    A [in, K] and B [K, out] hold every task's rank-r factors in its own K-slots (the scale folded into B), and
    ``mask`` [N, K] is 1 on the slots of each token's task (0 everywhere for a token of no task, e.g. the state's)."""

    mask: torch.Tensor
    weights: dict  # projection name ("q" ... "down") -> (A, B)


class TaskDecoder(nn.Module):
    """The packed decoder with task slots on the blocks ``task_blocks``: the contract's inputs, then ``task_mask``
    [N, K] and, per task block and projection (``PROJECTIONS`` order), ``task_a`` [in, K] and ``task_b`` [K, out].
    Each token applies its own task's update, so questions of different tasks share one pass and one state cache;
    K is a dynamic axis: tasks are data fed with the pass, and the graph stays the base engine's."""

    def __init__(self, decoder: PackedDecoder, task_blocks, heads: bool = False):
        super().__init__()
        if decoder.head is not None:
            raise ValueError("task slots and a decision head do not combine")
        self.decoder, self.task_blocks, self.heads = decoder, tuple(task_blocks), heads
        self.dims = decoder.dims

    def forward(self, input_ids, position_ids, tree_mask, *args):
        """The contract's outputs; with ``heads`` (``contract.task_head_specs``'s inputs after the factors) also
        ``head_score`` [R]: each row's task head over its hidden state read after its exit block."""
        base = 2 * self.dims.num_layers + 3  # past K/V, readout_index, readout_target, past_length
        per_block = 2 * len(PROJECTIONS)
        mask, weights = args[base], args[base + 1:base + 1 + per_block * len(self.task_blocks)]
        tasks = {b: TaskSlots(mask, {p: (weights[j * per_block + 2 * k], weights[j * per_block + 2 * k + 1])
                                     for k, p in enumerate(PROJECTIONS)})
                 for j, b in enumerate(self.task_blocks)}
        if not self.heads:
            _, target, presents = self.decoder.readout(input_ids, position_ids, tree_mask, *args[:base], tasks=tasks)
            return (target, *presents)
        exits, unit_mask, bias, w_in, b_in, w_out = args[base + 1 + per_block * len(self.task_blocks):]
        h, target, presents = self.decoder.readout(input_ids, position_ids, tree_mask, *args[:base], tasks=tasks,
                                                   exits=exits)
        units = nn.functional.silu(h @ w_in + b_in)  # [R, U]: every head's units on every row, each row keeps its own
        return (target, *presents, (units * w_out * unit_mask).sum(-1) + bias)


class DecisionHead(nn.Module):
    """A small MLP (or, with ``width=0``, a linear map) over the final-normed hidden state at a read-out row.

    An option's head score is the value at its last read-out row (the row that predicts
    the option's end token, i.e. the hidden state after reading the whole option).
    """

    def __init__(self, hidden_size: int, width: int = 32, shift=None, scale=None):
        super().__init__()
        self.hidden_size, self.width = hidden_size, width
        # Standardisation of the hidden state (fitted on training data), part of the graph.
        self.register_buffer("shift", torch.as_tensor(shift if shift is not None else torch.zeros(hidden_size)).float())
        self.register_buffer("scale", torch.as_tensor(scale if scale is not None else torch.ones(hidden_size)).float())
        self.inner = nn.Linear(hidden_size, width) if width else None  # width 0: a linear head
        self.out = nn.Linear(width or hidden_size, 1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """[R, d] -> [R]."""
        z = (h - self.shift) / self.scale
        if self.inner is not None:
            z = nn.functional.silu(self.inner(z))
        return self.out(z)[:, 0]


PRECISIONS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class LowPrecisionLinear(torch.nn.Module):
    """A linear layer whose weights and GEMM are fp16/bf16; input and output stay float32."""

    def __init__(self, linear: torch.nn.Linear, dtype: torch.dtype):
        super().__init__()
        self.inner = linear.to(dtype)
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.to(self.dtype)).float()


def lower_precision(decoder: PackedDecoder, precision: str) -> PackedDecoder:
    """Mixed precision: every block's weight GEMMs in ``precision``; embedding, norms, rotary,
    attention softmax, residual stream, read-out and K/V stay float32 (the residual stream of
    SmolLM2 reaches ~25,000, where fp16 has a resolution of 16)."""
    if precision == "fp32":
        return decoder
    dtype = PRECISIONS[precision]
    for block in decoder.blocks:
        for name in ("q", "k", "v", "o", "gate", "up", "down"):
            setattr(block, name, LowPrecisionLinear(getattr(block, name), dtype))
    return decoder
