"""Argument checks shared by the public API: every value is validated here, in Python, before any
native state changes. Values that cross signed native counters are bounded explicitly."""

from __future__ import annotations

import math
import numbers

import numpy as np

from . import _native

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


def seeded(defect: str) -> bool:
    """True while the conformance suite has switched on this seeded defect (conformance/mutants.toml);
    always False in a release build (RETRO_SEEDED_DEFECTS=OFF), which has no switches."""
    return _SWITCHES and bool(_native.hooks.defect_on(defect))


_SWITCHES: bool = bool(_native.hooks.seeded_defects)


def test_build() -> bool:
    """True in a build with the test door (seeded-defect switches, fault sites); False in a
    release build (RETRO_SEEDED_DEFECTS=OFF)."""
    return _SWITCHES


_topology_gate_waived = False


def waive_topology_gate(waived: bool) -> None:
    """The test door's switch that lets Trainer(topology_cache=True) run without a gate package,
    for the checks that make the gate's evidence (retro.fault_injection.ungated_topology_cache).
    A release build has no such door: there the cache is switched on through the gate alone."""
    global _topology_gate_waived
    if waived and not _SWITCHES:
        raise ValueError(
            "the packed-topology cache without its gate exists only in a build with the test door; "
            "this build switches it on through the gate alone"
        )
    _topology_gate_waived = bool(waived)


def topology_gate_waived() -> bool:
    return _SWITCHES and _topology_gate_waived


def integer(name: str, value: object, *, minimum: int = 0, maximum: int = INT32_MAX) -> int:
    """An int in [minimum, maximum]; beyond a native counter's range is an OverflowError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    v = int(value)
    if seeded("SHAPE-02"):
        v = (v + 2**31) % 2**32 - 2**31  # seeded defect: a C-style narrowing cast to int32
    if v > maximum:
        raise OverflowError(f"{name}={v} exceeds the native limit {maximum}")
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return v


def real(name: str, value: object, *, low: float, high: float, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, not {type(value).__name__}")
    v = float(value)
    if not math.isfinite(v) or v > high or v < low or (low_open and v == low):
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise ValueError(f"{name} must be finite and in {bound}, got {value}")
    return v


def weights(name: str, arr: np.ndarray) -> None:
    """Loss weights: every one finite and >= 0 (a NaN would poison the step, a negative one
    would train away from its target)."""
    if arr.size and not (np.isfinite(arr).all() and float(arr.min()) >= 0.0):
        bad = arr[~(np.isfinite(arr) & (arr >= 0))]
        raise ValueError(f"{name} must be finite and >= 0, found {bad[:3].tolist()}")


def token_array(name: str, value: object, n_vocab: int, *, ndim: int) -> np.ndarray:
    """A C-contiguous int32 array of token ids in [0, n_vocab); never a silent narrowing cast."""
    arr = np.asarray(value)
    if arr.size == 0:
        raise ValueError(f"{name} is empty")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, not {arr.dtype}")
    if arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {arr.shape}")
    if seeded("SHAPE-02"):
        arr = arr.astype(np.int32)  # seeded defect: a silent narrowing cast
    lo, hi = int(arr.min()), int(arr.max())
    if hi > INT32_MAX:
        raise OverflowError(f"{name} holds ids past the int32 range (max {hi})")
    if lo < 0 or hi >= n_vocab:
        raise ValueError(f"{name} holds ids outside [0, {n_vocab}): min {lo}, max {hi}")
    return np.ascontiguousarray(arr, dtype=np.int32)
