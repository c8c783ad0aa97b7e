"""The ``diffusers_group`` route: diffusers' group offloading, with szformat moving and decoding the weights.

``apply_group_offloading`` cuts a model into module groups (blocks, or leaf layers) and hooks each group's leader
modules: before the group runs its ``ModuleGroup.onload_()`` puts every tensor of the group on the device, after it
``offload_()`` puts them back. Those two methods are all the hooks call, so szformat replaces them on each group
instance (nothing in diffusers is patched globally): ``onload_`` decodes the group's tensors from the checkpoint
onto the device (compressed bytes over PCIe and Triton expansion, or the CPU decoder where Triton is absent) and
``offload_`` points them back at their placeholders, which hold no bytes. The original would keep (and pin) raw CPU
copies; here host memory holds only the compressed file. Loads are synchronous, so stream prefetching brings no
overlap with this route.
"""

from __future__ import annotations

import inspect
from typing import Any

import diffusers
import torch
from diffusers.hooks import HookRegistry, apply_group_offloading

from .binding import module_tensor, snapshot_tensors
from .decoding import CheckpointDecoder
from .handle import OffloadedModel
from .install import Installation
from .placeholders import Placeholders

__all__ = ["install_group_offloading", "OPTIONS"]

OPTIONS = {"offload_type": "block_level", "num_blocks_per_group": 1, "use_stream": False, "record_stream": False,
           "block_modules": None}
"""Options this route passes to ``apply_group_offloading``, with their defaults."""

HOOK_NAMES = ("lazy_prefetch_group_offloading", "layer_execution_tracker", "group_offloading")


def install_group_offloading(installation: Installation) -> OffloadedModel:
    """Apply diffusers' group offloading to the module, fed from the checkpoint."""
    unknown = sorted(set(installation.options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"unknown diffusers group offloading options: {', '.join(unknown)} "
                         f"(known: {', '.join(OPTIONS)})")
    options = _supported({**OPTIONS, **installation.options})
    module, binding, device = installation.module, installation.binding, installation.device
    restore = snapshot_tensors(module, [name for tensor in binding for name in tensor.names])
    placeholders = Placeholders(binding)
    placeholders.install(module, binding)
    entries = {id(module_tensor(module, name)): tensor.entry for tensor in binding for name in tensor.names}
    decoder = CheckpointDecoder(installation.checkpoint, device, installation.route.decoder)
    try:
        apply_group_offloading(module, onload_device=device, offload_device=torch.device("cpu"),
                               low_cpu_mem_usage=True, **options)
        for group in _groups(module):
            _feed(group, entries, decoder, placeholders)
    except BaseException:
        _remove(module)
        decoder.close()
        restore()
        raise

    def release() -> None:
        _remove(module)
        decoder.close()
        placeholders.close()

    return OffloadedModel(module, installation.route, installation.checkpoint,
                          counters=lambda: {"h2d_bytes": decoder.bytes_moved}, release=release)


def _supported(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` as this diffusers' ``apply_group_offloading`` takes them: one left at ``None`` (its default) is
    not passed, so a diffusers that predates it (0.35 has no ``block_modules``) works; one set is refused by name
    when this diffusers lacks it."""
    parameters = inspect.signature(apply_group_offloading).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return options
    lacking = sorted(name for name, value in options.items() if name not in parameters and value is not None)
    if lacking:
        raise ValueError(f"diffusers {diffusers.__version__} group offloading has no option "
                         f"{', '.join(map(repr, lacking))}: a newer diffusers has")
    return {name: value for name, value in options.items() if name in parameters}


def _groups(module: torch.nn.Module) -> list[Any]:
    """Every distinct module group the hooks of ``module`` onload and offload."""
    groups: dict[int, Any] = {}
    for submodule in module.modules():
        registry = getattr(submodule, "_diffusers_hook", None)
        hook = registry.get_hook("group_offloading") if registry is not None else None
        if hook is not None:
            groups.setdefault(id(hook.group), hook.group)
    return list(groups.values())


def _group_tensors(group: Any) -> list[torch.Tensor]:
    """The tensors ``onload_`` moves, each once, in the order the original visits them."""
    found: dict[int, torch.Tensor] = {}
    for member in group.modules:
        for tensor in (*member.parameters(), *member.buffers()):
            found.setdefault(id(tensor), tensor)
    for tensor in (*group.parameters, *group.buffers):
        found.setdefault(id(tensor), tensor)
    return list(found.values())


def _feed(group: Any, entries: dict[int, str], decoder: CheckpointDecoder, placeholders: Placeholders) -> None:
    """Replace this group's ``onload_``/``offload_`` by decoding from the checkpoint and returning to placeholders.

    Tensors with no checkpoint entry (non-persistent buffers the module computes itself) move as diffusers moves
    them: to the device and back to their CPU copy.
    """
    tensors = _group_tensors(group)
    stored = [(tensor, entries[id(tensor)]) for tensor in tensors if id(tensor) in entries]
    own = [(tensor, tensor.data) for tensor in tensors if id(tensor) not in entries]

    def onload_() -> None:
        if group.stream is not None:
            group.stream.synchronize()  # as diffusers' own onload: the previous transfer is complete
        values = decoder.load(entry for _, entry in stored)
        for tensor, entry in stored:
            tensor.data = values[entry].view(tensor.shape)
        for tensor, cpu in own:
            tensor.data = cpu.to(group.onload_device)

    def offload_() -> None:
        if group.stream is not None and not group.record_stream:
            torch.cuda.current_stream(group.onload_device).synchronize()
        for tensor, entry in stored:
            tensor.data = placeholders.views[entry]
        for tensor, cpu in own:
            tensor.data = cpu

    group.onload_ = onload_
    group.offload_ = offload_


def _remove(module: torch.nn.Module) -> None:
    for submodule in module.modules():
        registry = getattr(submodule, "_diffusers_hook", None)
        if isinstance(registry, HookRegistry):
            for name in HOOK_NAMES:
                if registry.get_hook(name) is not None:
                    registry.remove_hook(name, recurse=False)
