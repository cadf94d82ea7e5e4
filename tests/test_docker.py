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


def test_gpu_images_install_every_export_dependency():
    """The GPU images export the default engine on first start, so they need every package of the [export] extra
    but torch (the base image's): peft (which merges the shipped adapter) was missing once. Versions may differ
    where the image's Python needs it (Jetson: Python 3.10)."""
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["export"]
    names = {re.split(r"[=<>;\s\[]", req, maxsplit=1)[0].lower() for req in extra} - {"torch"}
    for name in ("Dockerfile.gpu", "Dockerfile.jetson"):
        text = (ROOT / "docker" / name).read_text().replace("\\\n", " ")
        installs = " ".join(line for line in text.splitlines() if "pip install" in line or "--also" in line)
        installed = {re.split(r"[=<>\[]", word, maxsplit=1)[0].lower() for word in installs.split()}
        assert names <= installed, f"{name} lacks {sorted(names - installed)}"


def test_the_jetson_image_uses_its_python_and_the_package_allows_it():
    """JetPack 6 images are Ubuntu 22.04 with Python 3.10 and TensorRT's bindings for it: the image uses the
    system python3 (not a newer one), and the package's requires-python admits 3.10."""
    text = (ROOT / "docker" / "Dockerfile.jetson").read_text()
    assert "l4t-jetpack:r36" in text and "python3 -m pip install" in text and "python3.1" not in text
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert requires == ">=3.10"


def test_ngc_requirements_leave_the_bases_constrained_packages_at_its_versions(tmp_path):
    """NGC's PIP_CONSTRAINT pins every package of the image; the GPU image's requirements name those (numpy, onnx
    here) without a version and give every other package the lock's exact version, markers evaluated."""
    import subprocess
    import sys

    constraint = tmp_path / "constraint.txt"
    constraint.write_text("numpy==1.26.4\n# a comment\nonnx==1.18.0  # pinned by the image\n"
                          "-r other.txt\nPackaging==25.0\n")
    lock = tmp_path / "lock.txt"
    lock.write_text("# a lock\nzstandard==0.25.0\ntokenizers==0.23.3\npeft==0.21.2\nfastapi==0.165.0\n")
    script = ROOT / "docker" / "constrained_requirements.py"
    out = subprocess.run([sys.executable, str(script), str(ROOT / "pyproject.toml"), "--extras", "serve",
                          "--also", "onnx", "peft", "--constraint", str(constraint), "--lock", str(lock)],
                         capture_output=True, text=True, check=True)
    lines = out.stdout.split()
    assert "numpy" in lines and "onnx" in lines  # the base's versions, through its constraint
    assert "peft==0.21.2" in lines and "zstandard==0.25.0" in lines and "tokenizers==0.23.3" in lines
    assert [x for x in lines if x.startswith("fastapi")] == ["fastapi==0.165.0"]  # one line, the lock's version
    assert "uvicorn<0.55,>=0.54.0" in lines  # not in the lock: the declared range
    assert not any(x.startswith("torch") for x in lines)
    assert "numpy, onnx" in out.stderr
    text = (ROOT / "docker" / "Dockerfile.gpu").read_text()
    assert "constrained_requirements.py" in text and "--lock constraints/ci.txt" in text
    assert not re.search(r"pip install[^\n]*'\.\[serve\]'", text)


def test_a_lock_outside_the_declared_range_is_refused(tmp_path):
    import subprocess
    import sys

    lock = tmp_path / "lock.txt"
    lock.write_text("numpy==1.26.4\n")
    out = subprocess.run([sys.executable, str(ROOT / "docker" / "constrained_requirements.py"),
                          str(ROOT / "pyproject.toml"), "--constraint", str(tmp_path / "absent.txt"), "--lock", str(lock)],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "numpy==1.26.4 is outside the declared" in out.stderr


def test_without_a_constraint_file_or_a_lock_every_declared_range_is_kept(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, str(ROOT / "docker" / "constrained_requirements.py"),
                          str(ROOT / "pyproject.toml"), "--constraint", str(tmp_path / "absent.txt")],
                         capture_output=True, text=True, check=True)
    assert "numpy<3,>=2.2.6" in out.stdout.split()
