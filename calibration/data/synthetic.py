"""Generated, rule-labelled decision rows: every label follows from the text by a stated rule.

Families: ``amount`` (a sum over a limit, yes/no), ``deadline`` (a date before a deadline),
``routing`` (keyword routing of office requests to a department, options with descriptions),
``mention`` (which of 2..32 multi-token options (the engine limit) the text mentions), ``count`` (how many items,
an ordinal score of 3..5 levels), ``letters`` (the same decision with options renamed to
letters or codes, in a random order), ``negation`` (did a stated event happen), and ``compare``
(who is older / taller; held out of the default training mixture). None of them is about
customer payments or refunds: the README ticket and its paraphrases stay out of training.
"""

from __future__ import annotations

import datetime as dt
import random

from ...runtime.core.questions import Choice, Noul, Score, to_wire

ITEMS = ["apples", "a garden hose", "blue paint", "a soldering iron", "oat milk", "a road bike", "printer paper",
         "a camping stove", "green tea", "winter boots", "a sewing machine", "olive oil", "a desk lamp", "rice",
         "a tennis racket", "a violin", "wool socks", "a hammer", "a chess set", "sunflower seeds", "a kayak",
         "a mountain tent", "dark chocolate", "a rain jacket", "a microscope", "a telescope", "a yoga mat",
         "a fountain pen", "coffee beans", "a bread knife", "a flower pot", "a bicycle pump", "a wall clock",
         "a pair of skis", "a metronome", "a picture frame", "an umbrella", "a kettle", "a ladder", "a guitar strap",
         "a snow shovel", "a pillow"]
NAMES = ["Alice", "Bruno", "Chen", "Dara", "Emeka", "Fatima", "Goran", "Hana", "Ivan", "Jun", "Kofi", "Lena",
         "Mateo", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tariq"]
DEPARTMENTS = {
    "facilities": ("buildings, heating, cleaning and desks", ["The heating on the third floor is broken.",
                   "A window in meeting room B will not close.", "The kitchen sink is leaking again.",
                   "We need two more desks for the new team."]),
    "legal": ("contracts, compliance and disputes", ["Please review the supplier contract before Friday.",
              "A partner asked whether our privacy policy covers the new app.", "We received a letter from a "
              "lawyer about a trademark.", "Can someone check the terms of the lease renewal?"]),
    "hr": ("hiring, leave and staff questions", ["I would like to take parental leave from June.",
           "How many vacation days do new employees get?", "We want to open a position for a junior designer.",
           "A colleague asked how to change her pension plan."]),
    "it": ("laptops, accounts and networks", ["My laptop does not connect to the office Wi-Fi.",
           "I forgot the password of my email account.", "The shared drive is not visible on my computer.",
           "The projector in room C shows no signal from laptops."]),
    "marketing": ("campaigns, brand and social media", ["We need a poster for the spring product launch.",
                  "Who approves posts on our social media accounts?", "The new logo should appear on the "
                  "website banner.", "Please plan an advertising campaign for the autumn fair."]),
}
FACTS = [("the train left on time", "Did the train leave on time?"), ("the museum opened", "Did the museum open?"),
         ("the team won the match", "Did the team win the match?"), ("the package arrived", "Did the package arrive?"),
         ("the meeting took place", "Did the meeting take place?"), ("the bridge was repaired", "Was the bridge repaired?"),
         ("the concert was sold out", "Was the concert sold out?"), ("the experiment worked", "Did the experiment work?")]
FAMILIES = ("amount", "deadline", "routing", "mention", "count", "letters", "negation", "compare")


def _row(family: str, state: str, question, label) -> dict:
    return {"dataset": f"synthetic_{family}", "state": state, "question": to_wire(question), "label": label}


def amount(rng: random.Random) -> list[dict]:
    """An expense and a limit; is it over the limit (and a second question against another threshold)."""
    cur = rng.choice(["dollars", "euros", "pounds"])
    limit = rng.choice([100, 250, 500, 1000, 2000, 2500])
    # over or under the limit equally often, so neither answer is a safe default
    value = rng.randrange(limit + 1, 3 * limit) if rng.random() < 0.5 else rng.randrange(max(10, limit // 5), limit)
    what = rng.choice(["the hotel stay", "a new office chair", "the conference trip", "a team dinner", "software"])
    state = f"Expense report: {value:,} {cur} for {what}. Employees may spend up to {limit:,} {cur} without approval."
    other = rng.choice([v for v in (value // 2, value * 2, 100, 300, 750, 1500, 3000) if v != value])
    return [_row("amount", state, Noul("Is the expense over the approval limit?"), "yes" if value > limit else "no"),
            _row("amount", state, Noul(f"Is the amount more than {other:,} {cur}?"), "yes" if value > other else "no")]


def deadline(rng: random.Random) -> list[dict]:
    """A submission date and a deadline; was it on time."""
    due = dt.date(2024, 1, 1) + dt.timedelta(days=rng.randrange(0, 700))
    sent = due + dt.timedelta(days=rng.choice([-20, -9, -3, -1, 1, 2, 5, 14]))
    what = rng.choice(["grant application", "tax form", "thesis", "bid", "annual report"])
    fmt = lambda d: f"{d:%B} {d.day}, {d.year}"  # noqa: E731
    state = f"The {what} was due on {fmt(due)}. It was submitted on {fmt(sent)}."
    return [_row("deadline", state, Noul("Was it submitted before the deadline?"), "yes" if sent < due else "no")]


def routing(rng: random.Random) -> list[dict]:
    """An office request routed by its subject; options always carry descriptions."""
    dept = rng.choice(list(DEPARTMENTS))
    state = rng.choice(DEPARTMENTS[dept][1]) + rng.choice(["", " Thanks!", " It is quite urgent.", " Kind regards."])
    names = rng.sample([d for d in DEPARTMENTS if d != dept], rng.randint(1, 4)) + [dept]
    q = Choice("Which department should handle this request?", {d: DEPARTMENTS[d][0] for d in names})
    return [_row("routing", state, q, dept)]


def mention(rng: random.Random) -> list[dict]:
    """A shopping note names one item; which of 2..32 options is it."""
    k = rng.choice([2, 3, 5, 8, 12, 20, 26, 32])
    options = rng.sample(ITEMS, k)
    item = rng.choice(options)
    who = rng.choice(NAMES)
    state = f"{who} went to town on Saturday and came back with {item}."
    return [_row("mention", state, Choice("What did they buy?", {o: None for o in options}), item)]


def count(rng: random.Random) -> list[dict]:
    """A list of k items; how many, as a score over 3..5 ordered levels."""
    k = rng.randint(0, 6)
    items = rng.sample(ITEMS, k)
    state = f"Packing list: {', '.join(items)}." if items else "Packing list: nothing yet."
    scales = [(["None", "One or two", "Three or more"], lambda n: 0 if n == 0 else 1 if n <= 2 else 2),
              (["None", "One", "Two or three", "Four or more"], lambda n: min(n, 1) if n < 2 else 2 if n <= 3 else 3),
              (["None", "One", "Two", "Three", "Four or more"], lambda n: min(n, 4))]
    levels, rule = rng.choice(scales)
    return [_row("count", state, Score("How many items are on the list?", levels), rule(k))]


def letters(rng: random.Random) -> list[dict]:
    """A department decision whose options are renamed to letters or codes (the description carries the meaning)."""
    dept = rng.choice(list(DEPARTMENTS))
    state = rng.choice(DEPARTMENTS[dept][1])
    names = rng.sample([d for d in DEPARTMENTS if d != dept], rng.randint(1, 3)) + [dept]
    rng.shuffle(names)
    codes = rng.choice([["A", "B", "C", "D"], ["option 1", "option 2", "option 3", "option 4"], ["X7", "K2", "P9", "M4"]])
    crit = {codes[i]: f"{d}: {DEPARTMENTS[d][0]}" for i, d in enumerate(names)}
    return [_row("letters", state, Choice("Which option should handle this request?", crit), codes[names.index(dept)])]


def negation(rng: random.Random) -> list[dict]:
    """A stated event, affirmed or negated; did it happen."""
    fact, question = rng.choice(FACTS)
    happened = rng.random() < 0.5
    subject, rest = fact.split(" ", 2)[:2], fact.split(" ", 2)[2]
    aux = rest.split(" ", 1)
    if aux[0] in ("was", "were"):
        text = f"{' '.join(subject)} {aux[0]}{'' if happened else ' not'} {aux[1]}"
    else:
        verb = {"left": "leave", "opened": "open", "won": "win", "arrived": "arrive", "took": "take",
                "worked": "work"}[aux[0]]
        text = f"{' '.join(subject)} {aux[0] if happened else 'did not ' + verb}{' ' + aux[1] if len(aux) > 1 else ''}"
    state = f"Yesterday {text}. {rng.choice(['Nobody was surprised.', 'It was a busy day.', 'More news tomorrow.'])}"
    return [_row("negation", state, Noul(question), "yes" if happened else "no")]


def compare(rng: random.Random) -> list[dict]:
    """Two or three people's ages (or heights); who is the oldest (tallest). Held out of the default mixture."""
    people = rng.sample(NAMES, rng.choice([2, 3]))
    if rng.random() < 0.5:
        values = rng.sample(range(18, 80), len(people))
        state = " ".join(f"{p} is {v} years old." for p, v in zip(people, values))
        q = Choice("Who is the oldest?", {p: None for p in people})
    else:
        values = rng.sample(range(150, 200), len(people))
        state = " ".join(f"{p} is {v} cm tall." for p, v in zip(people, values))
        q = Choice("Who is the tallest?", {p: None for p in people})
    return [_row("compare", state, q, people[values.index(max(values))])]


def rows(n_per_family: int, rng: random.Random, exclude=(), only=None) -> list[dict]:
    """``n_per_family`` generated states of each family (minus ``exclude``, or just ``only``)."""
    out = []
    for family in only or [f for f in FAMILIES if f not in exclude]:
        make = globals()[family]
        for _ in range(n_per_family):
            out += make(rng)
    return out
