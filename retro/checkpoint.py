"""Checkpoints of a trainer: parameters, AdamW moments and the optimizer cursor, taken at an
accumulation boundary, restorable into a new trainer (the recovery path after a compute failure
poisoned the old one)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = 1


@dataclass(frozen=True)
class Checkpoint:
    parameters: dict[str, np.ndarray]
    moments: dict[str, tuple[np.ndarray, np.ndarray]]  # AdamW (m, v) per trained weight; empty for SGD
    iteration: int  # the optimizer cursor: 1 + steps applied
    meta: dict[str, object] = field(default_factory=dict)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the checkpoint as one .npz file (no pickled objects)."""
        p = Path(path)
        arrays: dict[str, Any] = {f"param/{n}": a for n, a in self.parameters.items()}
        for n, (m, v) in self.moments.items():
            arrays[f"m/{n}"], arrays[f"v/{n}"] = m, v
        header = {"format": FORMAT, "iteration": self.iteration, "meta": self.meta}
        with p.open("wb") as f:
            arrays["__header__"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
            np.savez(f, **arrays)
        return p

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Checkpoint:
        with np.load(Path(path), allow_pickle=False) as z:
            header = json.loads(bytes(z["__header__"]).decode())
            if header.get("format") != FORMAT:
                raise ValueError(f"{path}: unsupported checkpoint format {header.get('format')!r}")
            params = {k[len("param/") :]: z[k] for k in z.files if k.startswith("param/")}
            names = {k[2:] for k in z.files if k.startswith("m/")}
            moments = {n: (z[f"m/{n}"], z[f"v/{n}"]) for n in sorted(names)}
        return cls(params, moments, int(header["iteration"]), dict(header.get("meta", {})))
