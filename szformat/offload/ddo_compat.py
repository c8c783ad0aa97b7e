"""What szformat needs of diffusers-dynamic-offloader (DDO), checked before use, and how it steps into DDO.

szformat feeds DDO through DDO's own checkpoint-slice protocol (a ``SafetensorSliceRegistry`` on the module) and
substitutes two or three of DDO's classes by szformat subclasses while DDO builds its runtime for one module. Those
classes and their methods are DDO internals, so the supported DDO releases are pinned exactly, and before anything
is installed every name szformat relies on is probed: a DDO that moved one is refused with what it lacks, rather
than failing half-way through a forward pass.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import diffusers_dynamic_offloader as ddo
from ddo_vmm_allocator import model_arena_adapter
from diffusers_dynamic_offloader import vmm_weight_store

from .._install import install_hint
from .._versions import parse_version
from ..errors import DecodeRouteError
from ..format.header import TensorEntry
from .routes import (
    DDO_ALLOCATOR_DISTRIBUTION,
    DDO_DISTRIBUTION,
    DDO_LIBRARY_ENV,
    NATIVE,
    SUPPORTED_DDO_VERSIONS,
    OffloadEnvironment,
)

__all__ = ["REFUSED_OPTIONS", "SEAMS", "SztFileSlice", "check_ddo", "check_members", "ddo_config", "native_library",
           "substituted"]

SEAMS: dict[Any, tuple[str, ...]] = {
    vmm_weight_store.PinnedStagingPool: ("begin_upload", "stage", "stage_file_slice", "stage_file_slices",
                                         "stage_file_slices_async", "mark_upload", "has_active_upload",
                                         "packed_bytes", "_active_buffer", "_record_shard_read", "close"),
    vmm_weight_store.SafetensorSliceRegistry: ("bind", "lookup"),
    model_arena_adapter._NativeShardTransport: ("_window_ranges", "upload_ticket", "upload_batch", "_begin_windows",
                                                "_acquire_slot", "ticket_active", "begin_read", "discard_ticket",
                                                "close"),
    model_arena_adapter.ModelArenaWeightStore: ("temporary_source",),
}
"""Every DDO class szformat subclasses or calls into, and the methods it relies on. Attributes DDO sets in
``__init__`` are probed on the constructed objects (:func:`check_members`)."""

REFUSED_OPTIONS: dict[str, str] = {
    "vmm_host_cache_gb": "registers the module's CPU tensors for direct DMA, but they hold no weights",
    "vmm_pin_source_weights": "pins the module's CPU tensors, but they hold no weights",
    "vmm_native_source_cache_slot_mb": "the native source cache reads around szformat's transport",
    "vmm_native_source_cache_slots": "the native source cache reads around szformat's transport",
    "vmm_source_cache_gb": "the native source cache reads around szformat's transport",
    "vmm_source_registered_gb": "the native source cache reads around szformat's transport",
    "vmm_component_tensor_ownership": "component ownership streams tensors szformat does not decode",
    "vmm_execution_auxiliary_ownership": "auxiliary ownership streams tensors szformat does not decode",
    "vmm_float8_weight_only": "FP8 weights are stored raw; load them with DDO's own loader",
    "vmm_virtual_host_transport": "Windows registered staging bypasses the staging pool's file reads",
    "execution_mode": "the route decides it",
}
"""DDO options that would read module tensors or file bytes past szformat: refused, with the reason."""

_STRUCTURE_LOCK = threading.RLock()


@dataclass(frozen=True)
class SztFileSlice(vmm_weight_store.SafetensorFileSlice):
    """DDO's description of where a tensor's bytes are, for a tensor stored in a .szt file.

    ``size_bytes`` is the RAW size (what DDO's registry, group sizes and arena layout count); ``entry`` says how many
    bytes are stored at ``offset_bytes`` (``entry.length``) and how to expand them.
    """

    entry: TensorEntry | None = None

    @classmethod
    def of(cls, path: os.PathLike, entry: TensorEntry) -> "SztFileSlice":
        return cls(path=path, offset_bytes=entry.offset, size_bytes=entry.raw_length, shape=tuple(entry.shape),
                   dtype=entry.dtype, entry=entry)

    @property
    def stored_bytes(self) -> int:
        return self.entry.length


def check_ddo(env: OffloadEnvironment) -> None:
    """Refuse a DDO whose version or structure szformat does not know, naming what differs."""
    supported = ", ".join(SUPPORTED_DDO_VERSIONS)
    for distribution in (DDO_DISTRIBUTION, DDO_ALLOCATOR_DISTRIBUTION):
        version = env.versions.get(distribution) or _installed(distribution)
        if version is None or parse_version(version) not in {parse_version(v) for v in SUPPORTED_DDO_VERSIONS}:
            raise DecodeRouteError(f"{distribution} {version} is not supported (szformat supports {supported}; "
                                   f"{install_hint('ddo')})")
    for cls, members in SEAMS.items():
        missing = [m for m in members if not hasattr(cls, m)]
        if missing:
            raise DecodeRouteError(f"{DDO_DISTRIBUTION} {_installed(DDO_DISTRIBUTION)} lacks "
                                   f"{cls.__name__}.{', '.join(missing)}; szformat supports {supported}")
    fields = {f.name for f in dataclasses.fields(vmm_weight_store.SafetensorFileSlice)}
    if not {"path", "offset_bytes", "size_bytes", "shape", "dtype"} <= fields:
        raise DecodeRouteError(f"{DDO_DISTRIBUTION} {_installed(DDO_DISTRIBUTION)} changed SafetensorFileSlice "
                               f"(fields {sorted(fields)}); szformat supports {supported}")


def check_members(obj: Any, members: tuple[str, ...], what: str) -> None:
    """Refuse a constructed DDO object that lacks attributes szformat reads."""
    missing = [m for m in members if not hasattr(obj, m)]
    if missing:
        raise DecodeRouteError(f"{DDO_DISTRIBUTION} {_installed(DDO_DISTRIBUTION)} built a {what} without "
                               f"{', '.join(missing)}; szformat supports {', '.join(SUPPORTED_DDO_VERSIONS)}")


def ddo_config(route: str, device: Any, options: Mapping[str, Any]) -> Any:
    """DDO's configuration for ``route`` (``"staging"``: ``vmm_runtime``; ``"native"``: ``vmm_fast`` with native
    transport), with the caller's DDO options applied, except those that would bypass szformat's transport."""
    refused = [f"{name} ({REFUSED_OPTIONS[name]})" for name in options
               if name in REFUSED_OPTIONS and options[name] not in (None, False, 0, 0.0)]
    if refused:
        raise ValueError("these DDO options cannot be used with a .szt checkpoint: " + "; ".join(refused))
    known = {f.name for f in dataclasses.fields(ddo.DynamicOffloadConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown DDO options: {', '.join(unknown)}")
    backend = ddo.resolve_dynamic_offload_backend("vmm", "auto" if route == NATIVE else "nvme_baseline")
    settings = dict(options, execution_device=str(device))
    if route == NATIVE:
        settings["vmm_native_transport"] = True
    return backend.build_config(**settings)


@contextlib.contextmanager
def substituted(owner: Any, name: str, expected: type, replacement: type) -> Iterator[None]:
    """Let ``owner.name`` be ``replacement`` (a subclass of ``expected``) while DDO constructs its runtime.

    DDO looks these classes up at construction time, so only the objects built inside this block are szformat's;
    the attribute is restored on exit. A process-wide lock keeps two installs from interleaving.
    """
    with _STRUCTURE_LOCK:
        current = getattr(owner, name, None)
        if current is not expected:
            raise DecodeRouteError(f"{owner.__name__}.{name} is {current!r}, not DDO's own {expected.__name__}: "
                                   "another package replaced it; szformat cannot install its transport")
        setattr(owner, name, replacement)
        try:
            yield
        finally:
            setattr(owner, name, expected)


@contextlib.contextmanager
def native_library(path: str | None) -> Iterator[None]:
    """Point DDO at its native library while it loads it, when the environment does not already."""
    if os.environ.get(DDO_LIBRARY_ENV) or path is None:
        yield
        return
    os.environ[DDO_LIBRARY_ENV] = path
    try:
        yield
    finally:
        os.environ.pop(DDO_LIBRARY_ENV, None)


def _installed(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
