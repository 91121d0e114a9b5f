"""The packed-topology cache (fork patches 0037/0038, 0056): its counters, and the gate that decides
whether a trainer may switch it on.

The cache is off by default. ``Trainer(topology_cache=True)`` switches it on only with a results
package whose packed-topology gate (``retro-conformance gate topology-cache``) enables it for this
build (retro, llama.cpp pin, patch series) and for every backend the trainer's model runs on;
the checks that produce that evidence switch it on without one through the harness's test door
(``retro.fault_injection.ungated_topology_cache``), which a release build does not have: there, and
through this API in every build, the cache is switched on through the gate alone (TOPO-07)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, NamedTuple

from . import _checks
from .devices import backends_of as _backends_of
from .errors import TopologyGateError

#: the fork's reasons (enum llama_opt_topology_reason), in its order: what a miss missed on (the
#: first five), and the events that invalidate the entry (the rest)
REASONS = ("empty", "geometry", "targets", "head", "kind", "trainable", "decode", "preflight", "layout", "error", "off")
MISSES = REASONS[:6]
#: where a trainer looks for the gate's results package when none is given
GATE_ENV = "RETRO_TOPOLOGY_GATE"
MODES = (False, True)


class TopologyCacheStats(NamedTuple):
    """The fork's counters of the cache, since the trainer was made: steps that ran the entry's
    graphs (``hits``), that built their own (``misses``, by the key part that differed), that
    allocated a clone of them, and entries dropped by an event (``invalidations``, by event)."""

    enabled: bool
    has_entry: bool
    hits: int
    misses: int
    allocations: int
    invalidations: int
    misses_by: dict[str, int]
    invalidations_by: dict[str, int]
    last_reason: str | None

    @classmethod
    def _from_native(cls, d: dict[str, Any]) -> TopologyCacheStats:
        by = dict(zip(REASONS, d["by_reason"], strict=True))
        return cls(
            enabled=bool(d["enabled"]),
            has_entry=bool(d["has_entry"]),
            hits=int(d["hits"]),
            misses=int(d["misses"]),
            allocations=int(d["allocations"]),
            invalidations=int(d["invalidations"]),
            misses_by={r: by[r] for r in MISSES},
            invalidations_by={r: by[r] for r in REASONS[len(MISSES) :]},
            last_reason=None if d["last_reason"] < 0 else REASONS[d["last_reason"]],
        )


def backends_of(tensor_devices: dict[str, str]) -> list[str]:
    """The conformance backends a model runs on, from the devices its weights live on (the CPU
    always)."""
    return _backends_of(tensor_devices.values())


def check_mode(mode: object) -> bool:
    if not isinstance(mode, bool):
        raise ValueError(f"topology_cache must be False or True, not {mode!r}")
    return mode


def gated(mode: bool) -> bool:
    """Whether switching the cache on needs the gate: always, but while the harness's test door
    waives it for the checks that make the gate's evidence."""
    return mode and not _checks.topology_gate_waived()


def require_gate(package: str | os.PathLike[str] | None, backends: list[str]) -> None:
    """Raise :class:`retro.TopologyGateError`, naming what is missing, unless the results package
    (a folder holding results.json, or the file) enables the cache for this build and backends."""
    import retro

    from . import _gate

    where = package if package is not None else os.environ.get(GATE_ENV)
    if not where:
        raise TopologyGateError(
            "the packed-topology cache needs a results package whose gate enables it (topology_gate=DIR, "
            f"or ${GATE_ENV})"
        )
    path = Path(where)
    path = path / "results.json" if path.is_dir() else path
    try:
        package_json = json.loads(path.read_text(encoding="utf-8"))
        _gate.verify(package_json)
    except (OSError, ValueError) as err:
        raise TopologyGateError(f"the gate's results package {path} cannot be read: {err}") from err
    info = retro.build_info()
    mine = {
        "retro": retro.__version__,
        "llama_cpp": info["llama_cpp_commit"],
        "patch_series_sha256": info["patch_series_sha256"],
    }
    missing = []
    if not _checks.seeded("TOPO-07"):  # seeded defect: a package of any build is taken as this one's
        for shard in package_json["shards"]:
            named = dict(mine)
            if _checks.seeded("TOPO-07.unnamed"):  # seeded defect: a shard that names no build passes
                named = {key: value for key, value in mine.items() if key in shard}
            missing += [
                f"shard of another build ({key} {shard.get(key)}, this build {value})"
                for key, value in named.items()
                if shard.get(key) != value
            ]
    targets: list[str] | None = backends
    if _checks.seeded("TOPO-07.backends"):
        targets = None  # seeded defect: decided for the package's backends, not the model's
    decision = _gate.decide(package_json, targets, seeded=_checks.seeded)
    missing += decision["missing"]
    if missing:
        shown = "; ".join(missing[:6]) + (f"; and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise TopologyGateError(f"the packed-topology cache is refused for {', '.join(backends)} by {path}: {shown}")
