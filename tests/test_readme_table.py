"""The README's headline table and the figures of docs/benchmarks.md are the render of the result files
(``benchmarks/readme_table.py``): a figure changes only with its result. Both ways: the files as committed pass
``--check``; a copy whose table was changed by hand (one figure), or whose result file changed under it, or that lost
its markers, fails it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "readme_table.py"


def _check(readme: Path, docs: Path = ROOT / "docs" / "benchmarks.md") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--check", "--readme", str(readme), "--docs", str(docs)],
                          capture_output=True, text=True, timeout=120)


def test_the_readmes_table_is_the_render_of_the_results():
    done = _check(ROOT / "README.md")
    assert done.returncode == 0, done.stderr


def test_a_table_changed_by_hand_fails_the_check(tmp_path):
    text = (ROOT / "README.md").read_text()
    assert "**3.5x**" in text  # the llama.cpp row's warm ratio, as rendered from its result
    changed = tmp_path / "README.md"
    changed.write_text(text.replace("**3.5x**", "**4.5x**", 1))
    done = _check(changed)
    assert done.returncode == 1 and "differs from the render" in done.stderr, done
    unmarked = tmp_path / "unmarked.md"
    unmarked.write_text(text.replace("<!-- end of the headline table -->", ""))
    done = _check(unmarked)
    assert done.returncode == 1 and "no headline table" in done.stderr, done


def test_a_result_that_changes_changes_the_render(tmp_path, monkeypatch):
    """The render reads the result files: a changed figure in a result moves the table (so the README must follow)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import readme_table

    results = tmp_path / "results"
    shutil.copytree(readme_table.RESULTS, results)
    name = results / "llama_cpp_side_by_side_compact.json"
    data = json.loads(name.read_text())
    before = readme_table.render()
    data["median_s"]["llama.cpp warm"] *= 2
    name.write_text(json.dumps(data))
    monkeypatch.setattr(readme_table, "RESULTS", results)
    after = readme_table.render()
    assert before != after and "**7.0x**" in after, after


def test_a_figure_of_docs_benchmarks_changed_by_hand_fails_the_check(tmp_path):
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    assert "| 5.6x | 4.9x |" in text  # bf16's ratios to llama.cpp, as rendered from the side-by-side result
    changed = tmp_path / "benchmarks.md"
    changed.write_text(text.replace("| 5.6x | 4.9x |", "| 6.6x | 4.9x |", 1))
    done = _check(ROOT / "README.md", changed)
    assert done.returncode == 1 and "rendered figures differs from the render" in done.stderr, done
    unmarked = tmp_path / "unmarked.md"
    unmarked.write_text(text.replace("<!-- end of the rendered figures -->", ""))
    done = _check(ROOT / "README.md", unmarked)
    assert done.returncode == 1 and "no rendered figures" in done.stderr, done


def test_a_result_that_changes_changes_the_docs_render(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import readme_table

    results = tmp_path / "results"
    shutil.copytree(readme_table.RESULTS, results)
    name = results / "bf16_guarantee_compact.json"
    data = json.loads(name.read_text())
    before = readme_table.render_docs()
    data["guarantee"]["datasets"]["bbc"].update(argmax_agreement=1.0, max_abs_dp=0.01)
    name.write_text(json.dumps(data))
    monkeypatch.setattr(readme_table, "RESULTS", results)
    after = readme_table.render_docs()
    assert before != after and "| bbc | 1.00 | 0.010 | 0.022 | kept |" in after, after
