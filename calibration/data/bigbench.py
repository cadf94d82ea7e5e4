"""BIG-bench multiple-choice tasks as onepass choice questions, with the train/evaluation wall.

The tasks come from the ``bigbench`` source package on PyPI (its sdist ships every
task's ``task.json``; the package itself cannot be pip-installed here: it pins a
direct-URL dependency). :func:`fetch` downloads the sdist once from the package
registry and unpacks only the ``task.json`` files into the onepass cache.

**The wall.** Only tasks whose folder names begin with ``a`` to ``g`` may be used
to train, tune or select a decision head (:data:`TRAIN_LETTERS`); every other task
is reserved for independent evaluation. :func:`load_tasks` refuses to hand out a
reserved task unless the caller says it is evaluating (``purpose="evaluate"``).
"""

from __future__ import annotations

import hashlib
import json
import random
import tarfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ...runtime.core.errors import InvalidRequest, OnepassError
from ...runtime.core.questions import Choice

VERSION = "1.0.0"
SDIST_URL = ("https://files.pythonhosted.org/packages/95/f8/c019b3579df548a04cac12342cfcb878e50ddf6cfcd7fddba8cfc721c157/"
             "bigbench-1.0.0.tar.gz")
SDIST_SHA256 = "1bb398a5512c6d798cdebe0dfa0ac03f67f6033fa6b39c6ef71df978c7cbc5c2"
TRAIN_LETTERS = "abcdefg"
PURPOSES = ("train", "evaluate")


class ReservedTask(OnepassError):
    """A task reserved for independent evaluation was asked for training or tuning."""


@dataclass(frozen=True)
class Example:
    """One multiple-choice example: the state, the question and the index of the correct option."""

    task: str  # top-level task folder, e.g. "anachronisms"
    subtask: str  # path below benchmark_tasks, e.g. "arithmetic/2_digit_addition"
    state: str
    question: Choice
    label: int


def is_train_task(name: str) -> bool:
    """True for tasks that may be used for training and validation (folder names a..g)."""
    return name[:1].lower() in TRAIN_LETTERS


def fetch(cache: Path) -> Path:
    """The ``benchmark_tasks`` folder, downloading and unpacking the sdist into ``cache`` once."""
    root = cache / f"bigbench-{VERSION}" / "benchmark_tasks"
    if root.is_dir():
        return root
    cache.mkdir(parents=True, exist_ok=True)
    archive = cache / f"bigbench-{VERSION}.tar.gz"
    if not archive.exists():
        partial = archive.with_suffix(".partial")
        urllib.request.urlretrieve(SDIST_URL, partial)
        partial.rename(archive)
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        archive.unlink()
        raise OnepassError(f"bigbench sdist sha256 {digest} != {SDIST_SHA256}; deleted, try again")
    tmp = root.parent.with_name(root.parent.name + ".partial")
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.endswith("/task.json") and "/benchmark_tasks/" in m.name]
        for m in members:
            m.name = m.name.split("/benchmark_tasks/", 1)[1]
        tar.extractall(tmp / "benchmark_tasks", members=members, filter="data")
    tmp.rename(root.parent)
    return root


def task_names(root: Path) -> list[str]:
    """All top-level task folders, sorted."""
    return sorted(p.name for p in root.iterdir() if p.is_dir())


def load_tasks(root: Path, names, purpose: str, *, per_task: int, seed: int = 0, max_state_chars: int = 1500,
               max_options: int = 8, max_option_chars: int = 120) -> list[Example]:
    """Up to ``per_task`` seeded examples of each named task (all its subtasks pooled).

    Examples whose state, options or option count exceed the bounds are skipped, as are
    tasks without ``target_scores`` (generative tasks) and examples with no single best option.
    """
    if purpose not in PURPOSES:
        raise ValueError(f"purpose must be one of {PURPOSES}")
    out: list[Example] = []
    for name in names:
        if purpose == "train" and not is_train_task(name):
            raise ReservedTask(f"task {name!r} is reserved for independent evaluation; only tasks whose folder "
                               f"names begin with {TRAIN_LETTERS[0]}..{TRAIN_LETTERS[-1]} may be used for training, "
                               "tuning or model selection")
        pool = []
        for path in sorted((root / name).rglob("task.json")):
            sub = str(path.parent.relative_to(root))
            pool += [(sub, prefix, ex) for prefix, ex in _examples(path)]
        random.Random(f"{seed}:{name}").shuffle(pool)
        taken = 0
        for sub, prefix, ex in pool:
            if taken >= per_task:
                break
            example = _example(name, sub, prefix, ex, max_state_chars, max_options, max_option_chars)
            if example is not None:
                out.append(example)
                taken += 1
    return out


def _examples(path: Path):
    try:
        task = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    prefix = task.get("task_prefix", "") or ""
    for ex in task.get("examples", []):
        if isinstance(ex.get("target_scores"), dict) and isinstance(ex.get("input"), str):
            yield prefix, ex


def _example(task, sub, prefix, ex, max_state_chars, max_options, max_option_chars) -> Example | None:
    scores = ex["target_scores"]
    names = [str(k).strip() for k in scores]
    if not 2 <= len(names) <= max_options or len(set(names)) != len(names):
        return None
    if any(not n or len(n) > max_option_chars for n in names):
        return None
    values = [float(v) for v in scores.values()]
    best = max(values)
    if values.count(best) != 1:
        return None
    state = (prefix + ex["input"]).strip()
    if not state or len(state) > max_state_chars:
        return None
    try:  # an option the engine refuses (a control character: a newline would write a line into the option list)
        question = Choice(instructions="Which answer is correct?", criteria=names)
    except InvalidRequest:
        return None
    return Example(task, sub, state, question, values.index(best))


def training_examples(root: Path, per_task: int, seed: int = 0, min_examples: int = 10) -> tuple[list, dict]:
    """(examples, task split) of every a..g task with at least ``min_examples`` usable examples."""
    allowed = [n for n in task_names(root) if is_train_task(n)]
    examples = load_tasks(root, allowed, "train", per_task=per_task, seed=seed)
    counts: dict = {}
    for e in examples:
        counts[e.task] = counts.get(e.task, 0) + 1
    usable = [n for n in allowed if counts.get(n, 0) >= min_examples]
    return [e for e in examples if e.task in usable], split_tasks(usable, seed=seed)


def split_tasks(names, seed: int = 0, fractions=(0.6, 0.15)) -> dict[str, list[str]]:
    """Split training-allowed task names into train / val / test (whole tasks, seeded).

    ``test`` tasks are a–g tasks held out of training and validation: the head never sees
    them, and they are what its accuracy claims are measured on.
    """
    allowed = sorted(n for n in names if is_train_task(n))
    random.Random(seed).shuffle(allowed)
    a = round(len(allowed) * fractions[0])
    b = a + round(len(allowed) * fractions[1])
    return {"train": sorted(allowed[:a]), "val": sorted(allowed[a:b]), "test": sorted(allowed[b:])}
