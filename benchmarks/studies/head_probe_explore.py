"""Exploration: is there cross-task answer signal elsewhere? Mid-layer hidden states and content-free priors.

    python benchmarks/studies/head_probe_explore.py --engine engines/smollm2

Same a..g BIG-bench examples and task split as benchmarks/decision_head.py; everything is
measured by 5-fold leave-tasks-out cross-validation on the train+val tasks only (the test
tasks are not touched). Compares the zero-shot read-out with
* heads (linear, and MLP + RLCD) over the normalised residual stream after layers 6..26 at
  the option's last read-out row (the exported head reads the final layer);
* linear mixes of the option's mean/summed log-likelihood with its content-free prior
  (state "N/A") and 1/length.
Features are cached in the onepass cache. Writes benchmarks/studies/results/head_probe_explore.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from onepass.calibration.data import bigbench as bb
from onepass.calibration.heads import head as hd
from onepass.calibration.heads.features import OptionFeatures, example_pass, extract, last_readouts
from onepass.export.model_source import cache_root
from onepass.runtime.backends.torch_backend import decoder_from_engine
from onepass.runtime.core import manifest as mf
from onepass.runtime.core.prompt import PromptEncoder

RESULTS = Path(__file__).parent / "results"
LAYERS = (6, 10, 14, 18, 22, 26)


@torch.inference_mode()
def mid_layer_features(decoder, encoder, exs) -> dict:
    """RMS-normalised residual stream after each of LAYERS at every option's last read-out row."""
    d = decoder.dims
    captured = {}
    hooks = [decoder.blocks[layer].register_forward_hook(
        lambda mod, inp, out, layer=layer: captured.__setitem__(layer, out[0])) for layer in LAYERS]
    empty = [torch.zeros(d.num_kv_heads, 0, d.head_dim) for _ in range(2 * d.num_layers)]
    out = {layer: [] for layer in LAYERS}
    for e in exs:
        b, _, _, _ = example_pass(decoder, encoder, e, empty)
        rows = b.readout_index[last_readouts(b)]
        for layer in LAYERS:
            x = captured[layer][rows]
            out[layer].append((x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)).numpy())
    for h in hooks:
        h.remove()
    return {f"L{layer}": np.concatenate(v) for layer, v in out.items()}


def linear_mix_cv(f: OptionFeatures, prior: OptionFeatures, dev_tasks: list, folds: int = 5) -> dict:
    """CV accuracy / NLL of softmax(w . [mean, prior mean, sum, prior sum, 1/len]) fitted by cross-entropy."""
    x = np.stack([f.mean_logprob(), prior.mean_logprob(), f.logprob, prior.logprob, 1.0 / f.length], 1)
    tasks = sorted(dev_tasks)
    np.random.default_rng(0).shuffle(tasks)
    out = {}
    for name, cols in (("zero-shot mean", [0]), ("mean - prior (no fit)", None), ("lin[mean, prior]", [0, 1]),
                       ("lin[all 5]", [0, 1, 2, 3, 4])):
        accs, nlls = [], []
        for k in range(folds):
            held = tasks[k::folds]
            train = [i for i in range(f.num_questions) if f.task[i] in dev_tasks and f.task[i] not in held]
            test = [i for i in range(f.num_questions) if f.task[i] in held]
            if cols is None:
                s = x[:, 0] - x[:, 1]
            elif cols == [0]:
                s = x[:, 0]
            else:
                s = x[:, cols] @ _fit_linear(x[:, cols], f, train)
            accs.append(np.mean([s[f.offsets[i]:f.offsets[i + 1]].argmax() == f.label[i] for i in test]))
            nlls.append(np.mean([_nll(s[f.offsets[i]:f.offsets[i + 1]], f.label[i]) for i in test]))
        out[name] = {"accuracy": float(np.mean(accs)), "nll": float(np.mean(nlls))}
    return out


def _nll(s: np.ndarray, y: int) -> float:
    s = s - s.max()
    return float(np.log(np.exp(s).sum()) - s[y])


def _fit_linear(x: np.ndarray, f: OptionFeatures, rows: list) -> np.ndarray:
    w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    xt = torch.from_numpy(x)
    opt = torch.optim.LBFGS([w], max_iter=200)
    with torch.no_grad():
        w[0] = 1.0

    def closure():
        opt.zero_grad()
        s = xt @ w
        loss = torch.stack([torch.nn.functional.cross_entropy(s[f.offsets[i]:f.offsets[i + 1]][None],
                                                              torch.tensor([int(f.label[i])])) for i in rows]).mean()
        loss = loss + 1e-3 * (w ** 2).sum()
        loss.backward()
        return loss
    opt.step(closure)
    return w.detach().numpy()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="engines/smollm2")
    ap.add_argument("--per-task", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(2)
    exs, split = bb.training_examples(bb.fetch(cache_root()), args.per_task, args.seed)
    dev_tasks = split["train"] + split["val"]
    engine = Path(args.engine)
    manifest = mf.load(engine, verify=False)
    encoder = PromptEncoder(str(engine / manifest.tokenizer), manifest.prompt)
    cache = cache_root()
    tag = f"{args.per_task}-{args.seed}"
    decoder = None

    def get_decoder():
        nonlocal decoder
        decoder = decoder or decoder_from_engine(engine, manifest)
        return decoder

    final_path, prior_path, mid_path = (cache / f"bigbench-{k}features-{tag}.npz" for k in ("", "prior-", "mid-"))
    if not final_path.exists():
        extract(get_decoder(), encoder, exs).save(final_path)
    if not prior_path.exists():
        null = [bb.Example(e.task, e.subtask, manifest.prompt.null_state, e.question, e.label) for e in exs]
        extract(get_decoder(), encoder, null).save(prior_path)
    if not mid_path.exists():
        np.savez(mid_path, **mid_layer_features(get_decoder(), encoder, exs))
    final, prior, mid = OptionFeatures.load(final_path), OptionFeatures.load(prior_path), np.load(mid_path)
    dev = np.isin(final.task, dev_tasks)
    report = {"cv_folds": 5, "dev_tasks": len(dev_tasks), "dev_questions": int(dev.sum()),
              "priors": linear_mix_cv(final, prior, dev_tasks), "layers": {}}
    configs = {"linear": hd.HeadConfig(width=0, rlcd_weight=0.0, lr=1e-3, weight_decay=1.0, epochs=8),
               "MLP + RLCD": hd.HeadConfig(width=16, rlcd_weight=1.0, lr=1e-3, weight_decay=0.01, epochs=8)}
    for key in [f"L{layer}" for layer in LAYERS] + ["final"]:
        hidden = final.hidden if key == "final" else mid[key].astype(np.float32)
        feats = replace(final, hidden=hidden).select(dev)
        report["layers"][key] = {name: {k: v for k, v in hd.cross_validate(feats, cfg).items() if k != "curve"}
                                 for name, cfg in configs.items()}
        print(key, report["layers"][key], file=sys.stderr, flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "head_probe_explore.json").write_text(json.dumps(report, indent=2) + "\n")
    zs = report["priors"]["zero-shot mean"]
    lines = ["# Where is cross-task answer signal? (BIG-bench a..g, leave-tasks-out CV on train+val tasks)", "",
             f"{report['dev_questions']} questions from {report['dev_tasks']} tasks, 5 task folds. Zero-shot mean "
             f"read-out: accuracy {zs['accuracy']:.3f}, NLL {zs['nll']:.3f}.", "",
             "| features | linear acc | linear NLL | MLP+RLCD acc | MLP+RLCD NLL |", "|---|---|---|---|---|"]
    for key, v in report["layers"].items():
        lines.append(f"| hidden after {key} | {v['linear']['accuracy']:.3f} | {v['linear']['nll']:.3f} | "
                     f"{v['MLP + RLCD']['accuracy']:.3f} | {v['MLP + RLCD']['nll']:.3f} |")
    lines += ["", "| option score from log-likelihoods | CV acc | CV NLL |", "|---|---|---|"]
    lines += [f"| {k} | {v['accuracy']:.3f} | {v['nll']:.3f} |" for k, v in report["priors"].items()]
    (RESULTS / "head_probe_explore.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
