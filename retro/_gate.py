"""The packed-topology cache gate's pure decision (TOPO-07, HARNESS-08), from a results package's
evidence alone: the one decision the trainer takes (retro.topology) and the harness records and
prints (retro.conformance.gate). It reads plain data and imports neither the binding nor the
harness.

The cache may be enabled for a set of target backends (the CPU, the oracle, always among them)
only when, on each of them, every TOPO, FAIL, HOST and CANCEL clause of the contract passes, and
the measurement records of the same package show the cache removing at least 90 % of the
per-step rebuild cost (forward build, backward expansion and allocation), averaged over every
configuration the checks measured: accumulation 1, and the common ones (accumulation 2 with an
evaluation tail; packed documents; the fused head). Anything else refuses, naming
what is missing: which clause on which backend, with its status, and which figure."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from functools import cache
from importlib import resources
from typing import Any

#: a results package, as json.load gives it
Package = dict[str, Any]

NAME = "topology-cache"
GATED = ("TOPO-", "FAIL-", "HOST-", "CANCEL-")
#: the share of the per-step rebuild cost the cache must remove
REMOVED_AT_LEAST = 0.90
#: the measurement record a check writes of the per-step rebuild cost, with the cache "off" or "on"
MEASUREMENT = "topology-rebuild"
REBUILD_PARTS = ("forward_build_us", "backward_build_us", "alloc_us")
#: the results package's schema version (retro.conformance writes it; the gate reads it)
SCHEMA = 3


@cache
def contract_ids() -> tuple[str, ...]:
    """Every clause ID shared/CONTRACTS.md names, in its order (contracts.ids, the spec's list as data)."""
    text = resources.files(__package__).joinpath("contracts.ids").read_text(encoding="utf-8")
    return tuple(line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#"))


def gated_clauses() -> tuple[str, ...]:
    """The contract's clauses the gate requires."""
    return tuple(cid for cid in contract_ids() if cid.startswith(GATED))


def digest(package: Package) -> str:
    """sha256 of the canonical JSON of everything but the digest itself."""
    body = {k: v for k, v in package.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def verify(package: Package) -> None:
    """ValueError unless the package has this schema and its digest matches its content."""
    if package.get("schema") != SCHEMA:
        raise ValueError(f"unsupported results schema {package.get('schema')!r}")
    if package.get("digest") != digest(package):
        raise ValueError("results digest mismatch: the file was changed after it was written")


def rebuild_cost(package: Package, backend: str, cache_state: str) -> tuple[float, dict[str, Any]] | None:
    """The mean per-step rebuild cost (µs) over the intact, passing runs' records on one backend
    (one per configuration measured), with the first record; None when no such record exists."""
    records = [
        m
        for c in package["cases"]
        if c["backend"] == backend and c["defect"] is None and c["outcome"] == "pass"
        for m in c.get("measurements", [])
        if m["name"] == MEASUREMENT and m["cache"] == cache_state
    ]
    if not records:
        return None
    costs = [sum(m[p] for p in REBUILD_PARTS) for m in records]
    return sum(costs) / len(costs), records[0]


def targets_of(package: Package, targets: Sequence[str] | None) -> list[str]:
    """The backends the decision covers: those named, else every backend of the package; the CPU
    first and always."""
    names = list(targets) if targets else list(package["backends"])
    return ["cpu", *[n for n in dict.fromkeys(names) if n != "cpu"]]


def _no_defect(defect: str) -> bool:
    return False


def decide(
    package: Package, targets: Sequence[str] | None = None, *, seeded: Callable[[str], bool] = _no_defect
) -> dict[str, Any]:
    """The decision on a results package (the fields results.json carries under gates). seeded
    reads HARNESS-08's seeded-defect switches: the caller's door to them (this module imports
    neither the binding nor the harness)."""
    names = targets_of(package, targets)
    evidence: list[str] = []
    missing: list[str] = []
    for name in names:
        b = package["backends"].get(name)
        if b is None or b["status"] != "available":
            if seeded("HARNESS-08"):
                continue  # seeded defect: an absent target skipped, not a blocker
            why = "not in the package" if b is None else f"not available ({b.get('reason', '')})"
            missing.append(f"{name}: {why}")
            continue
        for cid in gated_clauses():
            status = package["clauses"].get(cid, {}).get(name, "not selected")
            line = f"{cid} on {name}: {status}"
            counted = status == "pass"
            if seeded("HARNESS-08.short-of-a-fail"):
                counted = status != "fail"  # seeded defect: whatever is not a failure counts
            if counted:
                evidence.append(line)
            else:
                detail = package["clause_details"].get(cid, {}).get(name, "")
                missing.append(line + (f" ({detail})" if detail else ""))
        off, on = rebuild_cost(package, name, "off"), rebuild_cost(package, name, "on")
        if off is None:
            missing.append(f"{name}: the per-step rebuild cost with the cache off is not measured")
        if on is None:
            missing.append(f"{name}: the per-step rebuild cost with the cache on is not measured")
        if off is not None:
            evidence.append(f"{name}: rebuild with the cache off {off[0]:.0f} µs per step ({_parts(off[1])})")
        if off is not None and on is not None:
            removed = 1.0 - on[0] / off[0] if off[0] > 0 else 0.0
            line = f"{name}: the cache removes {removed:.1%} of the rebuild ({on[0]:.0f} of {off[0]:.0f} µs left)"
            (evidence if removed >= REMOVED_AT_LEAST else missing).append(
                line + ("" if removed >= REMOVED_AT_LEAST else f", under {REMOVED_AT_LEAST:.0%}")
            )
    return {
        "gate": NAME,
        "decision": "enable" if not missing else "refuse",
        "targets": names,
        "evidence": evidence,
        "missing": missing,
    }


def _parts(record: dict[str, Any]) -> str:
    return ", ".join(f"{p.removesuffix('_us').replace('_', ' ')} {record[p]:.0f}" for p in REBUILD_PARTS) + (
        f"; a step {record['step_us']:.0f} µs" if "step_us" in record else ""
    )
