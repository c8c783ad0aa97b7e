"""Route selection for load_into_offloader (szformat.offload.routes): which runtime, which decoder, and why."""

from __future__ import annotations

import dataclasses
import sys
import types
from pathlib import Path

import pytest

from szformat._install import install_hint
from szformat.errors import DecodeRouteError
from szformat.offload import routes
from szformat.offload.routes import (
    DDO_ALLOCATOR_DISTRIBUTION,
    DDO_DISTRIBUTION,
    OffloadEnvironment,
    select_route,
)

DDO_STACK = {
    DDO_DISTRIBUTION: "0.1.0rc2", DDO_ALLOCATOR_DISTRIBUTION: "0.1.0rc2", "cuda-bindings": "13.5.0",
    "cuda-core": "1.2.0", "diffusers": "0.42.1", "accelerate": "1.15.0",
}
FULL = OffloadEnvironment(platform="linux", cuda_available=True, triton_available=True, versions=DDO_STACK,
                          native_library="/opt/ddo/libddo_vmm.so", native_allocator_installed=True)


def env(**changes) -> OffloadEnvironment:
    versions = changes.pop("versions", {})
    return dataclasses.replace(FULL, versions={**FULL.versions, **versions}, **changes)


# -- auto ----------------------------------------------------------------------------------------------------------


def test_auto_prefers_the_native_transport_when_everything_is_there():
    route = select_route("auto", FULL)
    assert (route.name, route.decoder) == ("native", "triton")
    assert route.reason == "auto: DDO 0.1.0rc2 vmm_fast native transport, GPU decode"


def test_auto_falls_back_to_the_staging_pool_outside_ddos_bootstrap_and_says_why():
    route = select_route("auto", env(native_allocator_installed=False))
    assert (route.name, route.decoder) == ("staging", "triton")
    assert "native unavailable (the process does not run under DDO's native allocator" in route.reason
    assert "ensure_vmm_fast_process()" in route.reason


def test_without_triton_the_staging_pool_decodes_on_the_cpu_and_native_is_skipped():
    route = select_route("auto", env(triton_available=False))
    assert (route.name, route.decoder) == ("staging", "cpu")
    assert "native unavailable (Triton is not installed" in route.reason
    assert "CPU decode" in route.reason


@pytest.mark.parametrize("changes, why", [
    ({"versions": {DDO_DISTRIBUTION: None}}, f"diffusers-dynamic-offloader is not installed ({install_hint('ddo')})"),
    ({"versions": {DDO_DISTRIBUTION: "0.1.0"}}, "diffusers-dynamic-offloader 0.1.0 is not supported (szformat "
                                                "supports 0.1.0rc2"),
    ({"versions": {DDO_ALLOCATOR_DISTRIBUTION: "0.1.0rc3"}}, "ddo-vmm-allocator 0.1.0rc3 is not supported"),
    ({"versions": {"cuda-bindings": "13.3.1"}}, "cuda-bindings 13.3.1 is older than 13.4.0 (DDO's [vmm] extra"),
    ({"versions": {"cuda-core": None}}, "cuda-core is not installed (DDO's [vmm] extra needs it)"),
    ({"native_library": None}, "DDO's native library was not found: set DDO_VMM_LIBRARY_PATH to the allocator "
                               "package's native/linux/libddo_vmm.so"),
    ({"platform": "darwin"}, "DDO's native allocator supports Linux and Windows, not darwin"),
])
def test_auto_leaves_ddo_for_group_offloading_when_ddo_cannot_run(changes, why):
    route = select_route("auto", env(**changes))
    assert route.name == "diffusers_group"
    assert f"staging unavailable ({why}" in route.reason
    assert route.reason.startswith("auto: diffusers 0.42.1 group offloading, GPU decode")


def test_auto_uses_accelerate_when_neither_ddo_nor_diffusers_is_installed():
    route = select_route("auto", env(versions={DDO_DISTRIBUTION: None, "diffusers": None}, triton_available=False))
    assert (route.name, route.decoder) == ("accelerate", "cpu")
    assert "diffusers_group unavailable (diffusers is not installed)" in route.reason


def test_an_old_diffusers_is_not_used_for_group_offloading():
    route = select_route("auto", env(versions={DDO_DISTRIBUTION: None, "diffusers": "0.34.0"}))
    assert route.name == "accelerate"
    assert "diffusers 0.34.0 is older than 0.35.0" in route.reason


def test_auto_with_no_route_lists_every_reason():
    bare = OffloadEnvironment(platform="linux", cuda_available=True, versions={})
    with pytest.raises(DecodeRouteError) as caught:
        select_route("auto", bare)
    message = str(caught.value)
    assert message.startswith("no offload route is available: native unavailable (diffusers-dynamic-offloader is "
                              "not installed")
    for name in routes.ROUTES:
        assert f"{name} unavailable (" in message


def test_no_route_offloads_without_cuda():
    with pytest.raises(DecodeRouteError, match=r"native unavailable \(no CUDA device"):
        select_route("auto", env(cuda_available=False))


# -- explicit requests ---------------------------------------------------------------------------------------------


def test_an_available_explicit_route_is_taken_even_when_auto_would_prefer_another():
    route = select_route("accelerate", FULL)
    assert (route.name, route.decoder) == ("accelerate", "triton")
    assert route.reason == "requested; accelerate 1.15.0 offload hooks, GPU decode"


def test_an_unavailable_explicit_route_says_why_and_what_would_work():
    with pytest.raises(DecodeRouteError) as caught:
        select_route("native", env(native_allocator_installed=False))
    message = str(caught.value)
    assert message.startswith("offload route 'native' is unavailable: the process does not run under DDO's native "
                              "allocator")
    assert message.endswith("routes available here: staging, diffusers_group, accelerate")


def test_an_unavailable_explicit_route_with_nothing_else_says_so():
    with pytest.raises(DecodeRouteError, match="; no route is available here$"):
        select_route("staging", env(cuda_available=False))


def test_an_unknown_route_name_is_a_usage_error():
    with pytest.raises(ValueError, match="unknown offload route 'vmm_fast'; choose one of auto, native, staging"):
        select_route("vmm_fast", FULL)


# -- detection -----------------------------------------------------------------------------------------------------


@pytest.fixture
def no_ddo_environment(monkeypatch):
    monkeypatch.delenv(routes.DDO_LIBRARY_ENV, raising=False)
    monkeypatch.delitem(sys.modules, "ddo_vmm_allocator", raising=False)  # an earlier test may have imported it
    monkeypatch.delitem(sys.modules, "ddo_vmm_allocator.torch_allocator", raising=False)


def test_detection_reads_installed_versions_from_package_metadata(monkeypatch, no_ddo_environment):
    fake = {DDO_DISTRIBUTION: "0.1.0rc2", "diffusers": "0.42.1"}

    def version(name):
        if name not in fake:
            raise routes.importlib.metadata.PackageNotFoundError(name)
        return fake[name]

    monkeypatch.setattr(routes.importlib.metadata, "version", version)
    detected = routes.detect_environment()
    assert detected.versions[DDO_DISTRIBUTION] == "0.1.0rc2"
    assert detected.versions["diffusers"] == "0.42.1"
    assert detected.versions[DDO_ALLOCATOR_DISTRIBUTION] is None
    assert set(detected.versions) == set(routes.DISTRIBUTIONS)


def test_detection_finds_the_packaged_library_without_importing_the_allocator(tmp_path, monkeypatch,
                                                                             no_ddo_environment):
    package = tmp_path / "ddo_vmm_allocator"
    (package / "native" / "linux").mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('importing the allocator initializes CUDA')\n")
    library = package / "native" / "linux" / "libddo_vmm.so"
    library.write_bytes(b"\x7fELF")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(routes.sys, "platform", "linux")
    assert routes.detect_environment().native_library == str(library)
    assert "ddo_vmm_allocator" not in sys.modules


def test_the_library_environment_variable_wins_but_must_name_a_file(tmp_path, monkeypatch, no_ddo_environment):
    library = tmp_path / "custom.so"
    library.write_bytes(b"")
    monkeypatch.setenv(routes.DDO_LIBRARY_ENV, str(library))
    assert routes.detect_environment().native_library == str(library)
    monkeypatch.setenv(routes.DDO_LIBRARY_ENV, str(tmp_path / "missing.so"))
    assert routes.detect_environment().native_library is None


def test_detection_sees_the_native_allocator_only_once_installed(monkeypatch, no_ddo_environment):
    allocator = types.ModuleType("ddo_vmm_allocator.torch_allocator")
    installed: list[Path] = []
    allocator.installed_library_path = lambda: installed[0] if installed else None
    monkeypatch.setitem(sys.modules, "ddo_vmm_allocator.torch_allocator", allocator)
    assert routes.detect_environment().native_allocator_installed is False
    installed.append(Path("/opt/ddo/libddo_vmm.so"))
    assert routes.detect_environment().native_allocator_installed is True


def test_detection_on_this_machine_agrees_with_torch():
    import torch

    detected = routes.detect_environment()
    assert detected.cuda_available == torch.cuda.is_available()
    assert detected.platform == sys.platform


def test_an_unreadable_installed_version_makes_the_route_unavailable():
    route = select_route("auto", env(versions={DDO_DISTRIBUTION: None, "diffusers": "unknown"}))
    assert route.name == "accelerate"
    assert "diffusers has a version szformat cannot read ('unknown')" in route.reason


# -- the pins in the packaging match the code ----------------------------------------------------------------------


def test_the_ddo_extra_pins_exactly_the_supported_releases():
    tomllib = pytest.importorskip("tomllib")
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    extra = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]["ddo"]
    pins = {requirement.split("[")[0].split("==")[0]: requirement.split("==")[1] for requirement in extra}
    assert pins == {DDO_DISTRIBUTION: routes.SUPPORTED_DDO_VERSIONS[0],
                    DDO_ALLOCATOR_DISTRIBUTION: routes.SUPPORTED_DDO_VERSIONS[0]}
    assert len(routes.SUPPORTED_DDO_VERSIONS) == 1
    assert any(requirement.startswith(f"{DDO_DISTRIBUTION}[vmm]") for requirement in extra)
