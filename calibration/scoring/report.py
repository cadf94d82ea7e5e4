"""The calibration report: JSON, a markdown table, a reliability diagram and a coverage curve (PNG)."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

METRICS = ("accuracy", "nll", "brier", "ece")


def _reliability(ax, bins: list[dict], title: str) -> None:
    pts = [(b["confidence"], b["accuracy"], b["count"]) for b in bins if b["count"]]
    ax.plot([0, 1], [0, 1], "--", color="grey", linewidth=1)
    if pts:
        conf, acc, count = zip(*pts)
        ax.scatter(conf, acc, s=[10 + 2 * c for c in count], alpha=0.7)
        ax.plot(conf, acc)
    ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="confidence (p of the top answer)", ylabel="accuracy", title=title)


def plot_reliability(entries: list[tuple[str, dict]], path: Path) -> None:
    """One reliability diagram per (label, overall metrics) side by side."""
    fig, axes = plt.subplots(1, len(entries), figsize=(5 * len(entries), 4.5), squeeze=False)
    for ax, (label, m) in zip(axes[0], entries):
        _reliability(ax, m["reliability"], f"{label}: ECE {m['ece']:.3f}, accuracy {m['accuracy']:.3f}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_coverage(entries: list[tuple[str, dict]], path: Path) -> None:
    """The coverage-accuracy curves of (label, overall metrics) on one axis."""
    fig, ax = plt.subplots(figsize=(5, 4))
    for label, m in entries:
        cov = m["coverage"]
        ax.plot([c["coverage"] for c in cov], [c["accuracy"] for c in cov], marker=".", label=label)
    ax.set(xlabel="coverage (answered share)", ylabel="accuracy of the answered", title="abstain below a confidence")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(report: dict, out: Path) -> None:
    """Write report.json, report.md, reliability.png and coverage.png into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    phases = [(phase, report[phase]["all"]) for phase in ("before", "after")]
    plot_reliability(phases, out / "reliability.png")
    plot_coverage(phases, out / "coverage.png")
    lines = ["| set | phase | " + " | ".join(METRICS) + " | rows |", "|---|---|" + "---|" * (len(METRICS) + 1)]
    for name in report["before"]:
        for phase in ("before", "after"):
            m = report[phase][name]
            lines.append(f"| {name} | {phase} | " + " | ".join(f"{m[k]:.3f}" for k in METRICS) + f" | {m['rows']} |")
    (out / "report.md").write_text("\n".join(lines) + "\n")
