"""The ggml devices this build can use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from . import _native
from ._native_logs import forwarding


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
