"""Clause-bound assertions: how a conformance check asserts what it proves.

``expect("FAIL-05", cond, "why")`` and ``with bound("BASE-03"): ...`` (for numpy's and pytest's own
assertions) tie every assertion to one clause. The plugin runs each check intact, where any bound
assertion that fails fails the check, and once per seeded defect of each clause it cites, where
only assertions bound to that defect's clause are enforced: the others are recorded and the check
goes on, so that a defect counts as caught for clause X only when an assertion bound to X failed.
An intact run that never asserted through a clause it cites fails: that citation proves nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import pytest

from . import backends, registry

T = TypeVar("T")


class ClauseViolation(AssertionError):
    """A failed assertion bound to a clause."""

    def __init__(self, clause: str, message: str) -> None:
        super().__init__(f"{clause}: {message}")
        self.clause = clause
        self.message = message


@dataclass
class Ledger:
    """What one case asserted: the clauses it asserted through, and what failed under a defect."""

    enforced: str | None  # the clause whose assertions raise; None: every clause's (intact run)
    backend: str = ""  # the backend under test (a Bound's limit may depend on it)
    asserted: set[str] = field(default_factory=set)
    bounds: dict[str, dict] = field(default_factory=dict)  # per Bound, the largest error held to it
    measurements: list[dict] = field(default_factory=list)  # figures recorded beside the assertions
    tolerated: list[ClauseViolation] = field(default_factory=list)  # failed, not enforced here
    paths: set[str] = field(default_factory=set)  # paths driven inside the case (on_path), as they ran

    def record(self, violation: ClauseViolation | None, clause: str) -> None:
        self.asserted.add(clause)
        if violation is None:
            return
        if self.enforced is None or self.enforced == clause:
            raise violation
        self.tolerated.append(violation)


_ledger: Ledger | None = None


def begin(enforced: str | None, backend: str = "") -> Ledger:
    global _ledger
    _ledger = Ledger(enforced, backend)
    return _ledger


def end() -> None:
    global _ledger
    _ledger = None


def _record(violation: ClauseViolation | None, clause: str) -> None:
    if _ledger is None:  # outside a conformance case (a helper used from tests/): plain assert
        if violation is not None:
            raise violation
        return
    _ledger.record(violation, clause)


def expect(clause: str, condition: object, message: str = "") -> None:
    """Assert `condition` as evidence for `clause`."""
    _record(None if condition else ClauseViolation(clause, message or "expectation failed"), clause)


@contextmanager
def bound(clause: str) -> Iterator[None]:
    """Bind the assertions inside (numpy.testing, pytest.raises, plain assert) to `clause`. Where
    the clause is not enforced (another clause's defect run), a failure inside is recorded and the
    block is left. An exception escaping the block is its assertion failing too: a pytest.raises
    that met another kind of exception, a comparison that could not be made (the block holds
    only what the clause promises, so what it raises is the clause's failure, not the check's)."""
    try:
        yield
    except (AssertionError, pytest.fail.Exception) as err:
        if isinstance(err, ClauseViolation):
            raise
        text = (str(err).strip().splitlines() or ["assertion failed"])[0]
        _record(ClauseViolation(clause, text), clause)
    except Exception as err:  # noqa: BLE001 - see above; pytest's outcomes are no Exception
        text = (str(err).strip().splitlines() or [""])[0]
        _record(ClauseViolation(clause, f"raised {type(err).__name__}: {text}"[:500]), clause)
    else:
        _record(None, clause)


@contextmanager
def raises_bound(clause: str, kind: type[BaseException]) -> Iterator[pytest.ExceptionInfo]:
    """pytest.raises(kind), bound to `clause`: the block raising nothing, or an exception of
    another kind, is a failed assertion of the clause (another kind is what the clause promised
    not coming, not an error of the check)."""
    with bound(clause):
        try:
            with pytest.raises(kind) as info:
                yield info
        except (AssertionError, pytest.fail.Exception):
            raise
        except Exception as err:  # noqa: BLE001 - the clause's failure, named
            pytest.fail(f"raised {type(err).__name__}: {err} where {kind.__name__} was due")


def succeeds(clause: str, what: str, call: Callable[[], T]) -> T | None:
    """`call()`, bound to `clause`, which promised it succeeds: whatever it raises is a failed
    assertion of the clause, never an error of the check. Its result, or None where the clause was
    not enforced (another clause's defect run) and the failure was recorded."""
    with bound(clause):
        try:
            return call()
        except Exception as err:  # noqa: BLE001 - the clause promised a call that succeeds
            pytest.fail(f"{what} failed: {type(err).__name__}: {err}")
    return None


def nmse(actual: np.ndarray, expected: np.ndarray) -> float:
    """Normalized mean squared error, as llama.cpp's test-backend-ops compares a backend with the
    CPU: sum((a - e)^2) / sum(e^2) (0 when both are all zero)."""
    a, e = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    if a.shape != e.shape:
        return math.inf
    denominator = float(np.sum(e * e))
    numerator = float(np.sum((a - e) ** 2))
    if registry.seeded("HARNESS-01.nmse-mean"):
        numerator = float(np.mean((a - e) ** 2))  # seeded defect: a mean over a sum
    return numerator / denominator if denominator else (0.0 if numerator == 0 else math.inf)


#: a bound this many times wider than the largest error an intact run measures needs a reason
WIDE = 10.0


@dataclass(frozen=True)
class Bound:
    """A numeric bound of a check, defined once beside it: the report groups every error held to
    it by its name and shows its limit beside the largest error an intact run measured on each
    backend and the smallest error of a seeded defect that crossed it (results.bound_table). Where
    the CPU's numerics allow a tighter limit than other kernels' (a GPU's reorder float sums), `cpu`
    is that limit, on every backend that computes with them (backends.cpu_numerics). A limit more
    than WIDE times what an intact run measures says why, with the figure it was sized from: `reason`
    for `limit`, `cpu_reason` for `cpu` (each limit its own reason: a GPU's does not excuse the
    CPU's, results.bound_table). A backend measured to need less than `limit` (or more) has its own,
    in `measured`: (limit, reason) by backend name, the RPC backend's for its GPU-like numerics."""

    name: str
    limit: float
    cpu: float | None = None
    reason: str = ""
    cpu_reason: str = ""
    measured: Mapping[str, tuple[float, str]] = field(default_factory=dict, hash=False, compare=False)

    def _for_cpu(self, backend: str) -> bool:
        return backends.cpu_numerics(backend) and self.cpu is not None

    def on(self, backend: str) -> float:
        """The limit that applies on `backend`."""
        if self._for_cpu(backend) and self.cpu is not None:
            return self.cpu
        return self.measured[backend][0] if backend in self.measured else self.limit

    def reason_on(self, backend: str) -> str:
        """Why the limit that applies on `backend` is as wide as it is ("" where none is given)."""
        if self._for_cpu(backend):
            return self.cpu_reason
        return self.measured[backend][1] if backend in self.measured else self.reason


def within(clause: str, bound: Bound, observation: str, error: float, what: str = "error") -> None:
    """Assert (for `clause`) that an error measured on the backend under test is within `bound`;
    the case's largest error held to each bound, where it was measured and the limit applied go
    into results.json with the case."""
    limit = held(bound, observation, error)
    expect(clause, error <= limit, f"{observation}: {what} {error:.3g} exceeds {limit:g} ({bound.name})")


def held(bound: Bound, observation: str, error: float) -> float:
    """Record an error held to `bound` (for a helper whose caller binds its assertion to a clause)
    and return the limit that applies on the backend under test."""
    backend = _ledger.backend if _ledger is not None else ""
    limit, reason = bound.on(backend), bound.reason_on(backend)
    if _ledger is not None:
        # JSON has no infinity: a shape mismatch or a zero reference reads as 1e300
        record = {"bound": bound.name, "observation": observation, "error": min(error, 1e300), "limit": limit}
        worst = _ledger.bounds.get(bound.name)
        if worst is None or record["error"] > worst["error"]:
            _ledger.bounds[bound.name] = record | ({"reason": reason} if reason else {})
    return limit


def against_oracle(clause: str, observation: str, actual: np.ndarray, expected: np.ndarray, bound: Bound) -> None:
    """Assert (for `clause`) that an observation made on the backend under test agrees with the
    same observation made on the CPU, by NMSE within `bound`."""
    within(clause, bound, observation, nmse(actual, expected), "NMSE against the CPU")


def on_path(*paths: str) -> None:
    """Record that the case has just run these paths (name=value, as the registry names them), on
    the backend under test, after the assertions that prove them held. This is the only way a path
    counts for a case's clauses (when its intact run passes): a check's parameters, or its
    @pytest.mark.drives, say what it means to drive, not what ran. Outside a conformance case it
    is dropped."""
    if _ledger is not None:
        _ledger.paths.update(paths)


def measure(name: str, **figures: float | str) -> None:
    """Record a measurement beside the case's assertions: it goes into results.json with the case
    (a gate reads it there, retro/_gate.py). Outside a conformance case it is dropped."""
    if _ledger is not None:
        _ledger.measurements.append({"name": name, **figures})
