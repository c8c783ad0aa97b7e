"""Other projects' fastest ways from a safetensors file to CUDA tensors, each as one function, for the same-run peer
rows of ``tools/bench_load.py``.

Every loader takes the file's path and returns ``{name: tensor on the current CUDA device}``, owning its memory, so
that it can be timed and checked bit for bit like ``szformat.load_file(..., device="cuda")``. Each is written the
way its project documents it, with its defaults unless named:

==========================  ======================================================================================
``safetensors``             ``safetensors.torch.load_file(path, device="cuda")``
``instanttensor``           InstantTensor ``safe_open(...).tensors()``, default backend (io_uring or AIO direct I/O
                            on a disk file, mmap on tmpfs)
``instanttensor-buffered``  the same with ``backend=BackendPolicy.BUFFERED`` (buffered io_uring, else mmap)
``fastsafetensors``         ``fastsafe_open(path, device="cuda:N", nogds=True)`` (pread through a bounce buffer)
``runai``                   Run:ai Model Streamer ``SafetensorsStreamer.stream_file(path, device="cuda:N")``
==========================  ======================================================================================
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Callable

import torch

__all__ = ["PEERS", "PeerLoader", "available_peers"]

PeerLoader = Callable[[Path], dict[str, torch.Tensor]]


def _device() -> str:
    return f"cuda:{torch.cuda.current_device()}"


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path, device=_device())


def instanttensor(buffered: bool) -> PeerLoader:
    def load(path: Path) -> dict[str, torch.Tensor]:
        from instanttensor import BackendPolicy, safe_open

        backend = BackendPolicy.BUFFERED if buffered else None
        with safe_open(str(path), framework="pt", device=torch.cuda.current_device(), backend=backend) as f:
            return dict(f.tensors())

    return load


def load_fastsafetensors(path: Path) -> dict[str, torch.Tensor]:
    from fastsafetensors import fastsafe_open

    with fastsafe_open(str(path), framework="pt", device=_device(), nogds=True) as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def load_runai(path: Path) -> dict[str, torch.Tensor]:
    from runai_model_streamer import SafetensorsStreamer

    with SafetensorsStreamer() as streamer:
        streamer.stream_file(str(path), device=_device())
        return dict(streamer.get_tensors())


PEERS: dict[str, tuple[str, PeerLoader]] = {
    "safetensors": ("safetensors", load_safetensors),
    "instanttensor": ("instanttensor", instanttensor(buffered=False)),
    "instanttensor-buffered": ("instanttensor", instanttensor(buffered=True)),
    "fastsafetensors": ("fastsafetensors", load_fastsafetensors),
    "runai": ("runai_model_streamer", load_runai),
}
"""Peer name -> (the module it imports, its loader)."""


def available_peers(names: list[str]) -> tuple[dict[str, PeerLoader], dict[str, str]]:
    """The loaders of ``names`` whose package imports here, and for each other one the reason it is skipped."""
    loaders, skipped = {}, {}
    for name in names:
        module, load = PEERS[name]
        try:
            importlib.import_module(module)
        except Exception as error:  # an installed package can fail at import too (a missing native library)
            skipped[name] = f"import {module} failed: {type(error).__name__}: {error}"
        else:
            loaders[name] = load
    return loaders, skipped
