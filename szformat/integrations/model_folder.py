"""What ``szformat.transformers`` and ``szformat.diffusers`` share: finding a converted model folder (local, or a Hub
repo), refusing what is not one, building a module without allocating its weights, and filling it from .szt.

A module is built with its parameters on the ``meta`` device and its buffers real: buffers that no checkpoint holds
(rotary frequencies, position ids) get the values the module's own ``__init__`` computes, as with a plain load.
Parameters are then replaced by the decoded tensors themselves (``load_state_dict(assign=True)``): the bytes decoded
on the device are the bytes the model uses, with no second copy.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import torch

from .._install import install_hint
from ..errors import (
    CheckpointMismatchError,
    MissingDependencyError,
    ModelFolderError,
    listing,
)
from ..format import constants as C
from ..format.index import INDEX_TAIL, load_checkpoint
from ..paths import refuse_hub_options

SAFETENSORS_SUFFIX = ".safetensors"
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
"""A plain Hub repo id (``namespace/name``), as transformers and diffusers accept one in place of a folder."""


def require(package: str, extra: str) -> ModuleType:
    """Import an optional package, or say which extra installs it."""
    try:
        return importlib.import_module(package)
    except ImportError as e:
        raise MissingDependencyError(f"{package} is not installed ({e}); {install_hint(extra)}") from None


def resolve_model_folder(path_or_repo: str | os.PathLike, *, revision: str | None = None,
                         token: str | bool | None = None, cache_dir: str | os.PathLike | None = None,
                         local_files_only: bool = False) -> Path:
    """The local folder of a converted model: a folder as given, or the download of a Hub repo.

    ``path_or_repo`` is a local folder, ``hf://namespace/name[@revision][/folder]``, or a plain repo id
    (``namespace/name``) that is not a local path. Hub keywords go to ``huggingface_hub``.

    Raises:
        HubReferenceError: Hub keywords with a local folder, or a malformed reference.
        ModelFolderError: neither an existing folder nor a Hub repo.
    """
    text = os.fspath(path_or_repo)
    hub_kwargs = dict(revision=revision, token=token, cache_dir=cache_dir, local_files_only=local_files_only)
    local = Path(text)
    if not text.startswith("hf://") and local.exists():
        refuse_hub_options(text, hub_kwargs, "Hub repos, and this is a local path")
        if not local.is_dir():
            raise ModelFolderError("expected a converted model folder (config and .szt files), got a file; pass "
                                   "its folder, or load the file with szformat.load_file", path=text)
        return local
    if text.startswith("hf://") or (isinstance(path_or_repo, str) and _REPO_ID.fullmatch(text)):
        from ..hub import download_model_repo

        return download_model_repo(text if text.startswith("hf://") else "hf://" + text, **hub_kwargs)
    raise ModelFolderError("no such folder (nor a Hub repo id namespace/name)", path=text)


def has_weights(folder: Path, suffix: str) -> bool:
    """Whether ``folder`` (not its sub-folders) holds weight files or an index with this suffix."""
    return any(folder.glob("*" + suffix)) or any(folder.glob("*" + suffix + INDEX_TAIL))


def weights_in(folder: Path, variant: str | None = None) -> Path:
    """The checkpoint a loader reads in a model folder: its sharded index, else its .szt file, else all its .szt
    files (shards without an index). ``variant`` (``"fp16"``...) picks ``<name>.<variant>.szt`` files and
    ``<name>.<variant>.szt.index.json`` indexes, as transformers' and diffusers' ``variant=`` does; without it,
    files whose name carries a variant are left out.

    Raises:
        ModelFolderError: no .szt checkpoint of that variant, or several that could be meant.
    """
    def variant_of(path: Path, suffix: str) -> str | None:
        stem = path.name[: -len(suffix)]
        return stem.rpartition(".")[2] if "." in stem else None

    indexes = [p for p in sorted(folder.glob("*" + C.INDEX_SUFFIX)) if variant_of(p, C.INDEX_SUFFIX) == variant]
    files = sorted(folder.glob("*" + C.FILE_SUFFIX))
    picked = [p for p in files if variant_of(p, C.FILE_SUFFIX) == variant]
    named = f"variant {variant!r} " if variant else ""
    if len(indexes) == 1:
        return indexes[0]
    if not indexes and len(picked) == 1:
        return picked[0]
    if not indexes and picked and picked == files:
        return folder
    if not indexes and not picked:
        held = ", ".join(p.name for p in files) or "none"
        raise ModelFolderError(f"no .szt checkpoint of {named or 'the default variant '}in the folder (.szt files: "
                               f"{held})", path=folder)
    candidates = ", ".join(p.name for p in (indexes or picked))
    raise ModelFolderError(f"several .szt checkpoints of {named or 'the default variant '}in the folder "
                           f"({candidates}); keep one, or add an index", path=folder)


def require_converted(folder: Path, config_name: str, what: str) -> None:
    """Refuse a folder without ``config_name`` or without .szt weights, pointing a safetensors one to szconvert.

    Raises:
        ModelFolderError: saying what is missing.
    """
    if not (folder / config_name).is_file():
        raise ModelFolderError(f"no {config_name} in the folder: not a {what}", path=folder)
    if has_weights(folder, C.FILE_SUFFIX):
        return
    if has_weights(folder, SAFETENSORS_SUFFIX):
        raise ModelFolderError(f"the folder holds safetensors weights, not .szt; convert it first: "
                               f"szconvert {folder} {folder}-szt", path=folder)
    raise ModelFolderError("no .szt weights in the folder", path=folder)


@contextlib.contextmanager
def parameters_on_meta(dtype: torch.dtype | None) -> Iterator[None]:
    """Build modules with parameters on ``meta`` and real buffers, floating tensors in ``dtype`` by default."""
    from accelerate import init_empty_weights

    previous = torch.get_default_dtype()
    if dtype is not None:
        torch.set_default_dtype(dtype)
    try:
        with init_empty_weights(include_buffers=False):
            yield
    finally:
        torch.set_default_dtype(previous)


class Conversion(Protocol):
    """Checkpoint entries turned into module tensors after they are decoded, all together (per-expert tensors fused
    into one, a fused projection split: see ``transformers_conversions``)."""

    entries: list[str]
    """The checkpoint entries it consumes."""
    targets: dict[str, tuple[int, ...]]
    """Module name -> shape of each tensor it gives."""

    def apply(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Take its entries out of the decoded ``tensors`` and return its module tensors, on the same device."""


@dataclass
class WeightPlan:
    """How checkpoint entries fill a module built on ``meta``: which entry feeds which module name, and what does
    not fit. Names follow ``load_state_dict``: module names are ``state_dict`` keys."""

    sources: dict[str, str] = field(default_factory=dict)
    """Module name -> checkpoint entry that fills it."""
    conversions: list[Conversion] = field(default_factory=list)
    """Groups of entries that fill module names together, once decoded."""
    missing: list[str] = field(default_factory=list)
    """Module names nothing fills (tied names are resolved later, by tying)."""
    unexpected: list[str] = field(default_factory=list)
    """Names (as renamed) of entries that fill no module name."""
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    """(module name, checkpoint shape, module shape) of each entry whose shape does not fit."""

    def describe_mismatches(self) -> str:
        return listing([f"{name}: checkpoint {list(stored)}, model {list(expected)}"
                         for name, stored, expected in self.mismatched])


def plan_weights(expected: Mapping[str, torch.Tensor], entries: Mapping[str, Any],
                 rename: Callable[[str], str] = lambda name: name,
                 conversions: Sequence[Conversion] = ()) -> WeightPlan:
    """Match module tensors (``state_dict`` of the module on ``meta``) with checkpoint entries.

    ``entries`` are checkpoint entries by name (``TensorEntry``: only ``shape`` is read); ``rename(entry_name)``
    gives the module name an entry is meant for (a prefix added or removed); the entries of ``conversions`` fill
    their targets instead, a conversion being kept only where all its targets fit.
    """
    plan = WeightPlan()
    converted = {name for conversion in conversions for name in conversion.entries}
    for name, entry in entries.items():
        target = rename(name) if name not in converted else None
        if target is not None and _fits(plan, expected, target, tuple(entry.shape)):
            plan.sources[target] = name
    for conversion in conversions:
        fits = [_fits(plan, expected, target, shape) for target, shape in conversion.targets.items()]
        if all(fits):
            plan.conversions.append(conversion)
    filled = set(plan.sources) | {target for conversion in plan.conversions for target in conversion.targets}
    mismatched = {name for name, _, _ in plan.mismatched}
    plan.missing = [name for name in expected if name not in filled and name not in mismatched]
    plan.unexpected = list(dict.fromkeys(plan.unexpected))
    return plan


def _fits(plan: WeightPlan, expected: Mapping[str, torch.Tensor], target: str, shape: tuple[int, ...]) -> bool:
    """Whether a checkpoint tensor of ``shape`` fits module name ``target``; where not, recorded in ``plan`` as
    unexpected or mismatched."""
    if target not in expected:
        plan.unexpected.append(target)
        return False
    if shape != tuple(expected[target].shape):
        plan.mismatched.append((target, shape, tuple(expected[target].shape)))
        return False
    return True


def checkpoint_entries(checkpoint: Path) -> dict[str, Any]:
    """The entries (name, dtype, shape) of a .szt checkpoint (see `weights_in`), headers only: nothing is decoded,
    inflated or checked beyond the headers (the load that follows checks each payload as it decodes it).

    Raises:
        FormatError, ShardIndexError: a file or the index is not valid, or two shards hold one tensor.
    """
    def entries_of(file, names: list[str] | None) -> dict[str, Any]:  # (the shard's, or those its index names)
        return {name: file.entries[name] for name in (file.entries if names is None else names)}

    return load_checkpoint(entries_of, checkpoint)


def refuse_mismatches(plan: WeightPlan, model: torch.nn.Module, folder: Path, *, strict: bool) -> None:
    """Raise one error listing every shape mismatch (and, with ``strict``, every missing and unexpected name).

    Raises:
        CheckpointMismatchError: listing them all.
    """
    problems = []
    if plan.mismatched:
        problems.append(f"{len(plan.mismatched)} shape mismatch(es): {plan.describe_mismatches()}")
    if strict and plan.missing:
        problems.append(f"{len(plan.missing)} missing from the checkpoint: {listing(plan.missing)}")
    if strict and plan.unexpected:
        problems.append(f"{len(plan.unexpected)} unexpected in the checkpoint: {listing(plan.unexpected)}")
    if problems:
        raise CheckpointMismatchError(f"checkpoint does not fit {type(model).__name__} built from its config: "
                                      + "; ".join(problems), path=folder)


@dataclass
class PreparedModel:
    """A model built on ``meta`` from its folder's config, and how the folder's checkpoint fills it: everything
    checked, its load maybe under way (``loading``), nothing assigned to the model yet."""

    model: Any
    folder: Path
    checkpoint: Path
    """The .szt file, index or folder of shards the weights come from (see ``weights_in``)."""
    plan: WeightPlan
    expected: dict[str, torch.Tensor]
    """The model's ``state_dict`` on ``meta``: the name, shape and dtype each tensor must have."""
    loading: Future | None = None
    """The checkpoint's load, started while the model was built (:class:`Prefetch`)."""
    offload: str | None = None
    """The offload route the model was prepared for, if any: it is handed to that route, not loaded."""


READS_WAIT = 0.1
"""Seconds a build waits at most for its prefetched load's first read (the load's setup takes 15 ms for a 2.3 GB
checkpoint on the H200 host)."""


class Prefetch:
    """Loads checkpoints onto a CUDA device on a thread of its own, started as soon as a model's checkpoint is known,
    so that the load overlaps building the model and matching it to the checkpoint: Python work on the calling
    thread, while a load mostly waits on reads, copies and the device. On the H200 host, the time a 1.2 B-parameter
    LM's ``from_pretrained`` spends beyond its load went from 63 ms to 24 ms (``bench/RESULTS.md``, runs 20 and 25).
    Loads run one after another on that thread, as they would without it. A load started for a model that then
    fails its checks is waited for and dropped (:meth:`discard`): nothing of it stays on the device.

    Args:
        device (`torch.device`), verify (`bool`), staging: as in :func:`szformat.load_file`.
    """

    def __init__(self, device: torch.device, *, verify: bool, staging: Any):
        self.device = device
        self.verify = verify
        self.staging = staging
        if device.type == "cuda":  # CUDA starts on this thread, which goes on using it (see ``bind_thread``)
            from ..loading.ops import bind_thread

            bind_thread(device)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="szformat-prefetch")

    def start(self, checkpoint: Path) -> Future:
        """The load of ``checkpoint`` (see `weights_in`), under way: returns once its reads have started (or it
        ended, or :data:`READS_WAIT` passed), so that its setup has the GIL to itself (see `announcing_reads`)."""
        reading = threading.Event()
        loading = self._thread.submit(self._load, checkpoint, reading)
        reading.wait(READS_WAIT)
        return loading

    def _load(self, checkpoint: Path, reading: threading.Event) -> dict[str, torch.Tensor]:
        from .. import api
        from ..loading.device_loader import announcing_reads

        with announcing_reads(reading):
            return api.load_file(checkpoint, device=self.device, verify=self.verify, staging=self.staging)

    @staticmethod
    def discard(loading: Future | None) -> None:
        """Wait for a load nobody will use and release its tensors (a failed load raises nothing here)."""
        if loading is None:
            return
        wait([loading])
        if loading.exception() is None:
            loading.result().clear()

    def close(self) -> None:
        self._thread.shutdown(wait=True)

    def __enter__(self) -> "Prefetch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def prefetched(prefetch: Prefetch | None, checkpoint: Path, offload: str | None) -> Iterator[Future | None]:
    """The load of ``checkpoint`` started on ``prefetch`` (none without one, or for an offload route, which reads
    the checkpoint its own way), dropped if the block that prepares its model fails."""
    loading = prefetch.start(checkpoint) if prefetch is not None and offload is None else None
    try:
        yield loading
    except BaseException:
        Prefetch.discard(loading)
        raise


@contextlib.contextmanager
def prefetching(device: str | torch.device, *, verify: bool, staging: Any) -> Iterator[Prefetch | None]:
    """A :class:`Prefetch` for loads to a CUDA device, else ``None`` (a CPU decode would compete for the cores the
    build runs on). :func:`prefetched` starts each load."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():  # (the load then says why it cannot run)
        yield None
        return
    with Prefetch(device, verify=verify, staging=staging) as prefetch:
        yield prefetch


def load_weights(model: torch.nn.Module, checkpoint: Path, plan: WeightPlan, expected: Mapping[str, torch.Tensor],
                 *, device: torch.device, verify: bool, staging, loading: Future | None = None) -> None:
    """Decode a checkpoint (see `weights_in`) on ``device`` and make the module's tensors those very tensors (or,
    for the plan's conversions, the tensors they make of them there, each entry dropped as it is consumed).
    ``loading``: its load, already under way (:class:`Prefetch`).

    A tensor is cast only where the module was built in another dtype (``dtype=`` asked for it).
    """
    from .. import api

    tensors = (loading.result() if loading is not None
               else api.load_file(checkpoint, device=device, verify=verify, staging=staging))
    state = {}
    for conversion in plan.conversions:
        state.update(conversion.apply(tensors))
    for target, source in plan.sources.items():
        state[target] = tensors.pop(source)
    tensors.clear()
    for target, tensor in state.items():
        if tensor.dtype != expected[target].dtype:
            state[target] = tensor.to(expected[target].dtype)
    model.load_state_dict(state, strict=False, assign=True)


def place_buffers(model: torch.nn.Module, device: torch.device, skip: set[int] = frozenset()) -> None:
    """Move buffers the checkpoint did not provide (built on the CPU) to ``device``; those in ``skip`` (by ``id``)
    stay."""
    for module in model.modules():
        for key, buffer in module._buffers.items():
            if buffer is not None and buffer.device != device and buffer.device.type != "meta" \
                    and id(buffer) not in skip:
                module._buffers[key] = buffer.to(device)


def meta_tensors(model: torch.nn.Module) -> list[str]:
    """Names of parameters and buffers still on ``meta`` (each storage once)."""
    return [name for name, tensor in [*model.named_parameters(), *model.named_buffers()]
            if tensor.device.type == "meta"]
