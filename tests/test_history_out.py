"""The product's code says why, not when: no issue number and no date in the source of runtime/, export/,
calibration/, cli.py and flags.py (comments, docstrings and messages alike). History goes to CHANGELOG.md; a figure's
measurement date belongs beside the figure in its result file. Negative controls: each way of citing history is
found."""

from __future__ import annotations

import re
from pathlib import Path

import onepass

ROOT = Path(onepass.__file__).parent
PRODUCT = [*(ROOT / d for d in ("runtime", "export", "calibration")), ROOT / "cli.py", ROOT / "flags.py"]
HISTORY = re.compile(r"\bissues?\s*#?\d+|\bPR\s*#\d+|\b20\d\d-[01]\d-[0-3]\d\b", re.IGNORECASE)


def history_in(text: str) -> list[str]:
    """Each line of ``text`` that cites an issue number or a date, as 'line: text'."""
    return [f"{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1) if HISTORY.search(line)]


def _sources() -> list[Path]:
    return sorted(p for root in PRODUCT for p in ([root] if root.is_file() else root.rglob("*.py")))


def test_no_issue_number_or_date_in_the_product_code():
    sources = _sources()
    assert len(sources) > 60
    found = {str(p.relative_to(ROOT)): hits for p in sources if (hits := history_in(p.read_text()))}
    assert found == {}, found


def test_history_is_found_where_it_is_written():
    for line in ["# fixed in issue 44", "x = 1  # issues 45 and 46", '"""Added by Issue #12."""',
                 "raise Error('removed on 2026-12-06')", "# see PR #7"]:
        assert history_in(line), line
    for line in ["# an issue of the wire", "DATE = '%Y-%m-%d'", "x = 2026 - 12", "# 45 issues", "version 1.2.3"]:
        assert history_in(line) == [], line
