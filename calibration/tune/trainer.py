"""`onepass tune`: fine-tune the decoder on labelled decisions through the runtime's own packed tree.

What is trained is what is served: a state is prefilled once, all the questions of the rows
that share it (with all their options) go through one tree-masked pass of the export decoder
(:class:`onepass.runtime.backends.torch_decoder.PackedDecoder`, built by :func:`onepass.runtime.core.tree.pack` from
the engine's own prompt encoder), and an option's score is the same exact chain-rule
log-likelihood and read-out (``mean`` or ``sum``) the runtime soft-maxes. The loss is
cross-entropy over each question's options (or against a teacher distribution) plus the RLCD
term (:mod:`onepass.calibration.scoring.rlcd`). LoRA adapters (peft) on the attention and MLP
projections, or every weight (``method="full"``), of all or only the top blocks.

The result is an ordinary engine: the adapter is merged into the weights and exported through
the same export path (golden file, self-check, manifest with the tuning recorded).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ...runtime.backends.batch import causal
from ...runtime.core import manifest as mf
from ...runtime.core.errors import LimitExceeded, OnepassError
from ...runtime.core.prompt import PromptEncoder
from ...runtime.core.questions import Score
from ...runtime.core.tree import pack
from ..data.rows import TuneRow
from ..scoring.rlcd import cross_entropy, rlcd_loss
from .config import TuneConfig

class NothingLearned(OnepassError):
    """Tuning never beat the base engine on the held-out rows: no engine is written unless asked (keep_base)."""


@dataclass
class Chunk:
    """Questions about one state that go through one packed pass: state ids, encoded questions, rows."""

    state_ids: list
    encoded: list
    rows: list

    @property
    def size(self) -> int:
        """Number of questions."""
        return len(self.rows)


def encode_groups(groups: list[list[TuneRow]], encoder: PromptEncoder, config: TuneConfig,
                  limits: mf.Limits) -> list[Chunk]:
    """Token ids of every state group, split into chunks of at most ``batch_questions`` questions.

    A state over the limits, or an over-large question, is an error naming the row (never truncated).
    """
    max_state = min(config.max_state_tokens, limits.max_state_tokens)
    chunks = []
    for group in groups:
        ids = encoder.state(group[0].state)
        if len(ids) > max_state:
            raise LimitExceeded(f"{group[0].where}: the state is {len(ids)} tokens; tune allows at most {max_state} "
                                "(--max-state-tokens, and the engine's limit). Shorten the state", "state")
        encoded = []
        for row in group:
            if len(encoder.options(row.question)) > limits.max_options:
                raise LimitExceeded(f"{row.where}: {len(encoder.options(row.question))} options; this engine "
                                    f"allows at most {limits.max_options}", "question.criteria")
            encoded.append(encoder.question(row.question))
        for start in range(0, len(group), config.batch_questions):
            part = encoded[start:start + config.batch_questions]
            if pack(part, len(ids)).num_tokens > limits.max_packed_tokens:
                raise LimitExceeded(f"{group[start].where}: the questions pack into more than "
                                    f"{limits.max_packed_tokens} tokens", "question")
            chunks.append(Chunk(ids, part, group[start:start + config.batch_questions]))
    return chunks


TRUNK_CACHE_BYTES = 4 << 30  # cached hidden states kept at most (~1,800 states of 1,024 tokens for SmolLM2)


class PackedScorer:
    """The served computation as a differentiable function: option scores of a chunk's questions.

    With ``frozen`` > 0 the lower ``frozen`` blocks are not trained (only the top blocks carry adapters), so what
    they compute for a chunk never changes: the hidden states entering block ``frozen`` (the state's and the packed
    tokens') are computed once per chunk, without gradient, and every later step and evaluation runs only the top
    blocks from them. The scores are the same as running every block (``tests/test_tune.py``); a trainable
    parameter in a frozen block is refused, since its cache would go stale. Past ``cache_budget`` bytes the further
    chunks' lower blocks run again at each use (slower, the same scores) instead of filling the memory.

    With ``state_weights`` (a context manager factory under which the decoder computes with the base weights, e.g.
    peft's ``disable_adapter``) the state's K/V of every block are the base weights', computed once per chunk
    without gradient: the trained parameters act on the question and option tokens only, as they would in one engine
    whose state cache is shared by several tuned tasks; each step then runs the packed tokens alone.
    """

    def __init__(self, decoder, readout: str, device: torch.device, bf16: bool, frozen: int = 0,
                 cache_budget: int = TRUNK_CACHE_BYTES, state_weights=None):
        if readout not in ("mean", "sum"):
            raise OnepassError(f"tune trains the 'mean' or 'sum' read-out; this engine's read-out is {readout!r}. "
                               "Export the base engine with --readout mean")
        dims = decoder.dims
        if not 0 <= frozen < dims.num_layers:
            raise ValueError(f"frozen must be in 0..{dims.num_layers - 1}, got {frozen}")
        lower = [decoder.embed, *(p for b in decoder.blocks[:frozen] for p in b.parameters())] if frozen else []
        if any(p.requires_grad for p in lower):
            raise ValueError(f"the lower {frozen} blocks (or the embedding) have trainable parameters: their "
                             "outputs cannot be cached")
        self.decoder, self.readout, self.device, self.bf16, self.frozen = decoder, readout, device, bf16, frozen
        if state_weights is not None and decoder.embed.requires_grad:
            raise ValueError("a state computed with the base weights needs a frozen embedding (LoRA or top blocks)")
        self.state_weights = state_weights
        self.empty = [torch.zeros(dims.num_kv_heads, 0, dims.head_dim, device=device)
                      for _ in range(2 * dims.num_layers)]
        # id(chunk) -> (chunk, packed batch, state batch, state x, packed x entering block `frozen`, the state's K/V)
        self.trunks: dict[int, tuple] = {}
        self.cached_bytes, self.cache_budget = 0, cache_budget

    def _tensor(self, a):
        return torch.from_numpy(a).to(self.device)

    def _blocks(self, x, batch, past, blocks: range):
        t = self._tensor
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            tables = self.decoder.attention_tables(t(batch.position_ids), t(batch.tree_mask), past[0].shape[1])
            return self.decoder.run_blocks(x, tables, past, blocks)

    def _trunk(self, chunk: Chunk) -> tuple:
        """(packed batch, state batch, state x, packed x at the entry of block ``frozen``, the state's K/V of every
        block or None): computed once per chunk where nothing trained enters them (the state x is None then)."""
        key = id(chunk)
        if key in self.trunks:
            return self.trunks[key][1:]
        batch, state = pack(chunk.encoded, len(chunk.state_ids)), causal(chunk.state_ids, 0)
        x_state = self.decoder.embed[self._tensor(state.input_ids)]
        x_packed = self.decoder.embed[self._tensor(batch.input_ids)]
        if not self.frozen and self.state_weights is None:
            return batch, state, x_state, x_packed, None  # the embedding may be trained: nothing is cached
        state_past = None
        with torch.no_grad():
            if self.state_weights is not None:
                with self.state_weights():
                    _, state_past = self._blocks(x_state, state, self.empty, range(self.decoder.dims.num_layers))
                past, x_state = state_past[:2 * self.frozen], None
            if self.frozen:
                lower = range(self.frozen)
                if state_past is None:
                    x_state, past = self._blocks(x_state, state, self.empty, lower)
                x_packed, _ = self._blocks(x_packed, batch, past, lower)
        kept = [t for t in (x_state, x_packed, *(state_past or [])) if t is not None]
        size = sum(t.numel() * t.element_size() for t in kept)
        if self.cached_bytes + size > self.cache_budget:  # past the budget: computed again at each use
            return batch, state, x_state, x_packed.detach(), state_past
        self.cached_bytes += size
        self.trunks[key] = (chunk, batch, state, None if x_state is None else x_state.detach(), x_packed.detach(),
                            state_past)  # chunk: keeps its id
        return self.trunks[key][1:]

    def scores(self, chunk: Chunk) -> list[torch.Tensor]:
        """Per question, its [K] option scores: prefill, one packed pass, chain-rule sums, read-out."""
        return self._outputs(chunk, hidden=False)[0]

    def scores_and_features(self, chunk: Chunk, depths=()) -> list[tuple]:
        """Per question, (its [K] option scores, what a decision head reads of it: (the final-normed hidden state
        after each option [K, d] float32, each option's mean log-likelihood [K] float64), numpy), from one pass.
        With ``depths`` (block counts, each above the frozen blocks and below the decoder's), a third item: per depth
        the same pair read after that many blocks (the final norm and the language-model head applied to the residual
        stream there, as an engine cut at that depth computes them)."""
        stops = sorted({int(d) for d in depths})
        layers = self.decoder.dims.num_layers
        low = 1 if self.state_weights is not None else self.frozen + 1  # a task's: the state's every block is kept
        if any(not low <= d < layers for d in stops):
            raise ValueError(f"depths must be in {low}..{layers - 1} (above the frozen blocks, below the "
                             f"decoder's {layers}); got {stops}")
        reads = self._reads(chunk, stops)
        out = []
        for q, tokens in enumerate(chunk.encoded):
            lengths = np.array([len(o) for o in tokens.options], dtype=np.float64)
            pairs = {}
            for depth, (scores, hidden) in reads.items():
                s = scores[q].detach().double().cpu().numpy()
                pairs[depth] = (hidden[q].detach().float().cpu().numpy(), s if self.readout == "mean" else s / lengths)
            full = pairs.pop(layers)
            out.append((reads[layers][0][q], full) + ((pairs,) if stops else ()))
        return out

    def _outputs(self, chunk: Chunk, hidden: bool) -> tuple[list, list]:
        """(per question its [K] option scores; with ``hidden``, per question the hidden states at its options' last
        read-out rows [K, d], else nothing)."""
        return self._reads(chunk, (), hidden)[self.decoder.dims.num_layers]

    def _reads(self, chunk: Chunk, stops, hidden: bool = True) -> dict:
        """Block count -> what :meth:`_outputs` returns read after that many blocks, for each of ``stops`` and the
        full depth, from one pass (the blocks above a stop continue from its residual stream)."""
        batch, state, x_state, x_packed, state_past = self._trunk(chunk)
        layers = self.decoder.dims.num_layers
        top = range(self.frozen, layers)
        if state_past is None:
            _, presents = self._blocks(x_state, state, self.empty, top)  # the state's K/V of the top blocks, with gradient
        else:
            presents = state_past[2 * self.frozen:]  # the base weights' state K/V: no gradient, computed once
        reads, x, start = {}, x_packed, self.frozen
        if stops and stops[0] <= self.frozen:  # a read inside the frozen blocks (a task's: its state K/V are all kept)
            x, start, presents = self.decoder.embed[self._tensor(batch.input_ids)], 0, state_past
        first = start  # the block presents[0:2] is of
        for stop in [*stops, layers]:
            past = presents[2 * (start - first):2 * (stop - first)]
            x, _ = self._blocks(x, batch, past, range(start, stop))
            reads[stop] = self._read(chunk, batch, x, hidden)
            start = stop
        return reads

    def _read(self, chunk: Chunk, batch, x, hidden: bool) -> tuple[list, list]:
        """The read-out of residual stream ``x``: per question its [K] option scores and, with ``hidden``, the
        final-normed hidden states at its options' last read-out rows."""
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            h, target = self.decoder.final(x, self._tensor(batch.readout_index), self._tensor(batch.readout_target))
        target = target.float()  # [R] log-probs of the read-out targets
        out, states = [], []
        for tokens, readouts in zip(chunk.encoded, batch.option_readouts):
            sums = torch.stack([target[torch.from_numpy(r).to(self.device)].sum() for r in readouts])  # [K]
            if self.readout == "mean":
                sums = sums / torch.tensor([len(o) for o in tokens.options], dtype=torch.float32, device=self.device)
            out.append(sums)
            if hidden:
                states.append(h[torch.tensor([int(r[-1]) for r in readouts], device=self.device)])
        return out, states


def _target(row: TuneRow, device) -> torch.Tensor:
    if isinstance(row.target, int):
        return torch.tensor(row.target, device=device)
    return torch.tensor(row.target, dtype=torch.float32, device=device)


def question_loss(scores: torch.Tensor, row: TuneRow, config: TuneConfig, generator) -> torch.Tensor:
    """Cross-entropy (label or teacher distribution) plus the weighted RLCD term for one question."""
    target = _target(row, scores.device)
    loss = config.ce_weight * cross_entropy(scores, target)
    if config.rlcd_weight:
        loss = loss + config.rlcd_weight * rlcd_loss(scores.cpu(), target.cpu(), config.group, config.sigma,
                                                     ordinal=isinstance(row.question, Score),
                                                     generator=generator).to(scores.device)
    return loss


def evaluate(scorer: PackedScorer, chunks: list[Chunk]) -> dict:
    """Held-out accuracy and NLL (of the label, or cross-entropy against a teacher) of the current weights."""
    nll, hits, n = 0.0, 0, 0
    with torch.no_grad():
        for chunk in chunks:
            for s, row in zip(scorer.scores(chunk), chunk.rows):
                nll += float(cross_entropy(s.double().cpu(), _target(row, "cpu")))
                hits += int(int(s.argmax()) == row.label)
                n += 1
    return {"nll": nll / n, "accuracy": hits / n, "questions": n}


def _trained(config: dict) -> dict:
    """The settings a checkpoint's weights depend on: what is written of them afterwards (``write``, ``keep_base``)
    may change between a run and its ``--resume``."""
    return {k: v for k, v in config.items() if k not in ("write", "keep_base")}


@dataclass
class Progress:
    """Where a run stands: written to the checkpoint each epoch, restored by ``--resume``."""

    epoch: int = 0
    step: int = 0
    rows_seen: int = 0
    best_nll: float = math.inf
    bad_evals: int = 0
    history: list = dataclasses.field(default_factory=list)
    seconds: float = 0.0


class Trainer:
    """The optimisation loop: minibatches of whole states, held-out evaluation, early stopping, checkpoints."""

    def __init__(self, scorer: PackedScorer, params: list, config: TuneConfig, train: list[Chunk],
                 held: list[Chunk], checkpoint: Path, fingerprint: dict, log=print):
        self.scorer, self.params, self.config, self.fingerprint = scorer, params, config, fingerprint
        self.train_chunks, self.held = train, held
        self.checkpoint, self.log = checkpoint, log
        self.opt = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=config.weight_decay)
        self.gen = torch.Generator().manual_seed(config.seed)
        self.progress = Progress()
        self.best = self._snapshot()

    def _snapshot(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.params]

    def _restore(self, values: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for p, v in zip(self.params, values):
                p.copy_(v)

    def save(self) -> None:
        """The checkpoint, atomically: the last checkpoint stays usable whatever interrupts the run."""
        tmp = self.checkpoint.with_suffix(".tmp")
        torch.save({"params": self._snapshot(), "best": self.best, "opt": self.opt.state_dict(),
                    "progress": dataclasses.asdict(self.progress), "config": dataclasses.asdict(self.config),
                    "fingerprint": self.fingerprint, "generator": self.gen.get_state()}, tmp)
        os.replace(tmp, self.checkpoint)

    def resume(self) -> None:
        """Continue from the checkpoint; refused when it belongs to another configuration or other data."""
        if not self.checkpoint.is_file():
            raise OnepassError(f"--resume: no checkpoint at {self.checkpoint}; run without --resume")
        blob = torch.load(self.checkpoint, weights_only=False)
        if (_trained(blob["config"]) != _trained(dataclasses.asdict(self.config))
                or blob.get("fingerprint") != self.fingerprint):
            raise OnepassError(f"--resume: {self.checkpoint} belongs to another configuration or other data; "
                               "run without --resume to start again")
        self._restore(blob["params"])
        self.best = blob["best"]
        self.opt.load_state_dict(blob["opt"])
        self.progress = Progress(**blob["progress"])
        self.gen.set_state(blob["generator"])

    def evaluate(self) -> dict:
        """Held-out metrics now; keeps the best weights and counts evaluations without improvement. Without held-out
        chunks (a cross-validation fold, or the final run after one) nothing is measured: the latest weights are
        the ones kept."""
        p = self.progress
        if not self.held:
            p.history.append({"epoch": p.epoch, "step": p.step})
            self.best = self._snapshot()
            return {}
        m = evaluate(self.scorer, self.held)
        p.history.append({"epoch": p.epoch, "step": p.step, **m})
        if m["nll"] < p.best_nll - 1e-4:
            p.best_nll, p.bad_evals, self.best = m["nll"], 0, self._snapshot()
        else:
            p.bad_evals += 1
        return m

    def _step(self, chunks: list[Chunk]) -> float:
        questions = sum(c.size for c in chunks)
        total = 0.0
        for chunk in chunks:
            losses = [question_loss(s, r, self.config, self.gen) for s, r in zip(self.scorer.scores(chunk), chunk.rows)]
            loss = torch.stack(losses).sum() / questions
            loss.backward()
            total += loss.item()
        if not math.isfinite(total):
            raise OnepassError(f"the loss is not finite ({total}) at step {self.progress.step}; lower --lr "
                               "(or switch off bf16)")
        warm = min(1.0, (self.progress.step + 1) / 10)  # linear warm-up over 10 steps
        for g in self.opt.param_groups:
            g["lr"] = self.config.learning_rate * warm
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.progress.step += 1
        self.progress.rows_seen += questions
        return total

    def _batches(self, epoch: int) -> list[list[Chunk]]:
        order = np.random.default_rng([self.config.seed, epoch]).permutation(len(self.train_chunks))
        batches, current, size = [], [], 0
        for i in order:
            current.append(self.train_chunks[i])
            size += self.train_chunks[i].size
            if size >= self.config.batch_questions:
                batches.append(current)
                current, size = [], 0
        return batches + ([current] if current else [])

    def _stop(self, started: float) -> bool:
        c, p = self.config, self.progress
        late = c.max_minutes is not None and p.seconds + time.perf_counter() - started > 60 * c.max_minutes
        spent = c.max_steps is not None and p.step >= c.max_steps
        return late or spent or p.bad_evals >= c.patience

    def run(self) -> Progress:
        """Train until the epochs, the time budget or the patience run out; the best weights are kept."""
        from tqdm import tqdm

        c, p = self.config, self.progress
        if not p.history:
            before = self.evaluate()
            if before:
                self.log(f"held-out before tuning: accuracy {before['accuracy']:.3f}  NLL {before['nll']:.4f} "
                         f"({before['questions']} questions)")
        per_epoch = len(self._batches(0))
        total = c.epochs * per_epoch if c.max_steps is None else min(c.epochs * per_epoch, c.max_steps)
        bar = tqdm(total=total, initial=min(p.step, total), unit="step", dynamic_ncols=True)
        started, stop = time.perf_counter(), False
        try:
            while p.epoch < c.epochs and not stop:
                for i, batch in enumerate(self._batches(p.epoch)):
                    loss = self._step(batch)
                    elapsed = p.seconds + time.perf_counter() - started
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss:.3f}", rows_s=f"{p.rows_seen / max(elapsed, 1e-9):.2f}")
                    if c.eval_every and p.step % c.eval_every == 0 and i + 1 < per_epoch:
                        self._report(self.evaluate(), bar)
                    if self._stop(started):
                        stop = True
                        break
                if not stop:
                    p.epoch += 1
                self._report(self.evaluate(), bar)
                p.seconds += time.perf_counter() - started
                started = time.perf_counter()
                self.save()
                stop = stop or self._stop(started)
        except KeyboardInterrupt:
            bar.close()
            raise OnepassError(f"interrupted; the last checkpoint ({self.checkpoint}) is intact: run the same "
                               "command with --resume to continue") from None
        bar.close()
        self._restore(self.best)
        return p

    def _report(self, m: dict, bar) -> None:
        if not m:
            return
        bar.write(f"epoch {self.progress.epoch} step {self.progress.step}: held-out accuracy {m['accuracy']:.3f}  "
                  f"NLL {m['nll']:.4f}")
