"""Offloader integration: stream compressed .szt payloads through an offloading runtime and expand them on the way.

``load_into_offloader`` binds a module to a checkpoint by name, picks a route (DDO's native transport, DDO's staging
pool, or an installed engine: diffusers group offloading, accelerate hooks) and wires szformat's decoder into it.
"""

from .binding import ModuleBinding, TensorBinding, bind_module
from .handle import OffloadedModel
from .install import load_into_offloader
from .routes import ROUTES, OffloadEnvironment, Route, detect_environment, select_route

__all__ = [
    "ROUTES", "ModuleBinding", "OffloadEnvironment", "OffloadedModel", "Route", "TensorBinding", "bind_module",
    "detect_environment", "load_into_offloader", "select_route",
]
