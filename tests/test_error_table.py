"""One table from errors to HTTP answers (runtime/server/errors.py): every refusal is a typed OnepassError, and no
module of the app's layer chooses a status itself. The transport (which answers before any app exists) writes its
own raw responses and is the one exception, named here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

from onepass.runtime.core.errors import DeadlineExceeded, InvalidRequest, LimitExceeded, NotText, OnepassError  # noqa: E402
from onepass.runtime.server import errors  # noqa: E402

SERVER = Path(errors.__file__).parent
OWN_ANSWERS = {"errors.py", "transport.py"}  # the table itself, and the transport's raw responses
CHOOSES_A_STATUS = re.compile(r'HTTPError\(\s*\d|status_code\s*=\s*\d|"status"\s*:\s*\d|_response\([^)]*\b[45]\d\d\b')


def _choices(text: str) -> list[str]:
    return [m.group(0) for m in CHOOSES_A_STATUS.finditer(text)]


def test_no_module_of_the_app_layer_chooses_a_status():
    found = {p.name: _choices(p.read_text()) for p in sorted(SERVER.glob("*.py")) if p.name not in OWN_ANSWERS}
    assert not {name: hits for name, hits in found.items() if hits}, found


def test_the_grep_finds_a_status_chosen_by_hand():
    """The negative control: each way a status was chosen before the table is caught."""
    for line in ('raise HTTPError(413, "too big")', 'JSONResponse(body, status_code=503)',
                 'return _error_response(err, 429)', 'response = {"status": 500, "headers": []}'):
        assert _choices(line), line
    assert not _choices('raise QueueFull("busy", 2.0)  # 429 via the table')


@pytest.mark.parametrize("err, status", [
    (errors.ClientClosed("gone"), 499), (errors.Unauthorized("key"), 401), (errors.UnknownModel("m", "model"), 404),
    (NotText("bytes"), 400), (errors.MalformedBody("not JSON"), 400), (errors.BodyTimeout("slow"), 408),
    (errors.BodyTooLarge("big"), 413), (errors.NeverFits("slow"), 413), (LimitExceeded("long"), 413),
    (InvalidRequest("bad", "questions.q"), 422), (errors.QueueFull("busy", 2.5), 429), (DeadlineExceeded("late"), 503),
    (errors.EngineStopped("stopped"), 503), (errors.NotReady("warming up"), 503), (OnepassError("fault"), 500),
    (RuntimeError("a bug"), 500)])
def test_each_refusal_has_its_status(err, status):
    answer = errors.http_error(err, retry_after_s=1)
    assert errors.status_of(err) == status == answer.status
    if status in (429, 503) and isinstance(err, OnepassError):
        assert answer.headers["Retry-After"] == ("3" if isinstance(err, errors.QueueFull) else "1")
    if isinstance(err, (errors.BodyTooLarge, errors.BodyTimeout)):
        assert answer.headers["Connection"] == "close"  # the body is left unread
    if status == 422:
        assert answer.detail[0]["loc"] == ["body", "questions", "q"] and answer.field == "questions.q"
    if not isinstance(err, OnepassError):
        assert "a bug" not in answer.message  # an internal fault's details are not shown


def test_every_entry_of_the_table_is_reachable_and_the_refusals_are_onepass_errors():
    kinds = [kind for kind, _ in errors.STATUSES]
    for i, kind in enumerate(kinds):
        assert not any(issubclass(kind, earlier) for earlier in kinds[:i]), kind  # shadowed by a base before it
    assert not hasattr(errors, "DeadlinePassed")  # one name for one deadline type: the engine's
    for kind in (errors.QueueFull, errors.NeverFits, errors.EngineStopped, DeadlineExceeded):
        assert issubclass(kind, OnepassError)
