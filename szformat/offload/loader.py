"""``load_into_offloader``: hand a .szt checkpoint to an offloading runtime, still compressed.

The checkpoint is bound to the module by name first (nothing moves if a single name, shape or dtype disagrees),
then a route is chosen (:mod:`.routes`), then the route's installer wires szformat's transport and decoder into the
runtime. Installers register themselves in :data:`INSTALLERS` by route name.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from ..errors import DecodeRouteError
from ..format.reader import SztFile
from .binding import ModuleBinding, bind_module
from .routes import OffloadEnvironment, Route, select_route

__all__ = ["load_into_offloader", "INSTALLERS", "Installer"]

Installer = Callable[[SztFile, torch.nn.Module, ModuleBinding, Route, torch.device], Any]
"""Wires one route: ``(checkpoint, module, binding, route, device) -> handle``; owns ``checkpoint`` from then on."""

INSTALLERS: dict[str, Installer] = {}
"""Route name -> installer. A selected route without one is refused with DecodeRouteError."""


def load_into_offloader(path: str | os.PathLike, module: torch.nn.Module, *, route: str = "auto",
                        device: str | torch.device = "cuda:0", strict: bool = True,
                        environment: OffloadEnvironment | None = None) -> Any:
    """Feed the compressed payloads of a .szt file to an offloading runtime that then manages ``module``.

    Weights stay compressed in host memory and are expanded on their way to the device, by the route's decoder.

    Args:
        path (`str` or `os.PathLike`): the .szt checkpoint.
        module (`torch.nn.Module`): the model, with the checkpoint's names, shapes and dtypes (on any device,
            ``meta`` included).
        route (`str`, *optional*, defaults to `"auto"`): ``"auto"``, ``"native"``, ``"staging"``,
            ``"diffusers_group"`` or ``"accelerate"`` (see :mod:`szformat.offload.routes`).
        device (`str` or `torch.device`, *optional*, defaults to `"cuda:0"`): where the module computes.
        strict (`bool`, *optional*, defaults to `True`): refuse module tensors missing from the checkpoint and
            checkpoint entries the module does not have.
        environment (`OffloadEnvironment`, *optional*): route facts; read from this process by default.

    Raises:
        BindingError: the module and the checkpoint disagree; the message lists every name.
        DecodeRouteError: the requested route cannot run here, with the reason and the routes that can.
        FormatError: the file is not a valid .szt file.
    """
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"offloading computes on a CUDA device; got device {str(device)!r}")
    checkpoint = SztFile(path)
    try:
        binding = bind_module(module, checkpoint.entries, strict=strict, path=checkpoint.path)
        selected = select_route(route, environment)
        install = INSTALLERS.get(selected.name)
        if install is None:
            raise DecodeRouteError(f"offload route {selected.name!r} was selected ({selected.reason}) but this "
                                   f"szformat build has no installer for it", path=checkpoint.path)
        return install(checkpoint, module, binding, selected, device)
    except BaseException:
        checkpoint.close()
        raise
