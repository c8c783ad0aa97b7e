"""Installing the DDO routes (``staging``, ``native``) on a module bound to a .szt checkpoint.

1. Every bound storage becomes a placeholder (:mod:`.placeholders`), and a DDO ``SafetensorSliceRegistry`` on the
   module maps each placeholder to its :class:`~.ddo_compat.SztFileSlice`: DDO's own protocol for learning where
   checkpoint bytes are, used as ``from_pretrained_with_dynamic_offload`` uses it.
2. DDO builds its runtime (``enable_offload``) while its staging pool, or its native transport and weight store, is
   substituted by szformat's subclass (:mod:`.ddo_staging`, :mod:`.ddo_native`).
3. szformat attaches its decoder to the objects DDO built, checks that every tensor DDO streams has a .szt slice,
   and decodes every tensor DDO does not stream (embeddings, norms, biases) into its place on the device, once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import diffusers_dynamic_offloader as ddo
import torch
from ddo_vmm_allocator import model_arena_adapter
from diffusers_dynamic_offloader import vmm_weight_store

from ..errors import DecodeRouteError
from ..loading import SlotDecoder
from .binding import ModuleBinding, assign_tensor, module_tensor, snapshot_tensors
from .ddo_compat import SztFileSlice, check_ddo, check_members, ddo_config, native_library, substituted
from .ddo_native import SztArenaWeightStore, SztNativeShardTransport
from .ddo_staging import StagingContext, SztStagingPool, group_destinations
from .registered import RegisteredPages
from .decoding import CheckpointDecoder
from .handle import OffloadedModel
from .install import Installation
from .placeholders import Placeholders

__all__ = ["install_staging", "install_native"]

Streamed = Callable[[torch.Tensor], bool]
"""Whether a module tensor (as it is after DDO's setup) is one DDO streams."""


def install_staging(installation: Installation) -> OffloadedModel:
    """The ``staging`` route: DDO ``vmm_runtime`` with :class:`SztStagingPool`."""
    substitutions = [(vmm_weight_store, "PinnedStagingPool", vmm_weight_store.PinnedStagingPool, SztStagingPool)]
    return _install(installation, substitutions, _attach_staging, _staging_counters)


def install_native(installation: Installation) -> OffloadedModel:
    """The ``native`` route: DDO ``vmm_fast`` native transport with :class:`SztNativeShardTransport`."""
    substitutions = [
        (model_arena_adapter, "ModelArenaWeightStore", model_arena_adapter.ModelArenaWeightStore, SztArenaWeightStore),
        (model_arena_adapter, "_NativeShardTransport", model_arena_adapter._NativeShardTransport,
         SztNativeShardTransport),
    ]
    return _install(installation, substitutions, _attach_native, _native_counters)


@dataclass
class _Setup:
    installation: Installation
    placeholders: Placeholders
    registry: Any


def _install(installation: Installation, substitutions: list, attach: Callable[[Any, _Setup], Streamed],
             counters: Callable[[Any], dict[str, int]]) -> OffloadedModel:
    check_ddo(installation.environment)
    device = _indexed(installation.device)
    config = ddo_config(installation.route.name, device, installation.options)
    module, binding, checkpoint = installation.module, installation.binding, installation.checkpoint
    restore = snapshot_tensors(module, [name for tensor in binding for name in tensor.names])
    placeholders = Placeholders(binding)
    placeholders.install(module, binding)
    setup = _Setup(installation, placeholders, _slice_registry(installation, placeholders))
    module._ddo_safetensor_slices = setup.registry
    module._ddo_safetensor_slice_summary = {"bound": setup.registry.descriptor_count, "available": len(binding),
                                            "resolver": "szformat"}
    try:
        with contextlib.ExitStack() as stack:
            for substitution in substitutions:
                stack.enter_context(substituted(*substitution))
            stack.enter_context(native_library(installation.environment.native_library))
            result = ddo.enable_offload(module, config=config, route="dynamic_offload", use_environment=False,
                                        execution_device=device)
        streamed = attach(result.hook, setup)
        decoder = CheckpointDecoder(checkpoint, device, installation.route.decoder)
        try:
            _place_resident(module, binding, decoder, streamed)
        finally:
            decoder.close()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # the one-time loader's slots: give them back rather than keep them cached
    except BaseException:
        _remove(module)
        restore()
        raise

    def release() -> None:
        _remove(module)
        placeholders.close()

    return OffloadedModel(module, installation.route, checkpoint, engine=result, setup_bytes=decoder.bytes_moved,
                          counters=lambda: counters(result.hook), release=release)


def _slice_registry(installation: Installation, placeholders: Placeholders) -> Any:
    """DDO's registry of placeholder -> .szt slice. Storages whose dtype DDO cannot name stay unregistered: DDO
    does not stream those (the coverage checks after setup would refuse it if it did)."""
    registry = vmm_weight_store.SafetensorSliceRegistry()
    for tensor in installation.binding:
        file = installation.checkpoint.file(tensor.entry)
        registry.bind(placeholders.views[tensor.entry], SztFileSlice.of(file.path, file.entry(tensor.entry)))
    return registry


def _attach_staging(hook: Any, setup: _Setup) -> Streamed:
    check_members(hook, ("_vmm_staging_pool", "_vmm_upload_stream", "_vmm_arena"), "vmm_runtime hook")
    pool, arena = hook._vmm_staging_pool, hook._vmm_arena
    if not isinstance(pool, SztStagingPool):
        raise DecodeRouteError(f"DDO built a {type(pool).__name__}, not szformat's staging pool")
    if arena is None:
        return lambda tensor: False  # DDO found no block list to stream: every tensor is placed on the device
    check_members(arena, ("_native", "weight"), "vmm_runtime arena")
    groups = arena._native.packed_source_groups()
    installation = setup.installation
    files = {str(file.path): file for file in installation.checkpoint.files}
    context = StagingContext(files=files, placeholders=setup.placeholders, decoder=None, stream=hook._vmm_upload_stream,
                             destinations=group_destinations(groups, arena.weight, setup.registry.lookup))
    if installation.route.decoder == "triton":
        context.decoder = SlotDecoder(installation.device)
        context.pages = RegisteredPages.register(
            _extents(setup.registry.lookup(source) for _, pairs in groups for _, source in pairs), installation.device)
    pool.attach(context)
    sources = {source.data_ptr() for _, pairs in groups for _, source in pairs}
    return lambda tensor: tensor.device.type == "cpu" and tensor.data_ptr() in sources


def _attach_native(hook: Any, setup: _Setup) -> Streamed:
    check_members(hook, ("_vmm_fast_store", "_vmm_fast_adapter"), "vmm_fast hook")
    store, adapter = hook._vmm_fast_store, hook._vmm_fast_adapter
    check_members(store, ("_native_shard_transport",), "vmm_fast weight store")
    check_members(adapter, ("_address_bindings",), "vmm_fast module adapter")
    transport = store._native_shard_transport
    check_members(transport, ("window_size_bytes", "ring", "cache", "_pending"), "vmm_fast native transport")
    check_members(transport.ring, ("slot_address", "wait_file_read"), "vmm_fast native host ring")
    if not isinstance(store, SztArenaWeightStore) or not isinstance(transport, SztNativeShardTransport):
        raise DecodeRouteError(f"DDO built a {type(store).__name__} with a {type(transport).__name__}, not "
                               "szformat's native transport")
    if transport.cache is not None:
        raise DecodeRouteError("DDO's native source cache is on; it reads around szformat's transport")
    bindings = list(adapter._address_bindings.values())
    uncovered = [binding.label for binding in bindings if not isinstance(binding.file_slice, SztFileSlice)]
    if uncovered:
        raise DecodeRouteError(f"DDO streams {len(uncovered)} tensor(s) szformat has no checkpoint slice for "
                               f"({', '.join(uncovered[:5])}); their CPU tensors hold no weights")
    store.attach(setup.installation.checkpoint)
    pages = RegisteredPages.register(_extents(binding.file_slice for binding in bindings), setup.installation.device)
    transport.attach(SlotDecoder(setup.installation.device), pages)
    streamed = set(adapter._address_bindings)
    return lambda tensor: tensor.device.type == "cuda" and tensor.data_ptr() in streamed


def _extents(slices: Iterable[SztFileSlice]) -> dict[str, list[tuple[int, int]]]:
    """File path -> ``(offset, stored length)`` of each slice: what a route registers for DMA."""
    extents: dict[str, list[tuple[int, int]]] = {}
    for file_slice in slices:
        extents.setdefault(str(file_slice.path), []).append((file_slice.offset_bytes, file_slice.stored_bytes))
    return extents


def _place_resident(module: torch.nn.Module, binding: ModuleBinding, decoder: CheckpointDecoder,
                    streamed: Streamed) -> None:
    """Decode every bound storage DDO does not stream into its place: over the copy DDO moved to the device (its
    placeholder's zeros), or into a new device tensor where DDO left it on the CPU."""
    pending = [tensor for tensor in binding if not streamed(module_tensor(module, tensor.names[0]))]
    values = decoder.load(tensor.entry for tensor in pending)
    with torch.no_grad():
        for tensor in pending:
            current, value = module_tensor(module, tensor.names[0]), values[tensor.entry]
            if current.device == decoder.device:
                current.copy_(value.view(current.shape))
            else:
                assign_tensor(module, tensor.names, value)


def _staging_counters(hook: Any) -> dict[str, int]:
    arena = hook._vmm_arena
    if arena is None:
        return {"h2d_bytes": 0}
    stats, pool = arena.stats, hook._vmm_staging_pool
    return {"h2d_bytes": pool.copied_bytes, "raw_bytes_uploaded": stats.copied_bytes,
            "stored_bytes_read": pool.transport_stats.shard_read_bytes}


def _native_counters(hook: Any) -> dict[str, int]:
    store = hook._vmm_fast_store
    stats = store.runtime_stats()
    names = {"raw_bytes_uploaded": "upload_bytes", "uploads": "uploads", "temporary_bytes": "temporary_bytes"}
    return {"h2d_bytes": store._native_shard_transport.copied_bytes,
            **{key: int(stats.get(source, 0)) for key, source in names.items()}}


def _remove(module: torch.nn.Module) -> None:
    ddo.remove_dynamic_offload(module)
    for name in ("_ddo_safetensor_slices", "_ddo_safetensor_slice_summary"):
        if name in module.__dict__:
            delattr(module, name)


def _indexed(device: torch.device) -> torch.device:
    return device if device.index is not None else torch.device(device.type, torch.cuda.current_device())
