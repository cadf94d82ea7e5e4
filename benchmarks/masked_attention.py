"""Skipping the masked attention: exact forms that compute only the packed x packed entries a
token may see, exported to ONNX and timed against the engine's dense graph on the CPU backends.

The dense pass scores every packed token against the state and against every packed token, and the tree mask hides
~95% of the packed x packed entries (``roofline.md``): no question sees another. The tokens of a pass split into

- the **shared** tokens (the trie nodes below which more than one question hangs, e.g. the template's first tokens):
  every token may see some of them, so they stay dense, beside the state;
- each question's **private** tokens, which only that question's tokens see: packed into blocks of ``L`` slots
  (first fit, largest first; ``L`` the largest question's private tokens rounded up to 8), so a token's private
  ancestors all lie in its own block.

A token then attends to the state, to its ancestors among the shared tokens (``global_mask`` [N, P]) and to its
ancestors in its own block (``block_mask`` [N, L]), each exactly once (checked: both masks are subsets of its tree-mask
row and their counts add up to it). The GEMMs still run on the N packed
tokens (no padding); only the attention is laid out in blocks, by gathers. Two forms:

- ``gathered``: each token's scores against the state and the shared tokens (dense, [N, S+P]) and against its
  block ([B, L, L] computed per block, gathered per token [N, L]); one softmax over S+P+L; no padded rows.
- ``per block``: each block's query rows against [state, shared tokens, its block]: the standard attention pattern
  with batch axes (KV head, block), which OpenVINO fuses into its attention ``Subgraph`` as it does the dense
  graph's; the state's K/V is broadcast to every block and the padding slots are computed as rows.

Measured: the answers (log-probs) against the dense reference decoder in PyTorch and against the engine's graph on
each backend (1e-4), with a negative control that must fail (the shared tokens hidden); the attention entries each
form computes; and the pass warm (the README ticket's 13 questions over a ~512-token state, every graph fed the same
way, interleaved rounds, medians after a warm-up), with OpenVINO's per-operation time. Writes
benchmarks/results/masked_attention.{json,md}.

    python benchmarks/masked_attention.py --engine engines/smollm2 [--rounds 9]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

THREADS = 2
os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
import openvino as ov  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.export import Dim  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from latency import QUESTIONS, cpu_name, interleaved, state_of_tokens  # noqa: E402
from roofline import op_kind_ms  # noqa: E402

from onepass import Engine  # noqa: E402
from onepass.runtime.backends import contract  # noqa: E402
from onepass.runtime.backends.torch_backend import decoder_from_engine  # noqa: E402
from onepass.runtime.backends.torch_decoder import rotate_half  # noqa: E402

RESULTS = Path(__file__).parent / "results"
TOLERANCE = 1e-4  # max |d log-prob| against the dense pass, as packed == alone
LAYOUT = ("global_mask", "global_index", "block_index", "token_slot", "block_mask")
FORMS = ("gathered", "per block")


def layout(batch) -> dict:
    """The shared tokens, the blocks of private tokens and each token's slot of a packed batch (see the module's
    doc); ValueError unless every token sees exactly what its tree mask row says."""
    tree = batch.tree_mask
    n = tree.shape[0]
    members, questions = np.zeros(n, np.int64), []
    for options in batch.option_readouts:
        # the question's tokens: its read-outs' ancestors
        tokens = tree[batch.readout_index[np.concatenate(options)]].any(0)
        members += tokens
        questions.append(np.flatnonzero(tokens))
    shared = members > 1
    global_index = np.flatnonzero(shared)
    items = [q[~shared[q]] for q in questions]
    # a shared token takes a slot of its own and sees nothing through its block
    items = [q for q in items if len(q)] + [np.array([t]) for t in global_index]
    size = -(-max(8, max(len(q) for q in items)) // 8) * 8
    bins: list[list] = []
    for item in sorted(items, key=len, reverse=True):  # first fit, largest first
        home = next((b for b in bins if sum(map(len, b)) + len(item) <= size), None)
        if home is None:
            bins.append([item])
        else:
            home.append(item)
    block_index = np.zeros((len(bins), size), np.int64)  # padding slots hold token 0, never seen
    real = np.zeros((len(bins), size), bool)
    slot = np.full(n, -1, np.int64)
    for b, items_in in enumerate(bins):
        tokens = np.concatenate(items_in)
        block_index[b, :len(tokens)], real[b, :len(tokens)] = tokens, True
        slot[tokens] = b * size + np.arange(len(tokens))
    block = slot // size
    block_mask = (tree[np.arange(n)[:, None], block_index[block]] & real[block] & ~shared[block_index[block]]
                  & ~shared[:, None])
    global_mask = tree[:, global_index]
    if (slot < 0).any():
        raise ValueError(f"{int((slot < 0).sum())} packed tokens belong to no question's read-outs (a padded batch?): "
                         "the layout places the tokens of questions only")
    if real.sum() != n or not np.array_equal(global_mask.sum(1) + block_mask.sum(1), tree.sum(1)):
        raise ValueError("the layout does not cover each token's tree exactly once")  # both masks are subsets of it
    return {"global_mask": global_mask, "global_index": global_index, "block_index": block_index,
            "token_slot": slot, "block_mask": block_mask}


def entries(n: int, past: int, lay: dict) -> dict:
    """Attention score entries per head and block each form computes."""
    blocks, size = lay["block_index"].shape
    shared = len(lay["global_index"])
    return {"dense": n * (past + n), "gathered": n * (past + shared) + blocks * size * size,
            "per block": blocks * size * (past + shared + size)}


class SkippingDecoder(nn.Module):
    """The reference decoder's pass with the attention of ``form``: inputs are the contract's with ``tree_mask``
    replaced by the five ``LAYOUT`` arrays; outputs are the contract's (target log-probs, then each block's new K/V)."""

    def __init__(self, decoder, form: str):
        super().__init__()
        self.decoder, self.form = decoder, form

    def forward(self, input_ids, position_ids, global_mask, global_index, block_index, token_slot, block_mask, *args):
        dec, d = self.decoder, self.decoder.dims
        past = args[: 2 * d.num_layers]
        readout_index, readout_target, past_length = args[2 * d.num_layers:]
        x = dec.embed[input_ids]
        freqs = position_ids.float()[:, None] * dec.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        low = torch.finfo(torch.float32).min
        past_bias = torch.where(torch.arange(past[0].shape[1]) < past_length, 0.0, low)  # [S]
        masks = (past_bias, torch.where(global_mask, 0.0, low), torch.where(block_mask, 0.0, low))
        index = (global_index, block_index, token_slot)
        attend = self._gathered if self.form == "gathered" else self._per_block
        presents = []
        for i, blk in enumerate(dec.blocks):
            n = x.shape[0]
            h = blk.input_norm(x)
            q = blk.q(h).view(n, d.num_heads, d.head_dim).transpose(0, 1)
            k = blk.k(h).view(n, d.num_kv_heads, d.head_dim).transpose(0, 1)
            v = blk.v(h).view(n, d.num_kv_heads, d.head_dim).transpose(0, 1)
            q = (q * cos + rotate_half(q) * sin) * (d.head_dim ** -0.5)
            k = k * cos + rotate_half(k) * sin
            out = attend(q, k, v, past[2 * i], past[2 * i + 1], masks, index)  # [H, N, D]
            x = x + blk.o(out.transpose(0, 1).reshape(n, -1))
            h = blk.post_norm(x)
            x = x + blk.down(nn.functional.silu(blk.gate(h)) * blk.up(h))
            presents += [k, v]
        return (dec.final(x, readout_index, readout_target)[1], *presents)

    def _gathered(self, q, k, v, past_k, past_v, masks, index):
        """Scores against [state, shared] densely and against the token's block (computed per block, gathered per
        token); one softmax per row."""
        d = self.decoder.dims
        global_index, block_index, token_slot = index
        hk, group, n, dim = d.num_kv_heads, d.num_heads // d.num_kv_heads, q.shape[1], d.head_dim
        blocks, size = block_index.shape
        flat = block_index.reshape(-1)
        keys = torch.cat([past_k, k[:, global_index]], 1)  # [Hkv, S+P, D]
        values = torch.cat([past_v, v[:, global_index]], 1)
        bias = torch.cat([masks[0].expand(n, -1), masks[1]], 1)  # [N, S+P]
        dense = q.reshape(hk, group * n, dim) @ keys.transpose(1, 2) + bias.repeat(group, 1)
        qb = q[:, flat].reshape(hk, group, blocks, size, dim)
        kb = k[:, flat].reshape(hk, 1, blocks, size, dim)
        vb = v[:, flat].reshape(hk, 1, blocks, size, dim)
        local = (qb @ kb.transpose(-1, -2)).reshape(hk, group, blocks * size, size)[:, :, token_slot]  # [Hkv,G,N,L]
        local = local.reshape(hk, group * n, size) + masks[2].repeat(group, 1)
        p = torch.softmax(torch.cat([dense, local], -1), -1)
        out = p[..., : keys.shape[1]] @ values  # [Hkv, G*N, D]
        p_local = p[..., keys.shape[1]:].reshape(hk, group, n, size)[:, :, flat].reshape(hk, group, blocks, size, size)
        out_local = (p_local @ vb).reshape(hk, group, blocks * size, dim)[:, :, token_slot]
        return (out + out_local.reshape(hk, group * n, dim)).reshape(d.num_heads, n, dim)

    def _per_block(self, q, k, v, past_k, past_v, masks, index):
        """Each block's rows against [state, shared, its block]: batch axes (KV head, block), one fused attention."""
        d = self.decoder.dims
        global_index, block_index, token_slot = index
        hk, group, dim = d.num_kv_heads, d.num_heads // d.num_kv_heads, d.head_dim
        blocks, size = block_index.shape
        flat = block_index.reshape(-1)
        s, p = past_k.shape[1], global_index.shape[0]
        bias = torch.cat([masks[0].expand(blocks, size, s), masks[1][flat].reshape(blocks, size, p),
                          masks[2][flat].reshape(blocks, size, size)], -1)  # [B, L, S+P+L]
        bias = bias[:, None].expand(blocks, group, size, s + p + size).reshape(blocks, group * size, -1)
        rows = q[:, flat].reshape(hk, group, blocks, size, dim).transpose(1, 2).reshape(hk, blocks, group * size, dim)
        shared_k = torch.cat([past_k, k[:, global_index]], 1)[:, None].expand(hk, blocks, s + p, dim)
        shared_v = torch.cat([past_v, v[:, global_index]], 1)[:, None].expand(hk, blocks, s + p, dim)
        keys = torch.cat([shared_k, k[:, flat].reshape(hk, blocks, size, dim)], 2)
        values = torch.cat([shared_v, v[:, flat].reshape(hk, blocks, size, dim)], 2)
        out = torch.softmax(rows @ keys.transpose(-1, -2) + bias, -1) @ values  # [Hkv, B, G*L, D]
        out = out.reshape(hk, blocks, group, size, dim).transpose(1, 2).reshape(d.num_heads, blocks * size, dim)
        return out[:, token_slot]


def export(module: SkippingDecoder, inputs: list, path: Path) -> None:
    """``module`` to ONNX with every axis the layout or the pass sizes dynamic."""
    past = contract.io_names(module.decoder.dims, ())[0]
    n, s, p, b, size, r = (Dim.DYNAMIC,) * 6
    shapes = [{0: n}, {0: n}, {0: n, 1: p}, {0: p}, {0: b, 1: size}, {0: n}, {0: n, 1: size}]
    dynamic = (*shapes, (*({1: s} for _ in past), {0: r}, {0: r}, {}))
    names = ["input_ids", "position_ids", *LAYOUT, *past, contract.READOUT_INDEX, contract.READOUT_TARGET,
             contract.PAST_LENGTH]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(module, tuple(inputs), dynamo=True,
                                    input_names=names, dynamic_shapes=dynamic, opset_version=18, optimize=True,
                                    verbose=False)
    program.save(str(path), external_data=True)


class Graph:
    """One ONNX graph on one backend, fed by name: OpenVINO compiled with ``config`` (the engine's OpenVINO backend's:
    f32, latency hint, 2 threads), or ONNX Runtime with every graph optimisation and 2 threads (its CPU arena on,
    which the engine's backend turns off to return memory; the same for every graph timed)."""

    def __init__(self, path: Path, backend: str, config: dict, profile: bool = False):
        if backend == "openvino-cpu":
            config = {**config, **({"PERF_COUNT": "YES"} if profile else {})}
            core = ov.Core()
            compiled = core.compile_model(core.read_model(str(path)), "CPU", config)
            self.names = [i.get_any_name() for i in compiled.inputs]
            self.request = compiled.create_infer_request()
            self.run = lambda feed: self.request.infer(feed)[0]
        else:
            opts = ort.SessionOptions()
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            opts.intra_op_num_threads = THREADS
            session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
            self.names = [i.name for i in session.get_inputs()]
            self.run = lambda feed: session.run(None, feed)[0]

    def __call__(self, feed: dict) -> np.ndarray:
        return np.array(self.run({k: feed[k] for k in self.names}))

    def op_ms(self) -> dict:
        """OpenVINO's per-operation-kind milliseconds of the last pass (PERF_COUNT)."""
        return op_kind_ms(self.request.profiling_info)


def feeds(batch, kv: dict, past: int, lay: dict) -> tuple[dict, dict]:
    """(the dense graph's feed, the skipping graphs' feed) of ``batch`` over the state ``kv`` (the past K/V by input
    name, in the contract's order) of which ``past`` rows are the state."""
    common = {**kv, contract.PAST_LENGTH: np.asarray(past, np.int64)}
    dense = {**contract.batch_inputs(batch), **common}
    skipping = {"input_ids": batch.input_ids, "position_ids": batch.position_ids, **lay, **common,
                contract.READOUT_INDEX: batch.readout_index, contract.READOUT_TARGET: batch.readout_target}
    return dense, skipping


def ordered(feed: dict, head: list) -> list:
    """``feed``'s arrays in a graph's input order: ``head``, the past K/V (in the feed's order, the contract's: see
    :func:`feeds`), the read-outs, ``past_length``."""
    past = [k for k in feed if k.startswith("past_") and k != contract.PAST_LENGTH]
    keys = [*head, *past, contract.READOUT_INDEX, contract.READOUT_TARGET, contract.PAST_LENGTH]
    return [torch.from_numpy(np.asarray(feed[k])) for k in keys]


def parity_torch(decoder, modules: dict, dense: dict, skipping: dict) -> tuple[dict, np.ndarray]:
    """Max |d log-prob| of each form against the dense reference decoder, and of the negative control (the
    ``gathered`` form with the shared tokens hidden from every token), which must exceed the tolerance; and the
    reference log-probs."""
    head = ["input_ids", "position_ids", *LAYOUT]
    with torch.no_grad():
        ref = decoder(*ordered(dense, ["input_ids", "position_ids", contract.TREE_MASK]))[0].numpy()
        out = {form: float(np.abs(m(*ordered(skipping, head))[0].numpy() - ref).max()) for form, m in modules.items()}
        blind = {**skipping, "global_mask": np.zeros_like(skipping["global_mask"])}
        out["negative control (shared tokens hidden)"] = float(
            np.abs(modules["gathered"](*ordered(blind, head))[0].numpy() - ref).max())
    return out, ref


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", required=True)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--state-tokens", type=int, default=512)
    ap.add_argument("--out", default=str(RESULTS / "masked_attention"))
    args = ap.parse_args(argv)

    engine = Engine.load(args.engine, threads=THREADS, backend="openvino-cpu")
    state = engine.state(state_of_tokens(engine, args.state_tokens))
    batch = engine.pack(state, engine.encode_questions(QUESTIONS))
    kv = dict(zip(engine.backend.past_names, (np.asarray(a) for pair in state.kv.layers for a in pair)))
    lay = layout(batch)
    dense_feed, skip_feed = feeds(batch, kv, state.kv.length, lay)
    decoder = decoder_from_engine(engine.root, engine.manifest)
    if decoder.dims.qk_norm or decoder.head is not None:
        raise SystemExit("masked_attention.py runs the plain decoder (no q/k norm, no decision head): "
                         f"{args.engine} has one; measure an engine exported without")
    modules = {form: SkippingDecoder(decoder, form).eval() for form in FORMS}
    torch_diff, reference = parity_torch(decoder, modules, dense_feed, skip_feed)
    print("PyTorch, max |d log-prob| against dense:", torch_diff, flush=True)

    work = Path(tempfile.mkdtemp(prefix="onepass-masked-"))
    paths = {"dense": engine.root / engine.manifest.graph}
    for form, module in modules.items():
        t = time.time()
        paths[form] = work / f"{form.replace(' ', '_')}.onnx"
        export(module, ordered(skip_feed, ["input_ids", "position_ids", *LAYOUT]), paths[form])
        print(f"exported {form} in {time.time() - t:.0f} s", flush=True)
    config = engine.backend.config
    graphs = {(name, be): Graph(path, be, config) for be in ("openvino-cpu", "onnxruntime")
              for name, path in paths.items()}
    feed_of = {name: dense_feed if name == "dense" else skip_feed for name in paths}
    onnx_diff = {f"{name} on {be}": float(np.abs(g(feed_of[name]) - reference).max())
                 for (name, be), g in graphs.items()}
    print("ONNX, max |d log-prob| against PyTorch dense:", onnx_diff, flush=True)
    wrong = {k: v for k, v in {**torch_diff, **onnx_diff}.items() if (v > TOLERANCE) != k.startswith("negative")}
    if wrong:
        raise SystemExit(f"not exact (or the negative control too close), tolerance {TOLERANCE:g}: {wrong}")
    runs = {f"{name} on {be}": (lambda g=g, f=feed_of[name]: g(f)) for (name, be), g in graphs.items()}
    times = interleaved(runs, args.rounds)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    profile = {}
    for name, path in paths.items():  # OpenVINO's own counters, a second compile with them on
        g = Graph(path, "openvino-cpu", config, profile=True)
        g(feed_of[name])
        per = [(g(feed_of[name]), g.op_ms())[1] for _ in range(3)]
        profile[name] = {k: statistics.median(p.get(k, 0.0) for p in per) for k in per[0]}
    result = {"cpu": cpu_name(), "threads": THREADS, "engine": engine.name, "packed_tokens": batch.num_tokens,
              "state_tokens": state.kv.length, "questions": len(batch.option_readouts),
              "shared_tokens": len(lay["global_index"]), "blocks": list(lay["block_index"].shape),
              "attention_entries": entries(batch.num_tokens, state.kv.length, lay), "tolerance": TOLERANCE,
              "torch_max_abs_diff": torch_diff, "onnx_max_abs_diff": onnx_diff, "warm_ms_median": med,
              "warm_ms": {k: [t * 1e3 for t in v] for k, v in times.items()}, "openvino_op_ms": profile,
              "rounds": args.rounds, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result, args) + "\n")
    print(markdown(result, args))
    return 0


def markdown(r: dict, args) -> str:
    ent = r["attention_entries"]
    lines = [f"# Skipping the masked attention ({r['engine']}, {r['cpu']}, {r['threads']} threads, {r['date']})", "",
             f"The README ticket's {r['questions']} questions over a {r['state_tokens']}-token state: "
             f"{r['packed_tokens']} packed tokens, {r['shared_tokens']} of them shared, the private ones in "
             f"{r['blocks'][0]} blocks of {r['blocks'][1]} slots. Every graph fed the same way (raw inference, not the "
             f"engine's pass), {r['rounds']} interleaved rounds after a warm-up, medians.", "",
             "| form | attention entries | of dense | PyTorch max abs d log-prob | OpenVINO ms | ONNX Runtime ms |",
             "|---|---|---|---|---|---|"]
    for form in ("dense", *FORMS):
        diff = "reference" if form == "dense" else f"{r['torch_max_abs_diff'][form]:.1e}"
        lines.append(f"| {form} | {ent[form]:,} | {ent[form] / ent['dense']:.0%} | {diff} | "
                     f"{r['warm_ms_median'][f'{form} on openvino-cpu']:.0f} | "
                     f"{r['warm_ms_median'][f'{form} on onnxruntime']:.0f} |")
    neg = r["torch_max_abs_diff"]["negative control (shared tokens hidden)"]
    worst = max(r["onnx_max_abs_diff"].values())
    lines += ["", f"Negative control (the shared tokens hidden): max abs d log-prob {neg:.2f} (must exceed "
              f"{r['tolerance']:.0e}). Every ONNX graph on both backends against the PyTorch dense pass: at most "
              f"{worst:.1e}.", "", "OpenVINO's own counters (ms per pass, medians of 3; the kinds over 2% of a pass):",
              "", "| operation | " + " | ".join(r["openvino_op_ms"]) + " |",
              "|---|" + "---|" * len(r["openvino_op_ms"])]
    kinds = sorted({k for p in r["openvino_op_ms"].values() for k, ms in p.items() if ms / sum(p.values()) >= 0.02},
                   key=lambda k: -r["openvino_op_ms"]["dense"].get(k, 0.0))
    for kind in kinds:
        lines.append(f"| {kind} | " + " | ".join(f"{p.get(kind, 0.0):.1f}" for p in r["openvino_op_ms"].values())
                     + " |")
    lines.append("| all | " + " | ".join(f"{sum(p.values()):.1f}" for p in r["openvino_op_ms"].values()) + " |")
    lines += ["", f"    python benchmarks/masked_attention.py --engine {args.engine} --rounds {args.rounds}"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
