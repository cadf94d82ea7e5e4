"""Static checks of the Dockerfiles (no Docker engine on CI machines)."""

import re
import tomllib
from pathlib import Path

import pytest

from onepass.cli import parser

ROOT = Path(__file__).parent.parent
DOCKERFILES = sorted((ROOT / "docker").glob("Dockerfile*"))


def test_there_is_a_cpu_image():
    assert ROOT / "docker" / "Dockerfile.cpu" in DOCKERFILES


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_is_pinned_non_root_healthy_and_serves(path):
    text = path.read_text()
    bases = re.findall(r"^FROM\s+(\S+)", text, flags=re.M)
    assert bases, "no FROM line"
    for base in bases:
        name, _, tag = base.rpartition(":")
        assert name and tag and tag != "latest" and "$" not in tag, f"{base} must be pinned by tag"
    users = re.findall(r"^USER\s+(\S+)", text, flags=re.M)
    assert users and users[-1] not in ("root", "0"), "the image must run as a non-root user"
    assert re.search(r"^HEALTHCHECK .*", text, flags=re.M | re.S) and "/readyz" in text
    entry = re.search(r'^ENTRYPOINT\s+\[(.*)\]', text, flags=re.M)
    assert entry, "no ENTRYPOINT"
    argv = [a.strip().strip('"') for a in entry.group(1).split(",")]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert argv[0] in scripts and argv[1] == "serve"
    parser().parse_args(argv[1:] + ["--engine", "/engines/default"])  # the subcommand and flags exist
    for src in re.findall(r"^COPY\s+(.+?)\s+\S+$", text, flags=re.M):
        for item in src.split():
            assert (ROOT / item.rstrip("/")).exists(), f"COPY source {item} is missing"
