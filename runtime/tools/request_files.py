"""Requests and states read from files, as the commands take them (``--questions``, ``--state``, ``--states``).

Every failure is a one-line OnepassError naming the file: unreadable, not UTF-8, not JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..core.errors import OnepassError


def read_bytes(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise OnepassError(f"cannot read {what} {path}: {err.strerror}") from None


def read_text(path: str, what: str) -> str:
    """A UTF-8 file's text (``-``: standard input)."""
    raw = sys.stdin.buffer.read() if path == "-" else read_bytes(path, what)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise OnepassError(f"{what} {path} is not valid UTF-8 (byte {err.start}); save it as UTF-8") from None


def json_lines(text: str, where: str):
    """(line number, value) of each non-blank line of JSONL ``text``; InvalidRequest names ``where:line``."""
    from ..core.errors import InvalidRequest

    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except (json.JSONDecodeError, RecursionError) as err:
            raise InvalidRequest(f"{where}:{n}: not valid JSON ({err})") from None


def request_body(questions: str, state: str | None = None, json_state: bool = False) -> dict:
    """A TypeSafe request body: ``questions`` holds {id: question} or a whole request; ``state`` a state file (its
    text, or JSON with ``json_state``) that replaces the request's state."""
    try:
        data = json.loads(read_text(questions, "questions file"))
    except json.JSONDecodeError as err:
        raise OnepassError(f"questions file {questions} is not valid JSON: {err}") from None
    body = data if isinstance(data, dict) and "questions" in data else {"questions": data}
    if state is not None:
        text = read_text(state, "state file")
        if json_state:
            try:
                text = json.loads(text)
            except json.JSONDecodeError as err:
                raise OnepassError(f"state file {state} is not valid JSON: {err}") from None
        body = {**body, "state": text}
    return body


def states(folder: str | None, body: dict) -> list:
    """A workload's states: one per file of ``folder`` (sorted by name), else the request's one state."""
    if folder is None:
        if "state" not in body:
            raise OnepassError("give the state: --state FILE, --states DIR, or a full request in --questions")
        return [body["state"]]
    path = Path(folder)
    if not path.is_dir():
        raise OnepassError(f"--states {folder} is not a directory of state files")
    files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
    if not files:
        raise OnepassError(f"--states {folder} holds no state file")
    return [read_text(str(p), "state file") for p in files]
