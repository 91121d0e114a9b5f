"""retro: the reference binding over the patched llama.cpp that the conformance suite certifies."""

from __future__ import annotations

import json
from functools import cache
from typing import Any

from . import _cpu

_cpu.check()

from . import (
    _native,
    errors,
    scoring,
)
from ._native_logs import recent_errors
from .checkpoint import Checkpoint
from .context import Context
from .datasets import Dataset, PackedDataset, TokenDataset, TopKDataset, WeightedDataset
from .devices import Device, devices
from .errors import *  # noqa: F403 - the exception classes (one table: native/core/error_kinds.def)
from .model import Model
from .preflight import BufferNeed, Preflight
from .training import (
    SGD,
    AdamW,
    EpochCallback,
    EpochMetrics,
    MicroBatchGradientWarning,
    Progress,
    RowPlan,
    Schedule,
    Trainer,
)

__version__ = "0.1.0"


@cache
def build_info() -> dict[str, Any]:
    """The llama.cpp pin, the patch series (and its sha256) and the backends of this build."""
    info: dict[str, Any] = json.loads(_native.build_info())
    return info


__all__ = [
    "SGD",
    "AdamW",
    "BufferNeed",
    "Checkpoint",
    "Context",
    "Dataset",
    "Device",
    "EpochCallback",
    "EpochMetrics",
    "MicroBatchGradientWarning",
    "Model",
    "PackedDataset",
    "Preflight",
    "Progress",
    "RowPlan",
    "Schedule",
    "TokenDataset",
    "TopKDataset",
    "Trainer",
    "WeightedDataset",
    "build_info",
    "devices",
    "recent_errors",
    "scoring",
]
__all__ += errors.__all__
