"""The ggml devices this build can use."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from . import _native
from ._native_logs import forwarding

#: the backends this project builds (CMakeLists.txt): the name ggml's backend registry gives each
#: (Device.backend), to the name the conformance suite, the topology gate and the reports use
BACKENDS: dict[str, str] = {"CPU": "cpu", "RPC": "rpc", "CUDA": "cuda", "Vulkan": "vulkan"}


@dataclass(frozen=True)
class Device:
    index: int
    name: str
    description: str
    kind: Literal["cpu", "gpu", "igpu", "accel", "other"]
    backend: str  # the ggml backend registry: "CPU", "CUDA", "Vulkan", ...
    memory_free: int
    memory_total: int


@forwarding
def devices() -> list[Device]:
    """Every device of the backends compiled into this build, CPU first."""
    return [Device(**d) for d in _native.devices()]


def backend_name(registry_name: str) -> str:
    """Our name of the backend a ggml registry names; one this project does not build keeps its
    registry name, lowercased (so it matches none of ours)."""
    return BACKENDS.get(registry_name, registry_name.lower())


def backends_of(device_names: Iterable[str]) -> list[str]:
    """The backends of the named ggml devices, as ggml's registry lists them, the CPU first and
    always; a name no device has stays itself, lowercased (so it matches no backend of ours)."""
    registry_of = {d.name: d.backend for d in devices()}
    found = ["cpu"]
    for device in device_names:
        name = backend_name(registry_of[device]) if device in registry_of else device.lower()
        if name not in found:
            found.append(name)
    return found
