"""Which offloading route can serve a load here, and why.

A route is an offloading runtime plus the place compressed bytes are expanded:

``native``
    diffusers-dynamic-offloader (DDO) ``vmm_fast``: its native shard transport reads each group's stored payloads
    into its registered ring, szformat DMAs them into a device staging buffer, and one batched decode per upload
    writes every weight into its arena range on DDO's upload stream, before the fence DDO's compute stream waits
    on. Needs Triton, and a process started under DDO's native allocator.
``staging``
    DDO ``vmm_runtime``: a staging pool derived from DDO's ``PinnedStagingPool``; each group's stored payloads are
    DMA'd (from page-cache pages registered once, or through DDO's pinned slot) into a device staging buffer and
    decoded into the group's device range by one batched decode, after DDO's upload and before it is marked done,
    on the same stream. Without Triton the pool decodes payloads on the CPU into the pinned slot instead (raw bytes
    cross).
``diffusers_group``, ``accelerate``
    No DDO: diffusers' group offloading or accelerate's offload hooks move the weights, szformat supplies the bytes
    and the decode (Triton on the GPU, or the CPU reference where Triton is absent).

``select_route("auto")`` takes the first route of :data:`ROUTES` that is available. Detection reads installed
package versions and module search paths only: it imports no optional package and creates no CUDA context, so it is
safe before DDO's native allocator is installed.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .._install import install_hint
from .._versions import installed_version, parse_version
from ..codec.gpu import MIN_TRITON, triton_missing
from ..errors import DecodeRouteError, InvalidArgumentError

__all__ = [
    "ROUTES", "RESIDENT", "REQUESTS", "DDO_DISTRIBUTION", "DDO_ALLOCATOR_DISTRIBUTION", "DDO_LIBRARY_ENV",
    "DISTRIBUTIONS",
    "SUPPORTED_DDO_VERSIONS", "MIN_VERSIONS", "Route", "OffloadEnvironment", "detect_environment",
    "route_availability", "select_route",
]

NATIVE, STAGING, DIFFUSERS_GROUP, ACCELERATE = "native", "staging", "diffusers_group", "accelerate"
ROUTES = (NATIVE, STAGING, DIFFUSERS_GROUP, ACCELERATE)
"""Every route that streams weights from host memory, in the order ``auto`` prefers them."""
RESIDENT = "resident"
"""Weights kept compressed in device memory, expanded per block (:mod:`szformat.offload.resident`); never chosen
by ``auto``, which streams: it asks for 0.75 of the weights' device memory where the others ask for little."""
REQUESTS = ("auto", *ROUTES, RESIDENT)

DDO_DISTRIBUTION = "diffusers-dynamic-offloader"
DDO_ALLOCATOR_DISTRIBUTION = "ddo-vmm-allocator"
SUPPORTED_DDO_VERSIONS = ("0.1.0rc2",)
"""DDO releases whose seams szformat uses (and whose allocator release must match); ``szformat[ddo]`` pins them."""

MIN_VERSIONS = {
    "cuda-bindings": "13.4.0",  # DDO's [vmm] extra
    "cuda-core": "1.2.0",  # DDO's [vmm] extra
    "diffusers": "0.35.0",  # ModuleGroup.onload_/offload_ and the "group_offloading" hook, as read there
    "accelerate": "1.0.0",  # AlignDevicesHook with a lazy weights_map
}

DISTRIBUTIONS = (DDO_DISTRIBUTION, DDO_ALLOCATOR_DISTRIBUTION, *MIN_VERSIONS)
"""The packages whose installed versions route selection looks at."""

DDO_LIBRARY_ENV = "DDO_VMM_LIBRARY_PATH"
_PACKAGED_LIBRARY = {"linux": "native/linux/libddo_vmm.so", "win32": "native/win32/ddo_vmm.dll"}
_BOOTSTRAP_HINT = ("call `from ddo_vmm_bootstrap import ensure_vmm_fast_process; ensure_vmm_fast_process()` "
                   "as the script's first statement")


@dataclass(frozen=True)
class Route:
    """A selected route: ``name`` (one of :data:`ROUTES`), where payloads are decoded, and why it was chosen."""

    name: str
    decoder: str
    """``"triton"`` (on the GPU) or ``"cpu"`` (the reference decoder, before the copy)."""
    reason: str


@dataclass(frozen=True)
class OffloadEnvironment:
    """The facts route selection depends on; :func:`detect_environment` reads them from this process."""

    platform: str = sys.platform
    cuda_available: bool = False
    triton_available: bool = False
    """Whether a Triton the GPU codec runs on is installed (:func:`~szformat.codec.gpu.triton_missing`)."""
    versions: Mapping[str, str | None] = field(default_factory=dict)
    """Installed version of each distribution in :data:`DISTRIBUTIONS` (None: not installed)."""
    native_library: str | None = None
    """DDO's native allocator library: ``$DDO_VMM_LIBRARY_PATH`` or the one the allocator package ships."""
    native_allocator_installed: bool = False
    """Whether this process runs under DDO's native CUDA allocator (started through DDO's bootstrap)."""


def detect_environment() -> OffloadEnvironment:
    """Read the route facts of this process without importing optional packages or creating a CUDA context."""
    import torch

    return OffloadEnvironment(
        platform=sys.platform,
        cuda_available=torch.cuda.is_available(),
        triton_available=triton_missing() is None,
        versions={name: installed_version(name) for name in DISTRIBUTIONS},
        native_library=_find_native_library(),
        native_allocator_installed=_native_allocator_installed(),
    )


def select_route(requested: str = "auto", environment: OffloadEnvironment | None = None) -> Route:
    """Resolve a requested route against what this environment can run.

    Args:
        requested (`str`, *optional*, defaults to `"auto"`): ``"auto"`` or one of :data:`ROUTES`.
        environment (`OffloadEnvironment`, *optional*): the facts to decide on; read from this process by default.

    Returns:
        `Route`: the route, its decoder and the reason it was chosen.

    Raises:
        ValueError: ``requested`` is not a route name.
        DecodeRouteError: the requested route (for ``"auto"``: every route) cannot run here; the message says why
            and which routes can.
    """
    if requested not in REQUESTS:
        raise InvalidArgumentError(f"unknown offload route {requested!r}; choose one of {', '.join(REQUESTS)}")
    env = environment if environment is not None else detect_environment()
    if requested == RESIDENT:
        return Route(RESIDENT, "triton" if env.triton_available else "cpu",
                     "requested: weights stay compressed on the device and expand per block")
    verdicts = {name: route_availability(name, env) for name in ROUTES}
    if requested != "auto":
        available, why = verdicts[requested]
        if not available:
            usable = [name for name in ROUTES if verdicts[name][0]]
            alternatives = f"routes available here: {', '.join(usable)}" if usable else "no route is available here"
            raise DecodeRouteError(f"offload route {requested!r} is unavailable: {why}; {alternatives}")
        return Route(requested, _decoder(requested, env), f"requested; {why}")
    skipped = []
    for name in ROUTES:
        available, why = verdicts[name]
        if available:
            reason = f"auto: {why}" + "".join(f"; {skip}" for skip in skipped)
            return Route(name, _decoder(name, env), reason)
        skipped.append(f"{name} unavailable ({why})")
    raise DecodeRouteError("no offload route is available: " + "; ".join(skipped))


def route_availability(name: str, env: OffloadEnvironment) -> tuple[bool, str]:
    """``(True, what it will use)`` when route ``name`` can run in ``env``, else ``(False, what is missing)``."""
    for requirement in _REQUIREMENTS[name]:
        problem = requirement(env)
        if problem is not None:
            return False, problem
    return True, _summary(name, env)


def _decoder(name: str, env: OffloadEnvironment) -> str:
    return "triton" if name == NATIVE or env.triton_available else "cpu"


def _summary(name: str, env: OffloadEnvironment) -> str:
    decode = "GPU decode" if _decoder(name, env) == "triton" else f"CPU decode ({_NO_TRITON})"
    engine = {
        NATIVE: f"DDO {env.versions.get(DDO_DISTRIBUTION)} vmm_fast native transport",
        STAGING: f"DDO {env.versions.get(DDO_DISTRIBUTION)} vmm_runtime staging pool",
        DIFFUSERS_GROUP: f"diffusers {env.versions.get('diffusers')} group offloading",
        ACCELERATE: f"accelerate {env.versions.get('accelerate')} offload hooks",
    }[name]
    return f"{engine}, {decode}"


# -- requirements ------------------------------------------------------------------------------------------------


def _needs_cuda(env: OffloadEnvironment) -> str | None:
    return None if env.cuda_available else "no CUDA device (torch.cuda.is_available() is False)"


_NO_TRITON = f"Triton is not installed or older than {MIN_TRITON}"


def _needs_triton(env: OffloadEnvironment) -> str | None:
    return None if env.triton_available else f"{_NO_TRITON} (the arena decode runs on the GPU)"


def _needs_native_allocator(env: OffloadEnvironment) -> str | None:
    if env.native_allocator_installed:
        return None
    return f"the process does not run under DDO's native allocator: {_BOOTSTRAP_HINT}"


def _needs_ddo(env: OffloadEnvironment) -> str | None:
    if env.platform not in _PACKAGED_LIBRARY:
        return f"DDO's native allocator supports Linux and Windows, not {env.platform}"
    supported = ", ".join(SUPPORTED_DDO_VERSIONS)
    for distribution in (DDO_DISTRIBUTION, DDO_ALLOCATOR_DISTRIBUTION):
        version = env.versions.get(distribution)
        if version is None:
            return f"{distribution} is not installed ({install_hint('ddo')})"
        if not _is_one_of(version, SUPPORTED_DDO_VERSIONS):
            return (f"{distribution} {version} is not supported (szformat supports {supported}; "
                    f"{install_hint('ddo')})")
    for distribution in ("cuda-bindings", "cuda-core"):
        problem = _needs_version(env, distribution)
        if problem is not None:
            return f"{problem} (DDO's [vmm] extra needs it)"
    if env.versions.get("diffusers") is None:
        return "diffusers is not installed (DDO imports it)"
    if env.native_library is None:
        return (f"DDO's native library was not found: set {DDO_LIBRARY_ENV} to the allocator package's "
                f"{_PACKAGED_LIBRARY[env.platform]}")
    return None


def _needs_version(env: OffloadEnvironment, distribution: str) -> str | None:
    version = env.versions.get(distribution)
    minimum = MIN_VERSIONS[distribution]
    if version is None:
        return f"{distribution} is not installed"
    try:
        too_old = parse_version(version) < parse_version(minimum)
    except ValueError:
        return f"{distribution} has a version szformat cannot read ({version!r})"
    return f"{distribution} {version} is older than {minimum}" if too_old else None


_REQUIREMENTS: dict[str, tuple[Callable[[OffloadEnvironment], str | None], ...]] = {
    NATIVE: (_needs_cuda, _needs_ddo, _needs_triton, _needs_native_allocator),
    STAGING: (_needs_cuda, _needs_ddo),
    DIFFUSERS_GROUP: (_needs_cuda, lambda env: _needs_version(env, "diffusers")),
    ACCELERATE: (_needs_cuda, lambda env: _needs_version(env, "accelerate")),
}
"""What each route needs, checked in order; each check returns None or what is missing."""


def _is_one_of(version: str, supported: tuple[str, ...]) -> bool:
    try:
        return parse_version(version) in {parse_version(known) for known in supported}
    except ValueError:
        return False


# -- detection ---------------------------------------------------------------------------------------------------


def _find_native_library() -> str | None:
    """The library DDO will load: the environment variable wins, as in DDO; else the allocator package's own."""
    configured = os.environ.get(DDO_LIBRARY_ENV)
    if configured:
        return configured if Path(configured).is_file() else None
    relative = _PACKAGED_LIBRARY.get(sys.platform)
    try:
        spec = importlib.util.find_spec("ddo_vmm_allocator")  # a top-level name: found, not imported
    except (ImportError, ValueError):
        return None
    if relative is None or spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / relative
        if candidate.is_file():
            return str(candidate)
    return None


def _native_allocator_installed() -> bool:
    """True when DDO's bootstrap installed its allocator here (it leaves the module imported; we never import it)."""
    allocator = sys.modules.get("ddo_vmm_allocator.torch_allocator")
    installed = getattr(allocator, "installed_library_path", None)
    return callable(installed) and installed() is not None
