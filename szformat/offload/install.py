"""``load_into_offloader``: hand a .szt checkpoint to an offloading runtime, still compressed.

The checkpoint is bound to the module by name first (nothing moves if a single name, shape or dtype disagrees),
then a route is chosen (:mod:`.routes`), then the route's installer wires szformat's transport and decoder into the
runtime. Installers are looked up by route name in :data:`INSTALLERS`; each imports its engine only when used.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import DecodeRouteError, InvalidArgumentError
from ..paths import resolve_path
from .binding import ModuleBinding, bind_module
from .shards import Checkpoint
from .handle import OffloadedModel
from .routes import ACCELERATE, DIFFUSERS_GROUP, NATIVE, RESIDENT, STAGING, OffloadEnvironment, Route, \
    detect_environment, select_route

__all__ = ["load_into_offloader", "INSTALLERS", "Installation", "Installer"]


@dataclass(frozen=True)
class Installation:
    """Everything an installer gets: the open checkpoint (which it owns from then on), the module bound to it, the
    selected route, the compute device, the environment the route was chosen in, and the engine options."""

    checkpoint: Checkpoint
    module: torch.nn.Module
    binding: ModuleBinding
    route: Route
    device: torch.device
    environment: OffloadEnvironment
    options: Mapping[str, Any] = field(default_factory=dict)


Installer = Callable[[Installation], OffloadedModel]


def _lazy(module: str, function: str) -> Installer:
    def install(installation: Installation) -> OffloadedModel:
        return getattr(importlib.import_module(module, __package__), function)(installation)

    return install


INSTALLERS: dict[str, Installer] = {
    NATIVE: _lazy(".ddo_install", "install_native"),
    STAGING: _lazy(".ddo_install", "install_staging"),
    DIFFUSERS_GROUP: _lazy(".group_offload", "install_group_offloading"),
    ACCELERATE: _lazy(".accelerate_hooks", "install_accelerate_hooks"),
    RESIDENT: _lazy(".resident", "install_resident"),
}
"""Route name -> installer. A selected route without one is refused with DecodeRouteError."""


def load_into_offloader(path: str | os.PathLike, module: torch.nn.Module, *, route: str = "auto",
                        device: str | torch.device = "cuda:0", strict: bool = True,
                        entry_names: Mapping[str, str] | None = None, environment: OffloadEnvironment | None = None,
                        repo_id: str | None = None, revision: str | None = None, token: str | bool | None = None,
                        local_files_only: bool = False, cache_dir: str | os.PathLike | None = None,
                        **engine_options: Any) -> OffloadedModel:
    """Feed the compressed payloads of a .szt checkpoint to an offloading runtime that then manages ``module``.

    Weights stay compressed in host memory (the file's pages) and are expanded on their way to the device by the
    route's decoder; the module's CPU tensors become placeholders that hold no weight bytes.

    Args:
        path (`str` or `os.PathLike`): a .szt file, a sharded index (``*.szt.index.json``) or a converted folder,
            or a Hub reference to one (``hf://user/repo``, or a file of the repo named by ``repo_id``; ``revision``,
            ``token``, ``local_files_only`` and ``cache_dir`` go to ``huggingface_hub``).
        module (`torch.nn.Module`): the model, with the checkpoint's names, shapes and dtypes (on any device,
            ``meta`` included).
        route (`str`, *optional*, defaults to `"auto"`): ``"auto"``, ``"native"``, ``"staging"``,
            ``"diffusers_group"`` or ``"accelerate"`` (see :mod:`szformat.offload.routes`), or ``"resident"``:
            the compressed weights kept in device memory, expanded block by block as the model runs (see
            :mod:`szformat.offload.resident`; engine options ``blocks``, ``slots``, ``min_tensor_bytes``).
        device (`str` or `torch.device`, *optional*, defaults to `"cuda:0"`): where the module computes (the CPU
            too, for ``"resident"``).
        strict (`bool`, *optional*, defaults to `True`): refuse module tensors missing from the checkpoint and
            checkpoint entries the module does not have.
        entry_names (`Mapping[str, str]`, *optional*): the checkpoint entry of each module name stored under
            another name (see :func:`szformat.offload.bind_module`).
        environment (`OffloadEnvironment`, *optional*): route facts; read from this process by default.
        engine_options: passed to the engine: DDO configuration fields for ``native``/``staging`` (e.g.
            ``vmm_resident_weight_budget_gb``, ``vmm_staging_buffer_gb``); ``offload_type``,
            ``num_blocks_per_group``, ``use_stream`` for ``diffusers_group``; ``blocks``, ``num_blocks_per_group``,
            ``slots``, ``min_tensor_bytes``, ``min_leaf_bytes``, ``graphs`` for ``resident``; none for
            ``accelerate``.

    Returns:
        `OffloadedModel`: the module and its route; call ``close()`` when done.

    Raises:
        BindingError: the module and the checkpoint disagree; the message lists every name.
        DecodeRouteError: the requested route cannot run here, with the reason and the routes that can.
        FormatError: a file is not a valid .szt file.
        ValueError: an engine option the route does not accept.

    Example:
        >>> offloaded = load_into_offloader("model.szt", model, vmm_resident_weight_budget_gb=4)  # doctest: +SKIP
        >>> out = offloaded.module(**inputs)  # doctest: +SKIP
    """
    device = torch.device(device)
    if device.type != "cuda" and not (route == RESIDENT and device.type == "cpu"):
        raise InvalidArgumentError("offloading computes on a CUDA device (route='resident' on the CPU too); got "
                                   f"device {str(device)!r}")
    path = resolve_path(path, repo_id=repo_id, revision=revision, token=token, local_files_only=local_files_only,
                        cache_dir=cache_dir)
    checkpoint = Checkpoint(path)
    try:
        binding = bind_module(module, checkpoint.entries, strict=strict, path=checkpoint.path,
                              entry_names=entry_names)
        env = environment if environment is not None else detect_environment()
        selected = select_route(route, env)
        if selected.name == RESIDENT and device.type == "cpu":
            selected = dataclasses.replace(selected, decoder="cpu")
        install = INSTALLERS.get(selected.name)
        if install is None:
            raise DecodeRouteError(f"offload route {selected.name!r} was selected ({selected.reason}) but this "
                                   f"szformat build has no installer for it", path=checkpoint.path)
        return install(Installation(checkpoint, module, binding, selected, device, env, dict(engine_options)))
    except BaseException:
        checkpoint.close()
        raise
