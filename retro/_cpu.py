"""The x86-64 build is portable (GGML_NATIVE=OFF) but compiled for AVX2, FMA and F16C: say so at
import instead of dying of SIGILL inside the first compute."""

from __future__ import annotations

import platform

REQUIRED = ("avx2", "fma", "f16c")


def missing_features(cpuinfo: str = "/proc/cpuinfo") -> list[str]:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    try:
        with open(cpuinfo, encoding="ascii", errors="replace") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), None)
    except OSError:
        return []
    return [] if flags is None else [feat for feat in REQUIRED if feat not in flags]


def check() -> None:
    missing = missing_features()
    if missing:
        raise ImportError(
            f"retro's CPU code needs the x86-64 features {', '.join(REQUIRED)}; "
            f"this processor lacks {', '.join(missing)}"
        )
