"""Static checks of the Dockerfiles (no Docker engine on CI machines)."""

import re
import tomllib
from pathlib import Path

import pytest

from onepass.cli import parser

ROOT = Path(__file__).parent.parent
DOCKERFILES = sorted((ROOT / "docker").glob("Dockerfile*"))


def test_there_are_cpu_gpu_and_jetson_images():
    assert {p.name for p in DOCKERFILES} >= {"Dockerfile.cpu", "Dockerfile.gpu", "Dockerfile.jetson"}
    assert "nvcr.io/nvidia/" in (ROOT / "docker" / "Dockerfile.gpu").read_text()
    assert "l4t-jetpack" in (ROOT / "docker" / "Dockerfile.jetson").read_text()


def test_gpu_images_never_reinstall_the_bases_torch_with_the_export_extra():
    for name in ("Dockerfile.gpu", "Dockerfile.jetson"):
        text = (ROOT / "docker" / name).read_text()
        assert not re.search(r"pip install[^\n]*\[export", text), f"{name} would replace the base image's torch"
        assert re.search(r"pip install[^\n]*torch==|FROM nvcr.io/nvidia/pytorch:", text), f"{name} has no CUDA torch"


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
