"""What a `onepass tune` run is asked for (``TuneConfig``) and what it chooses for the settings left open
(:func:`resolved`, :func:`head_depths`): numbers and their checks only, so that the command's flags read their
defaults from here without importing torch."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

METHODS = ("lora", "full", "head")  # head: a decision head over the frozen decoder (calibration/heads/head.py)
WRITES = ("best", "tuned")  # what tune writes: the best candidate, or the tuned weights whatever the candidates say


@dataclass(frozen=True)
class TuneConfig:
    """Every hyper-parameter of a tuning run (recorded in the manifest)."""

    method: str = "lora"
    rank: int = 16  # LoRA rank
    alpha: float | None = None  # LoRA alpha (None: 2 * rank)
    train_blocks: int | None = None  # only the top N decoder blocks are trained (0: all; None: chosen, see resolved)
    lr: float | None = None  # None: chosen (see resolved)
    weight_decay: float = 0.0
    epochs: int | None = None  # None: chosen (see resolved)
    max_minutes: float | None = None  # stop (keeping the best held-out weights) after this long
    max_steps: int | None = None  # stop after this many optimiser steps (a reproducible budget, unlike minutes)
    batch_questions: int = 8  # questions per optimiser step (whole states)
    rlcd_weight: float = 0.5
    ce_weight: float = 1.0
    group: int = 16  # RLCD samples per question
    sigma: float = 0.5  # RLCD perturbation scale
    holdout: float = 0.2  # share of states held out (early stopping and the report)
    patience: int | None = None  # evaluations without held-out NLL improvement before stopping (None: see resolved)
    eval_every: int | None = None  # optimiser steps between held-out evaluations (None: each epoch)
    max_state_tokens: int = 1024  # longer states are refused (memory of the backward pass)
    keep_base: bool = False  # write the engine even when tuning never beat step 0 (its weights are then the base's)
    write: str = "best"  # "best": the best held-out candidate (calibration/tune/candidates.py); "tuned": the tuned weights
    head_candidate: bool = True  # a decision head over the untuned engine is a candidate (write="best", method lora)
    # with a head candidate, fewer rows than this train no LoRA run: at 50 rows it never beat the head on the unseen
    # states of five data sets and cost 3-4 runs; at 200 the head alone reaches every data set's 200-row figure of
    # every-block LoRA in seconds, where LoRA took 7-14 minutes (benchmarks/results/tune_user.md);
    # 0: LoRA always runs
    lora_min_rows: int = 300
    # the block counts a decision head is also tried at (None: ``DEPTH_FRACTIONS`` of the model's blocks; (): the
    # full depth only); a head chosen at one is written into an engine that runs only those blocks
    head_depths: tuple | None = None
    seed: int = 0
    bf16: bool | None = None  # autocast; None: on CUDA only (slower than fp32 on the measured CPUs)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.write not in WRITES:
            raise ValueError(f"write must be one of {WRITES}, got {self.write!r}")
        positive = {"rank": self.rank, "epochs": 1 if self.epochs is None else self.epochs,
                    "batch_questions": self.batch_questions, "group": self.group,
                    "patience": 1 if self.patience is None else self.patience,
                    "max_state_tokens": self.max_state_tokens}
        for name, value in positive.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.head_depths is not None and any(not isinstance(d, int) or d < 1 for d in self.head_depths):
            raise ValueError(f"head_depths must be positive block counts, got {self.head_depths!r}")
        if not isinstance(self.lora_min_rows, int) or self.lora_min_rows < 0:
            raise ValueError(f"lora_min_rows must be an integer >= 0, got {self.lora_min_rows!r}")
        if self.train_blocks is not None and (not isinstance(self.train_blocks, int) or self.train_blocks < 0):
            raise ValueError(f"train_blocks must be >= 0 (0: every block), got {self.train_blocks!r}")
        if self.max_steps is not None and (not isinstance(self.max_steps, int) or self.max_steps < 1):
            raise ValueError(f"max_steps must be a positive integer, got {self.max_steps!r}")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise ValueError(f"max_minutes must be > 0, got {self.max_minutes}")
        if self.rlcd_weight < 0 or self.ce_weight < 0 or self.rlcd_weight + self.ce_weight == 0:
            raise ValueError("ce_weight and rlcd_weight must be >= 0 and not both 0")
        if not self.sigma > 0:
            raise ValueError(f"sigma must be > 0, got {self.sigma}")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")

    @property
    def learning_rate(self) -> float:
        """The learning rate in force (of a resolved config; unresolved: the fallback of every block's LoRA)."""
        return self.lr if self.lr is not None else (EVERY_BLOCK_LR if self.method == "lora" else 2e-5)


# What `tune` chooses for the settings left open, from the number of training rows (measured in
# benchmarks/results/tune_user.md). Fewer than MANY_ROWS: LoRA on the top AUTO_BLOCKS blocks only (the lower ones then
# run once per state, PackedScorer: each of the 4 runs of a cross-validated choice costs little), a learning rate suited
# to so few adapted blocks, and enough epochs that a few dozen rows still get MIN_STEPS optimiser steps past the 10-step
# warm-up. From MANY_ROWS: every block (lr 3e-4). The top blocks alone learn a topic (BBC, 200 rows: 0.96, 175 s) but
# not sentiment (Rotten Tomatoes, 200 rows: held-out NLL 0.68 with the top 4 blocks, 0.69 with the top 4 at lr 3e-4,
# 0.67 with the top 8, 0.66 with the top 15, 0.55 with every block; on the test rows 0.63 top 4, 0.79 every block),
# so the default is every block and `--train-blocks 4` the fast choice where the task is lexical.
AUTO_BLOCKS = 4
AUTO_LR = 1e-3  # LoRA on up to 2 * AUTO_BLOCKS blocks
EVERY_BLOCK_LR = 3e-4  # LoRA on more
MANY_ROWS = 80  # training rows: 100 rows with 20% held out
MIN_STEPS, MAX_EPOCHS, DEFAULT_EPOCHS = 30, 12, 3
# Early stopping on fewer held-out questions than this chooses on noise (10 questions: one answer moves the NLL by
# more than the epochs differ), so it stops nothing: every epoch runs and the best held-out snapshot is still kept.
MIN_HELD_FOR_PATIENCE, DEFAULT_PATIENCE = 50, 2


# The depths a decision head is tried at, as shares of the model's blocks: where the heads of 50 and 200 rows of five
# data sets came within noise of the full depth's (benchmarks/results/depth_probe.md). Each costs the choice one more
# head fitted per fold; the pass reads every depth at once.
DEPTH_FRACTIONS = (0.4, 0.5, 0.6, 0.8)


def head_depths(config: TuneConfig, layers: int, frozen: int = 0) -> tuple[int, ...]:
    """The block counts below ``layers`` (and above the ``frozen`` blocks, whose outputs are cached) that a decision
    head is tried at besides the full depth."""
    grid = config.head_depths if config.head_depths is not None else [round(f * layers) for f in DEPTH_FRACTIONS]
    return tuple(sorted({d for d in grid if frozen < d < layers}))


def resolved(config: TuneConfig, rows: int, layers: int, held: int = MIN_HELD_FOR_PATIENCE) -> TuneConfig:
    """``config`` with every open setting (None) chosen for ``rows`` training rows and ``held`` held-out questions
    of a ``layers``-block model; settings given stay as they are. ``method="full"`` keeps its old defaults (every
    block, 2e-5, 3 epochs)."""
    patience = config.patience or (DEFAULT_PATIENCE if held >= MIN_HELD_FOR_PATIENCE else 10 ** 6)
    config = dataclasses.replace(config, patience=patience)
    if config.method != "lora":
        blocks = 0 if config.train_blocks is None else config.train_blocks
        return dataclasses.replace(config, train_blocks=blocks, lr=config.learning_rate,
                                   epochs=config.epochs or DEFAULT_EPOCHS)
    auto = min(AUTO_BLOCKS, layers) if rows < MANY_ROWS else 0
    blocks = auto if config.train_blocks is None else config.train_blocks
    few = blocks and blocks <= 2 * AUTO_BLOCKS
    lr = config.lr if config.lr is not None else (AUTO_LR if few else EVERY_BLOCK_LR)
    per_epoch = max(1, math.ceil(rows / config.batch_questions))
    epochs = config.epochs or min(MAX_EPOCHS, max(DEFAULT_EPOCHS, math.ceil(MIN_STEPS / per_epoch)))
    return dataclasses.replace(config, train_blocks=blocks, lr=lr, epochs=epochs)
