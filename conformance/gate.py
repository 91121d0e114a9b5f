"""The packed-topology cache gate (TOPO-07, HARNESS-08) as the harness records and prints it. The
decision itself is the library's (retro._gate): one pure function of a results package, the same
one the trainer takes before it switches the cache on."""

from __future__ import annotations

from collections.abc import Sequence

from retro import _gate
from retro._gate import GATED, MEASUREMENT, NAME, REBUILD_PARTS, REMOVED_AT_LEAST, rebuild_cost, targets_of

from . import registry

__all__ = [
    "GATED",
    "MEASUREMENT",
    "NAME",
    "REBUILD_PARTS",
    "REMOVED_AT_LEAST",
    "decide",
    "rebuild_cost",
    "summary",
    "targets_of",
]


def decide(results: dict, targets: Sequence[str] | None = None) -> dict:
    """The decision on a results package (the fields results.json carries under gates)."""
    return _gate.decide(results, targets, seeded=registry.seeded)


def summary(decision: dict, *, limit: int | None = 5) -> list[str]:
    """Lines to print: the decision, then what blocks it (all, or the first `limit`)."""
    lines = [
        f"gate {decision['gate']}: {decision['decision']} on {', '.join(decision['targets'])} "
        f"({len(decision['evidence'])} pieces of evidence, {len(decision['missing'])} missing)"
    ]
    shown = decision["missing"] if limit is None else decision["missing"][:limit]
    lines += [f"  missing: {m}" for m in shown]
    if len(shown) < len(decision["missing"]):
        lines.append(f"  ... {len(decision['missing']) - len(shown)} more in report.md")
    return lines
