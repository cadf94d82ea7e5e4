"""The export decoder (packed tree) against transformers' own models, asked one question at a time.

Tiny random Llama, Qwen2 and Qwen3 models: fast, and they cover every supported architecture.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from onepass.runtime.backends.torch_decoder import PackedDecoder  # noqa: E402
from onepass.runtime.core.tree import QuestionTokens, option_logprobs, pack  # noqa: E402
from onepass.runtime.backends.batch import causal  # noqa: E402
from reference import option_logprobs_alone  # noqa: E402

TOL = 1e-4  # float32 vs transformers' float32 eager forward, summed over an option's tokens

CONFIGS = {
    "llama": transformers.LlamaConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
}


def tiny_model(arch: str):
    torch.manual_seed(0)
    config = CONFIGS[arch](vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                           rope_theta=10000.0, tie_word_embeddings=arch == "llama", attn_implementation="eager")
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    if arch == "qwen2":  # random biases, so the q/k/v bias path is exercised
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    return model


QUESTIONS = [
    QuestionTokens(trunk=(11, 12, 13), options=((20, 21), (20, 22, 23), (30,))),
    QuestionTokens(trunk=(14, 15), options=((40,), (41, 42))),
    QuestionTokens(trunk=(16,), options=((50, 51, 52), (53,))),
]
STATE = [1, 5, 9, 2, 7, 3, 8]


def packed_logprobs(decoder, batch_fn=None):
    d = decoder.dims
    empty = [torch.zeros(d.num_kv_heads, 0, d.head_dim) for _ in range(2 * d.num_layers)]

    def run(batch, past):
        t = torch.from_numpy
        return decoder(t(batch.input_ids), t(batch.position_ids), t(batch.tree_mask), *past,
                       t(batch.readout_index), t(batch.readout_target))

    with torch.no_grad():
        past = list(run(causal(STATE, 0), empty)[1:])
        batch = pack(QUESTIONS, len(STATE))
        if batch_fn:
            batch = batch_fn(batch)
        return option_logprobs(batch, run(batch, past)[0].numpy())


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_packed_decoder_equals_each_question_alone(arch):
    model = tiny_model(arch)
    decoder = PackedDecoder(model).eval()
    got = packed_logprobs(decoder)
    for q, lp in zip(QUESTIONS, got):
        want = option_logprobs_alone(model, STATE, q)
        np.testing.assert_allclose(lp, want, rtol=0, atol=TOL, err_msg=f"{arch}: max diff {np.abs(lp - want).max()}")


def test_negative_control_causal_mask_over_the_packed_sequence_fails():
    """A plain causal mask (questions see each other) must not pass the same check."""
    import dataclasses

    model = tiny_model("llama")
    decoder = PackedDecoder(model).eval()
    n = pack(QUESTIONS, len(STATE)).num_tokens
    broken = packed_logprobs(decoder, lambda b: dataclasses.replace(b, tree_mask=np.tril(np.ones((n, n), bool))))
    diffs = [np.abs(lp - option_logprobs_alone(model, STATE, q)).max() for q, lp in zip(QUESTIONS, broken)]
    assert max(diffs) > 100 * TOL


def fused_logprobs(model, bucket_state: bool = False):
    """The GPU pass (fused_decoder.py, fp32 on CPU) over the same state and questions: prefill into a workspace,
    then one packed pass; ``bucket_state`` pads the state rows to 16 with junk, masked by past_length."""
    from onepass.runtime.backends.fused_decoder import FusedDecoder

    fused = FusedDecoder(PackedDecoder(model).eval(), torch.float32, torch.device("cpu"))
    batch = pack(QUESTIONS, len(STATE))
    past = 16 if bucket_state else len(STATE)
    ws = fused.workspace(past + batch.num_tokens)
    t = torch.from_numpy
    with torch.inference_mode():
        fused.prefill(ws, 0, t(np.asarray(STATE)), t(np.arange(len(STATE))))
        fused.kv_rows(ws)[:, :, len(STATE):past] = 7.0  # junk in the padding rows
        target, _ = fused.score(ws, past, t(batch.input_ids), t(batch.position_ids), t(batch.tree_order),
                                torch.tensor(len(STATE)), t(batch.readout_index), t(batch.readout_target))
    return option_logprobs(batch, target.numpy())


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_the_gpu_pass_equals_each_question_alone(arch):
    """Llama, Qwen2 (q/k/v biases, folded with the rotated rows) and Qwen3 (per-head q/k norms before rotary): the
    fused pass against transformers asked one question at a time, its state padded with masked junk rows."""
    model = tiny_model(arch)
    for lp, q in zip(fused_logprobs(model, bucket_state=True), QUESTIONS):
        want = option_logprobs_alone(model, STATE, q)
        np.testing.assert_allclose(lp, want, rtol=0, atol=TOL, err_msg=f"{arch}: max diff {np.abs(lp - want).max()}")
    plain = fused_logprobs(model)
    assert max(float(np.abs(a - b).max()) for a, b in zip(plain, fused_logprobs(model, bucket_state=True))) < TOL
