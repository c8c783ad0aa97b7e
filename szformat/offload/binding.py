"""Bind every parameter and buffer of a module to the checkpoint entry that feeds it, by name.

An offloading runtime streams a tensor from wherever the checkpoint keeps its bytes, so before anything moves each
module tensor must have exactly one entry of the same shape and dtype, and every entry must belong to the module.
Binding checks all of it at once and reports every problem in one error, the way ``load_state_dict`` does, but
stricter on dtypes: a payload is bit-exact only in the dtype it was stored in, so nothing is converted silently.

Tied tensors (several names, one storage: shared embeddings, a submodule registered twice) are bound once, to the
first of their names the checkpoint holds; their other names are recorded as aliases. Non-persistent buffers are
bound when the checkpoint happens to hold them and are not required otherwise, as ``state_dict`` leaves them out.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..errors import BindingError, listing
from ..format import constants as C

__all__ = ["EntryLike", "TensorBinding", "ModuleBinding", "assign_tensor", "bind_module", "module_tensor",
           "snapshot_tensors"]


class EntryLike(Protocol):
    """What binding needs to know of a checkpoint entry (``szformat.format.TensorEntry`` fits)."""

    dtype: str
    """The safetensors dtype name (``"BF16"``, ``"F32"``...)."""
    shape: tuple[int, ...]


@dataclass(frozen=True)
class TensorBinding:
    """One module storage and the checkpoint entry that feeds it.

    ``names`` are every module name that refers to this storage, in module order (more than one for tied tensors);
    ``entry`` is the checkpoint name whose bytes fill it. ``tensor`` is the module's own tensor object.
    """

    entry: str
    names: tuple[str, ...]
    tensor: torch.Tensor
    is_buffer: bool

    @property
    def aliases(self) -> tuple[str, ...]:
        """The names of this storage other than ``entry``."""
        return tuple(name for name in self.names if name != self.entry)


@dataclass(frozen=True)
class ModuleBinding:
    """Every storage of a module bound to its entry; with ``strict=False``, what was tolerated."""

    tensors: tuple[TensorBinding, ...]
    missing: tuple[str, ...] = ()
    """Module names with no entry (they keep the values the module has)."""
    unexpected: tuple[str, ...] = ()
    """Entries that name no module tensor (they are not loaded)."""

    def __iter__(self) -> Iterator[TensorBinding]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def entry_for(self, name: str) -> str:
        """The checkpoint entry that feeds the module tensor called ``name``."""
        for binding in self.tensors:
            if name in binding.names:
                return binding.entry
        raise KeyError(f"module tensor {name!r} is not bound to any checkpoint entry")


@dataclass(frozen=True)
class _ModuleTensor:
    name: str
    tensor: torch.Tensor
    is_buffer: bool
    persistent: bool
    entry: str
    """The checkpoint name this module name is looked up under."""


def bind_module(module: torch.nn.Module, entries: Mapping[str, EntryLike], *, strict: bool = True,
                path: str | os.PathLike | None = None,
                entry_names: Mapping[str, str] | None = None) -> ModuleBinding:
    """Match each parameter and buffer of ``module`` with the entry of the same name in ``entries``.

    Args:
        module (`torch.nn.Module`): the module to load; its tensors may live on any device, ``meta`` included.
        entries (`Mapping[str, EntryLike]`): checkpoint entries by name, e.g. ``SztFile(path).entries``.
        strict (`bool`, *optional*, defaults to `True`): refuse module tensors without an entry and entries without
            a module tensor. Shape and dtype mismatches are refused either way.
        path (`str` or `os.PathLike`, *optional*): the checkpoint, named in the error message.
        entry_names (`Mapping[str, str]`, *optional*): the entry of each module name stored under another name
            (a checkpoint saved with or without a base-model prefix); other names are looked up as they are.

    Returns:
        `ModuleBinding`: one `TensorBinding` per module storage that has an entry.

    Raises:
        BindingError: listing every missing, unexpected, shape-mismatched, dtype-mismatched and conflicting name.

    Example:
        >>> from szformat.format import SztFile  # doctest: +SKIP
        >>> binding = bind_module(model, SztFile("model.szt").entries, path="model.szt")  # doctest: +SKIP
    """
    renamed = entry_names or {}
    groups = _storage_groups(_module_tensors(module, renamed))
    report = _Report()
    bound = []
    for group in groups:
        binding = _bind_group(group, entries, report)
        if binding is not None:
            bound.append(binding)
    known_names = {member.entry for group in groups for member in group}
    report.unexpected = [name for name in entries if name not in known_names]
    if report.refuses(strict):
        raise BindingError(report.render(strict), path=path)
    return ModuleBinding(tensors=tuple(bound), missing=tuple(name for name, _ in report.missing),
                         unexpected=tuple(report.unexpected))


@dataclass
class _Report:
    """Every problem binding found, by kind, in module order (entries in checkpoint order)."""

    missing: list[tuple[str, list[str]]] = field(default_factory=list)
    """(name, its tied aliases) of each storage no entry feeds."""
    unexpected: list[str] = field(default_factory=list)
    shape_mismatch: list[str] = field(default_factory=list)
    dtype_mismatch: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)

    def _sections(self, strict: bool) -> list[tuple[str, list[str]]]:
        missing = [f"{name} (tied with {', '.join(aliases)})" if aliases else name for name, aliases in self.missing]
        return [
            ("missing from the checkpoint", missing if strict else []),
            ("unexpected in the checkpoint", self.unexpected if strict else []),
            ("shape mismatch", self.shape_mismatch),
            ("dtype mismatch", self.dtype_mismatch),
            ("tied tensors stored with different values", self.conflicts),
        ]

    def refuses(self, strict: bool) -> bool:
        return any(items for _, items in self._sections(strict))

    def render(self, strict: bool) -> str:
        sections = [(title, items) for title, items in self._sections(strict) if items]
        lines = ["module does not match the checkpoint: " + ", ".join(f"{len(items)} {title}"
                                                                     for title, items in sections)]
        lines += [f"  {title}: {listing(items, '; ')}" for title, items in sections]
        if self.dtype_mismatch:
            lines.append("  (stored payloads are exact only in their own dtype: convert the module, e.g. "
                         "module.to(torch.bfloat16), before loading)")
        return "\n".join(lines)


def _bind_group(group: list[_ModuleTensor], entries: Mapping[str, EntryLike], report: _Report) -> TensorBinding | None:
    """Bind one storage to the first of its names the checkpoint holds, or record why it cannot be."""
    names = [member.name for member in group]
    stored = [member for member in group if member.entry in entries]
    if not stored:
        required = [member.name for member in group if member.persistent]
        if required:
            report.missing.append((required[0], [name for name in names if name != required[0]]))
        return None
    agrees = True
    for member in stored:
        entry = entries[member.entry]
        if tuple(entry.shape) != tuple(member.tensor.shape):
            report.shape_mismatch.append(f"{member.name}: module {tuple(member.tensor.shape)}, "
                                         f"checkpoint {tuple(entry.shape)}")
            agrees = False
        if _torch_dtype(entry.dtype) != member.tensor.dtype:
            report.dtype_mismatch.append(f"{member.name}: module {_dtype_name(member.tensor.dtype)}, "
                                         f"checkpoint {entry.dtype}")
            agrees = False
    checksums = {getattr(entries[member.entry], "raw_crc32", None) for member in stored} - {None}
    if agrees and len(checksums) > 1:
        report.conflicts.append(", ".join(member.name for member in stored))
        agrees = False
    if not agrees:
        return None
    return TensorBinding(entry=stored[0].entry, names=tuple(names), tensor=group[0].tensor,
                         is_buffer=group[0].is_buffer)


def _module_tensors(module: torch.nn.Module, entry_names: Mapping[str, str]) -> list[_ModuleTensor]:
    """Every parameter and buffer under every name it is reachable by, in module order."""
    found = []
    for prefix, submodule in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for key, parameter in submodule._parameters.items():
            if parameter is not None:
                name = dot + key
                found.append(_ModuleTensor(name, parameter, is_buffer=False, persistent=True,
                                           entry=entry_names.get(name, name)))
        for key, buffer in submodule._buffers.items():
            if buffer is not None:
                name = dot + key
                persistent = key not in submodule._non_persistent_buffers_set
                found.append(_ModuleTensor(name, buffer, is_buffer=True, persistent=persistent,
                                           entry=entry_names.get(name, name)))
    return found


def _storage_groups(tensors: list[_ModuleTensor]) -> list[list[_ModuleTensor]]:
    """Group names that refer to one storage, keeping the order of first appearance."""
    groups: dict[object, list[_ModuleTensor]] = {}
    for member in tensors:
        groups.setdefault(_storage_key(member.tensor), []).append(member)
    return list(groups.values())


def _storage_key(tensor: torch.Tensor) -> object:
    """Tensors with this key share their bytes: the same object, or the same materialized memory and geometry."""
    if tensor.device.type == "meta" or tensor.numel() == 0:
        return ("object", id(tensor))
    return ("memory", str(tensor.device), tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())


def _torch_dtype(name: str) -> torch.dtype | None:
    return C.DTYPES.get(name, (None, 0))[0]


def _dtype_name(dtype: torch.dtype) -> str:
    return C.TORCH_TO_DTYPE.get(dtype, str(dtype).removeprefix("torch."))


def module_tensor(module: torch.nn.Module, name: str) -> torch.Tensor:
    """The parameter or buffer ``name`` (dotted, as in ``state_dict``) of ``module`` as it is now."""
    owner, key = tensor_owner(module, name)
    found = owner._parameters.get(key)
    if found is None:
        found = owner._buffers.get(key)
    if found is None:
        raise KeyError(f"module has no parameter or buffer {name!r}")
    return found


def assign_tensor(module: torch.nn.Module, names: tuple[str, ...], value: torch.Tensor) -> None:
    """Make every name of one storage refer to ``value``, keeping tied names tied.

    Materialized tensors keep their identity (``.data`` is replaced, so references held elsewhere, hooks and
    optimizers included, see the new bytes). A ``meta`` tensor cannot take data; it is replaced by one new
    parameter (or buffer) shared by all of its names.
    """
    replacements: dict[int, torch.Tensor] = {}
    for name in names:
        owner, key = tensor_owner(module, name)
        current = owner._parameters.get(key)
        table = owner._parameters if current is not None else owner._buffers
        current = current if current is not None else owner._buffers[key]
        if current.device.type != "meta":
            current.data = value
            continue
        if id(current) not in replacements:
            replacements[id(current)] = (torch.nn.Parameter(value, requires_grad=current.requires_grad)
                                         if isinstance(current, torch.nn.Parameter) else value)
        table[key] = replacements[id(current)]


def snapshot_tensors(module: torch.nn.Module, names: Iterable[str]) -> Callable[[], None]:
    """Remember what ``names`` refer to now; the returned function puts it all back (after a failed install)."""
    saved = []
    for name in names:
        owner, key = tensor_owner(module, name)
        table = owner._parameters if owner._parameters.get(key) is not None else owner._buffers
        current = table[key]
        saved.append((table, key, current, None if current.device.type == "meta" else current.data))

    def restore() -> None:
        for table, key, tensor, data in saved:
            table[key] = tensor
            if data is not None:
                tensor.data = data

    return restore


def tensor_owner(module: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    """The submodule that holds tensor ``name`` (dotted, as in ``state_dict``), and the tensor's key in it."""
    prefix, _, key = name.rpartition(".")
    return (module.get_submodule(prefix) if prefix else module), key
