"""The package as a user gets it without a checkout: ``python -m build --wheel`` makes a wheel that installs into a
fresh virtual environment and runs ``szconvert --version`` there; the wheel holds every subpackage and none of the
checkout's benchmarks, tools or tests; an install hint names packages that exist."""

from __future__ import annotations

import subprocess
import sys
import tarfile
import venv
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

import szformat
from szformat._install import install_hint

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    pytest.importorskip("build.__main__")  # pypa's build, not a build/ folder of the checkout
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir", str(out), str(ROOT)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (found,) = out.glob("szformat-*.whl")
    return found


def test_the_wheel_holds_the_package_and_nothing_of_the_checkout(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for module in ("szformat/api.py", "szformat/integrations/vllm.py", "szformat/offload/resident.py",
                   "szformat/loading/transfer.py", "szformat/codec/gpu/_decode.py", "szformat/format/payloads.py"):
        assert module in names, module
    assert not [n for n in names if n.startswith(("bench/", "tools/", "tests/"))]
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "szconvert = szformat.cli:main" in text and "szt = szformat.integrations.vllm:register" in text


def test_the_sdist_holds_every_c_source_of_the_extensions(tmp_path):
    """pip builds the C extensions from the sdist where no wheel fits a machine (an AArch64 one, say): every C file
    and header of the checkout's package, the NEON kernels' header included, must be in it."""
    pytest.importorskip("build.__main__")
    done = subprocess.run([sys.executable, "-m", "build", "--sdist", "--outdir", str(tmp_path), str(ROOT)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (sdist,) = tmp_path.glob("szformat-*.tar.gz")
    with tarfile.open(sdist) as archive:
        held = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    sources = {p.relative_to(ROOT).as_posix() for p in (ROOT / "szformat").rglob("*") if p.suffix in (".c", ".h")}
    assert "szformat/codec/_neon.h" in sources and sources <= held


def test_the_wheel_installs_into_a_fresh_environment_and_runs(wheel, tmp_path):
    env = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env)
    pip = [str(env / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)]
    done = subprocess.run(pip, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    version = subprocess.run([str(env / "bin" / "szconvert"), "--version"], capture_output=True, text=True,
                             timeout=60)
    assert version.returncode == 0 and version.stdout.splitlines()[0].endswith(szformat.__version__), version
    assert version.stdout.splitlines()[1].startswith("CPU codec: "), version


def test_install_hints_name_the_packages_of_the_extra():
    try:
        metadata.requires("szformat")
    except metadata.PackageNotFoundError:  # a checkout run uninstalled: no metadata names the extra's packages
        assert install_hint("gpu") == "pip install -e \".[gpu]\" in szformat's source tree"
        return
    assert install_hint("gpu").startswith("pip install 'triton>=3.2' (szformat's gpu extra: pip install -e")
    assert "'diffusers-dynamic-offloader[vmm]==0.1.0rc2'" in install_hint("ddo")
    assert install_hint("no-such-extra") == "pip install -e \".[no-such-extra]\" in szformat's source tree"


def test_every_python_file_parses_as_python_3_10():
    """The oldest Python szformat supports (pyproject.toml's requires-python): no syntax a 3.10 interpreter lacks
    (the machines that run the tests have a newer one)."""
    import ast

    files = [p for folder in ("szformat", "tests", "tools", "bench") for p in (ROOT / folder).rglob("*.py")]
    assert len(files) > 100
    for path in files:
        ast.parse(path.read_text(encoding="utf-8"), filename=str(path), feature_version=(3, 10))
