"""Which Triton the GPU codec takes: :func:`szformat.codec.gpu.triton_missing` reads the installed version (without
importing Triton) and names what is wrong, so the automatic routes fall back to the CPU and the explicit ones refuse
in words, instead of a kernel failing inside an older Triton."""

import importlib.metadata
import importlib.util

import pytest

from szformat._install import install_hint
from szformat.codec import gpu


@pytest.fixture
def installed(monkeypatch):
    """Pretend Triton ``version`` is installed (``None``: not installed; ``"no metadata"``: a module without a
    distribution record, as a source build has)."""
    def install(version):
        real_find_spec = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
            (None if version is None else object()) if name == "triton" else real_find_spec(name, *a)))

        def version_of(name):
            if name != "triton" or version == "no metadata":
                raise importlib.metadata.PackageNotFoundError(name)
            return version
        monkeypatch.setattr(importlib.metadata, "version", version_of)
    return install


@pytest.mark.parametrize("version", ["3.2.0", "3.6.0", "3.10.1", "4.0.0", "3.3.0+git5a2f9c", "no metadata",
                                     "custom-build"])  # a version that cannot be read: a build of its own
def test_a_triton_the_kernels_run_on_is_taken(installed, version):
    installed(version)
    assert gpu.triton_missing() is None


@pytest.mark.parametrize("version", ["3.0.0", "3.1.0", "2.3.1", "3.1.0+rocm6.2"])
def test_an_older_triton_is_named_and_refused(installed, version, monkeypatch):
    installed(version)
    problem = gpu.triton_missing()
    assert problem.startswith(f"Triton {version} is older than 3.2, the oldest the GPU codec runs on")
    assert "torch 2.6" in problem and install_hint("gpu") in problem
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # even where the kernels could otherwise run
    assert not gpu.is_available()


def test_no_triton_is_named(installed):
    installed(None)
    assert gpu.triton_missing().startswith("Triton is not installed (pip install")
    assert not gpu.is_available()
