"""The clause registry (clauses.toml) and the seeded-defect registry (mutants.toml) as data."""

from __future__ import annotations

import re
import sys
import tomllib
from dataclasses import dataclass
from functools import cache
from importlib import resources

ID_PATTERN = re.compile(
    r"^(BASE|CANCEL|FAIL|SHAPE|HOST|TOPO|TX-OWN|TX-ACC|TX-RET|TX-FAIL|TX-PROF|HARNESS)-\d{2}[a-f]?$"
)
DEFECT_PATTERN = re.compile(r"^(?P<clause>[A-Z-]+-\d{2}[a-f]?)(\.[a-z0-9-]+)?$")


@dataclass(frozen=True)
class Clause:
    id: str
    document: str
    section: str
    text: str
    how: str = ""
    parent: str | None = None
    reading: str = ""  # the reading the suite chose where the clause leaves one open, and why
    unimplemented: str = ""  # parts of the clause the binding does not implement (reported, never passed)

    @property
    def family(self) -> str:
        return self.id.rsplit("-", 1)[0]


@dataclass(frozen=True)
class Defect:
    """A seeded defect: a switch compiled into the native code (or read by the Python layer) that
    breaks one clause the way a maintainer's mistake would."""

    id: str
    where: str
    defect: str
    # the backends where the mistake can show (empty: every backend); elsewhere it is not run
    backends: tuple[str, ...] = ()

    def applies_to(self, backend: str) -> bool:
        return not self.backends or backend in self.backends

    @property
    def clause(self) -> str:
        m = DEFECT_PATTERN.match(self.id)
        assert m is not None
        return m["clause"]


def _load(name: str) -> dict:
    return tomllib.loads(resources.files(__package__).joinpath(name).read_text(encoding="utf-8"))


@cache
def clauses() -> dict[str, Clause]:
    data = _load("clauses.toml")
    out: dict[str, Clause] = {}
    for raw in data["clause"]:
        c = Clause(**raw)
        if not ID_PATTERN.match(c.id):
            raise ValueError(f"clauses.toml: malformed clause id {c.id!r}")
        if c.id in out:
            raise ValueError(f"clauses.toml: duplicate clause id {c.id}")
        if c.document not in data["documents"]:
            raise ValueError(f"clauses.toml: {c.id} names unknown document {c.document!r}")
        out[c.id] = c
    return out


@cache
def defects() -> dict[str, Defect]:
    """Every seeded defect by id, in mutants.toml's order."""
    out: dict[str, Defect] = {}
    for raw in _load("mutants.toml")["defect"]:
        d = Defect(**{**raw, "backends": tuple(raw.get("backends", ()))})
        if not DEFECT_PATTERN.match(d.id) or d.clause not in clauses():
            raise ValueError(f"mutants.toml: {d.id!r} names no clause of the registry")
        if d.id in out:
            raise ValueError(f"mutants.toml: duplicate defect {d.id}")
        out[d.id] = d
    return out


def defects_of(clause: str, backend: str | None = None) -> list[str]:
    """The seeded defects of a clause (those that can show on `backend`, when given)."""
    return [d.id for d in defects().values() if d.clause == clause and (backend is None or d.applies_to(backend))]


def check_switches(compiled: list[str]) -> None:
    """The descriptions must match the switches compiled into the build, one to one."""
    described = set(defects())
    if set(compiled) != described:
        raise ValueError(
            "mutants.toml and fault_injection/native/retro-defects.def disagree: "
            f"undescribed {sorted(set(compiled) - described)}, without a switch {sorted(described - set(compiled))}"
        )


def seeded(defect: str) -> bool:
    """The door of the harness's own modules to a seeded-defect switch. A switch can be on only in
    a process that loaded the binding, so one that merely merges results never loads it here."""
    native = sys.modules.get("retro._native")
    return bool(native is not None and native.hooks.defect_on(defect))


def unknown_ids(ids: list[str] | tuple[str, ...]) -> list[str]:
    known = clauses()
    return [i for i in ids if i not in known]


def select(patterns: list[str] | None) -> list[str]:
    """Clause IDs in registry order (all when None) named by the patterns: a pattern that is a
    clause ID names that clause alone ("FAIL-04"); any other names the IDs it begins ("FAIL", "TX-")."""
    ids = list(clauses())
    if not patterns:
        return ids
    return [i for i in ids if any(i == p or (p not in ids and i.startswith(p)) for p in patterns)]
