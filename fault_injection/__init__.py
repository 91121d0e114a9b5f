"""Fault injection into the patched llama.cpp, SQLite-style (installed as ``retro.fault_injection``).

The fork calls a hook at every site a training step can fail before or during compute
(fault_injection/native/retro-sites.def, the only list of them); with a plan armed, the hook fails
the chosen hit of the chosen site (and, persistently, every later one). `sweep` drives an
operation through every hit of a site: fail at hit 1, then 2, ... until the operation completes
with the armed failure never reached.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from retro import _checks
from retro._native import hooks as _hooks

#: every site compiled into the fork, in the order a training step meets them
SITES: tuple[str, ...] = tuple(_hooks.sites())


def _check_site(site: str) -> str:
    if site not in SITES:
        raise ValueError(f"unknown fault site {site!r}; known: {', '.join(SITES)}")
    return site


def arm(site: str, hit: int, *, persistent: bool = False) -> None:
    """Fail the `hit`-th hit of `site` from now (1-based); persistent: every later hit too."""
    if isinstance(hit, bool) or not isinstance(hit, int) or hit < 1:
        raise ValueError("hit must be an int >= 1")
    _hooks.arm(_check_site(site), hit, persistent)


def stall(site: str, hit: int, seconds: float) -> None:
    """Park the thread that makes the `hit`-th hit of `site` from now for `seconds`, then let the
    site go on (a call held inside its real work, while other threads call in); reset clears it."""
    if isinstance(hit, bool) or not isinstance(hit, int) or hit < 1:
        raise ValueError("hit must be an int >= 1")
    if not isinstance(seconds, (int, float)) or not 0 < seconds <= 60:
        raise ValueError("seconds must be a number in (0, 60]")
    _hooks.stall(_check_site(site), hit, round(seconds * 1e6))


def stalling() -> bool:
    """True while a thread is parked by `stall`."""
    return bool(_hooks.stalling())


@contextlib.contextmanager
def ungated_topology_cache() -> Iterator[None]:
    """Within it, ``retro.Trainer(topology_cache=True)`` switches the packed-topology cache on
    without a gate package: for the checks whose results are the gate's evidence (TOPO-07). A
    ValueError in a release build, which switches the cache on through the gate alone."""
    _checks.waive_topology_gate(True)
    try:
        yield
    finally:
        still_waived = False
        if _checks.seeded("TOPO-07.waiver"):  # seeded defect: a BaseException leaves the waiver on
            raised = sys.exc_info()[0]
            still_waived = raised is not None and not issubclass(raised, Exception)
        _checks.waive_topology_gate(still_waived)


def reset() -> None:
    """Disarm every site and zero the counters."""
    _hooks.reset()


def hits(site: str) -> int:
    """Hits of a fault site since the last reset (each is one pass of the library through it)."""
    return int(_hooks.hits(_check_site(site)))


def failures(site: str) -> int:
    return int(_hooks.failures(_check_site(site)))


@dataclass
class Injection:
    hit: int
    error: BaseException | None  # what the operation raised, None if it swallowed the failure


@dataclass
class Sweep:
    site: str
    persistent: bool
    injections: list[Injection] = field(default_factory=list)
    completed_after: int = 0  # the hit count at which the operation first ran to completion


def sweep(
    operation: Callable[[], object],
    site: str,
    *,
    persistent: bool = False,
    max_hits: int = 10_000,
    check: Callable[[Injection], None] | None = None,
) -> Sweep:
    """Run `operation` once per hit of `site`, failing that hit (once, or from it on), until an
    armed run completes without reaching its hit. `operation` must build its own fresh state.
    `check` inspects each injection (the error raised) and may assert on the state left behind."""
    _check_site(site)
    result = Sweep(site, persistent)
    for n in range(1, max_hits + 1):
        reset()
        arm(site, n, persistent=persistent)
        error: BaseException | None = None
        try:
            operation()
        except Exception as err:  # noqa: BLE001 - every error is evidence, judged by `check`
            error = err
        fired = failures(site) > 0
        reset()
        if not fired:
            if error is not None:
                raise error
            result.completed_after = n - 1
            return result
        inj = Injection(n, error)
        result.injections.append(inj)
        if check is not None:
            check(inj)
    raise RuntimeError(f"{site}: the operation still reached the armed hit after {max_hits} runs")
