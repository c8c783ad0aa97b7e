"""Stored payloads in page-cache pages registered with the CUDA driver, for routes that upload them again and again.

An offloading route copies the same weights to the device at every forward. Copying them through a pinned staging
slot costs a host copy each time (one thread moves a few GB/s); registering the file's pages once lets every later
copy DMA straight out of the page cache at the link's rate. Registering costs about as much as reading the bytes
once, paid at install, and keeps the stored bytes (not the raw ones) resident and pinned while the route runs.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from ..format.reader import SztFile
from ..loading.hostio import RegisteredMapping, default_threads

__all__ = ["register_payloads"]


def register_payloads(files: dict[str, SztFile], names_by_file: dict[str, list[str]], device: torch.device,
                      threads: int | None = None) -> tuple[dict[str, torch.Tensor], list[RegisteredMapping]]:
    """Register the stored payloads of ``names_by_file`` (file path -> entry names) with the driver, once, so that
    every later upload DMAs them straight out of the page cache; returns each registered payload's bytes and the
    mappings that hold them. A file or span the driver refuses is left out: its payloads take the route's other way (a pinned
    slot, a read into a ring).

    The mappings must be closed (:meth:`RegisteredMapping.close`) once no copy out of them is pending.
    """
    payloads: dict[str, torch.Tensor] = {}
    mappings: list[RegisteredMapping] = []
    with ThreadPoolExecutor(threads or default_threads()) as pool:
        for path, names in names_by_file.items():
            mapping = RegisteredMapping.open(path, device)
            if mapping is None:
                continue
            mappings.append(mapping)
            entries = [files[path].entry(name) for name in names]
            spans = [(entry, mapping.register_async(entry.offset, entry.offset + entry.length, pool))
                     for entry in entries if entry.length]
            for entry, registered in spans:
                if registered.result():
                    payloads[entry.name] = mapping.view[entry.offset: entry.offset + entry.length]
    return payloads, mappings
