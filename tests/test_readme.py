"""Every command the README shows exists: `onepass ...` lines parse with the real CLI parser, `make ...` targets
are in the Makefile, and the Python snippets compile and run on the test engine: the README stays
current with the code."""

import re
import shlex
from pathlib import Path

import pytest

from onepass.cli import parser

ROOT = Path(__file__).parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _blocks(path: Path) -> list[tuple[str, str]]:
    """(language, text) of every fenced code block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", path.read_text(encoding="utf-8"), flags=re.M | re.S)


def _command_lines(text: str) -> list[str]:
    """Shell lines of a block with continuations joined and trailing comments removed."""
    lines, current = [], ""
    for raw in text.splitlines():
        line = raw.split("  #", 1)[0].rstrip()
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        lines.append((current + line).strip())
        current = ""
    return [line for line in lines if line]


def _cases():
    for path in DOCS:
        for lang, text in _blocks(path):
            if lang in ("", "sh", "bash", "shell"):
                for line in _command_lines(text):
                    if line.startswith(("onepass ", "make ")):  # other lines: trees, other tools' commands
                        yield pytest.param(path.name, "shell", line, id=f"{path.name}:{line[:60]}")
            elif lang == "python":
                yield pytest.param(path.name, "python", text, id=f"{path.name}:python:{text.splitlines()[0][:40]}")


PLACEHOLDER = re.compile(r"\[|\.\.\.|<|\||…")


@pytest.mark.parametrize("doc, kind, text", list(_cases()))
def test_every_command_in_the_docs_exists(doc, kind, text):
    if kind == "python":
        compile(text, doc, "exec")  # syntax only: the snippets name the caller's own engine and state
        return
    words = shlex.split(text)
    if words[0] == "onepass":
        if PLACEHOLDER.search(text):  # a usage synopsis: the subcommand must exist
            assert words[1] in parser()._subparsers._group_actions[0].choices, text
            return
        parser().parse_args(words[1:])  # SystemExit (a failed test) on an unknown flag or a missing value
    elif words[0] == "make":
        targets = set(re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
        for target in (w for w in words[1:] if "=" not in w and not w.startswith("-")):
            assert target in targets, f"{text}: no make target {target!r}"


def test_the_scan_finds_the_readmes_commands():
    """Control: the scan sees the README's own set-up and use commands (a broken extractor would pass all)."""
    lines = [p.values[2] for p in _cases() if p.values[1] == "shell"]
    assert any(line.startswith("make demo") for line in lines) and any(line.startswith("onepass ask") for line in lines)
    assert sum(p.values[1] == "python" for p in _cases()) >= 2


def _python_snippets(path: Path) -> list[str]:
    return [text for lang, text in _blocks(path) if lang == "python"]


@pytest.mark.parametrize("doc", [p.name for p in DOCS if _python_snippets(p)])
def test_the_python_snippets_run_on_the_test_engine(doc, tiny_engine_dir):
    """Each document's Python snippets run in order in one namespace, as a reader pastes them: the engine path is the
    test engine's (the tiny Llama: what runs here is the API, not the model's answers), the server URL that of a real
    onepass server on a loopback port (the official SDK snippets). A line whose argument is the ``{...}`` placeholder
    is left out. Every snippet must name what is swapped in (control: a snippet whose engine path drifted fails)."""
    from test_server import running

    from onepass import Engine

    path = next(p for p in DOCS if p.name == doc)
    with running(Engine.load(tiny_engine_dir, verify=False)) as base:
        namespace: dict = {}
        for text in _python_snippets(path):
            assert "engines/smollm2" in text or "http://127.0.0.1:8000" in text or "engine." in text, text
            code = "\n".join(line for line in text.splitlines() if "{...}" not in line)
            code = code.replace('"engines/smollm2"', repr(str(tiny_engine_dir))).replace("http://127.0.0.1:8000", base)
            exec(compile(code, doc, "exec"), namespace)


def test_the_readmes_ticket_answers_are_the_default_engines(engine):
    """The README's sentence about its ticket (what `make demo` prints), read from the README itself: refund P(yes),
    the team and its probability, the frustration score, each equal to the default engine's answer at the README's
    two decimals. If the README or the engine's answers drift, this fails."""
    import json

    from onepass.runtime.core.questions import from_wire

    text = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    found = re.search(r"refund P\(yes\) \*\*([\d.]+)\*\*, team \*\*(\w+)\*\* \(([\d.]+)\), "
                      r"frustration \*\*([\d.]+)\*\* \(\"(\w[\w ]*)\"\)", text)
    assert found, "the README's ticket sentence changed shape: update this test with it"
    refund, team, team_p, score, level = found.groups()
    data = ROOT / "tests" / "data"
    questions = {k: from_wire(k, v) for k, v in json.loads((data / "questions.json").read_text()).items()}
    got = engine.ask((data / "ticket.txt").read_text(), questions)
    assert f"{got['refund'].noul:.2f}" == refund
    assert got["team"].choice == team and f"{got['team'].probabilities[team]:.2f}" == team_p
    frustration = got["frustration"]
    assert f"{frustration.score:.2f}" == score and frustration.legend[str(round(frustration.score))] == level


def test_the_readmes_python_snippet_prints_what_the_readme_says(engine_dir):
    """The README's Python snippet run on the default engine (as a reader pastes it, from the repository root): what it
    prints is the answer in the comment under it, choice equal and probabilities at the comment's 3 decimals (0.002:
    the backends' float reordering). It answered sales 0.98 before described options got lines of their own."""
    import contextlib
    import io

    (text,) = [t for t in _python_snippets(ROOT / "README.md") if "print(answers" in t]
    said = re.search(r"^# (ChoiceAnswer\(.*\))$", text, flags=re.M).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(text.replace('"engines/smollm2"', repr(str(engine_dir))), "README.md", "exec"), {})
    printed = out.getvalue().strip()
    choice = re.compile(r"choice='(\w+)'")
    probs = re.compile(r"'(\w+)': ([\d.]+)")
    assert choice.search(printed).group(1) == choice.search(said).group(1) == "billing", printed
    got, want = dict(probs.findall(printed.split("probabilities=")[1])), dict(probs.findall(said.split("probabilities=")[1]))
    assert got.keys() == want.keys() and all(abs(float(got[k]) - float(want[k])) <= 0.002 for k in want), (printed, said)


def test_the_readme_ticket_answers_billing_under_every_subset_of_described_options(engine):
    """All 8 subsets of {billing, technical, sales} described (none, each, each pair, all): billing every time, with
    at least 0.9. Negative control: the old option line ("- name: description") answers another team for some
    subset (it answered sales 0.98 when only billing was described)."""
    import dataclasses
    import itertools

    from onepass import Choice
    from onepass.runtime.core.prompt import OLD_OPTION_LINE

    ticket = (ROOT / "tests" / "data" / "ticket.txt").read_text()
    described = {"billing": "payments, refunds", "technical": "bugs and outages", "sales": "new purchases and upgrades"}
    subsets = [set(s) for r in range(4) for s in itertools.combinations(described, r)]

    def answers():
        out = []
        for subset in subsets:
            options = {k: (described[k] if k in subset else None) for k in described}
            out.append(engine.ask(ticket, {"t": Choice("Which team should handle this?", options)})["t"])
        return out

    now = answers()
    assert [a.choice for a in now] == ["billing"] * 8 and min(a.probabilities["billing"] for a in now) >= 0.9, now
    template = engine.encoder.template
    try:
        engine.encoder.template = dataclasses.replace(template, option_line=OLD_OPTION_LINE)
        before = answers()
    finally:
        engine.encoder.template = template
    assert any(a.choice != "billing" for a in before), before
