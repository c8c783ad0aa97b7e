"""Fixtures shared by the tests of one-line loading (transformers, diffusers, their conversions)."""

from __future__ import annotations

import contextlib
import importlib.util
import threading

import pytest
import torch

import szformat
from szformat.model_folder import Prefetch


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
    import szformat.transformers as szt

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
        import szformat.diffusers as szd

        monkeypatch.setattr(szd, "prefetching", on_the_cpu)
    return loads
