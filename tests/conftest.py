"""Fixtures shared by the tests: the loopback Hub, decoding refused or moved to the CPU for one-line loading.

Without CUDA the Triton kernels run under the interpreter: ``TRITON_INTERPRET=1`` must be set before any test
module imports them, whatever order the modules are collected in, so it is set here, first.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import threading

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import szformat
from szformat.integrations.model_folder import Prefetch
from support import ALICE, BOB, close_hub_sessions, point_client_at
from huggingface_hub import constants

from hub_server import LoopbackHub


@pytest.fixture
def collector_on():
    """Python's cyclic garbage collector running when the test starts, and as it was once the test ends, whatever the
    test turned on or off."""
    import gc

    was_enabled = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was_enabled else gc.disable)()


@pytest.fixture(params=["mapped", "pread"])
def source_reads(request, monkeypatch) -> str:
    """The converter reading its source through a covered mapping (where mappings are covered here) and through
    ``pread`` copies (elsewhere): a test of what a source that changes or shrinks meanwhile gives runs with both."""
    from support import covers_mappings

    if request.param == "mapped" and not covers_mappings():
        pytest.skip("mappings are not covered here (Linux, C kernels)")
    if request.param == "pread":
        monkeypatch.setattr("szformat.convert.sources.CoveredMapping.of", classmethod(lambda cls, mapping: None))
    return request.param


@pytest.fixture
def no_decoding(monkeypatch):
    """Any decode fails the test: a refused folder must be refused from headers alone."""
    def refuse(*args, **kwargs):
        raise AssertionError("weights were decoded")

    monkeypatch.setattr(szformat.api, "load_file", refuse)


@pytest.fixture
def prefetch_on_the_cpu(monkeypatch):
    """Loads prefetched as for a CUDA device, with the CPU decode standing in for the GPU's (no CUDA in CI): the
    dicts each load returned, and the threads they ran on."""
    import szformat.integrations.transformers as szt

    loads: list[tuple[str, dict]] = []
    decode = szformat.api.load_file

    def recorded(*args, **kwargs):
        tensors = decode(*args, **kwargs)
        loads.append((threading.current_thread().name, tensors))
        return tensors

    @contextlib.contextmanager
    def on_the_cpu(device, *, verify, staging):
        with Prefetch(torch.device("cpu"), verify=verify, staging=staging) as prefetch:
            yield prefetch

    monkeypatch.setattr(szformat.api, "load_file", recorded)
    monkeypatch.setattr(szt, "prefetching", on_the_cpu)
    if importlib.util.find_spec("diffusers") is not None:
        import szformat.integrations.diffusers as szd

        monkeypatch.setattr(szd, "prefetching", on_the_cpu)
    return loads


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A running loopback Hub that huggingface_hub uses by default, with an empty cache and no token."""
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(var, raising=False)
    home = tmp_path / "hf_home"
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True, raising=False)  # huggingface_hub < 0.32: no Xet
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(home / "stored_tokens"), raising=False)  # < 0.26
    server = LoopbackHub(tokens={ALICE: "alice", BOB: "bob"}).start()
    point_client_at(monkeypatch, server.endpoint)
    yield server
    server.stop()
    close_hub_sessions()  # drop kept-alive connections to this server
