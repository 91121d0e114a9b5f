"""The clause registry (clauses.toml) and the seeded-defect registry (mutants.toml) as data."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from functools import cache
from importlib import resources

ID_PATTERN = re.compile(r"^(BASE|CANCEL|FAIL|SHAPE|HOST|TOPO|TX-OWN|TX-ACC|TX-RET|TX-FAIL|TX-PROF|HARNESS)-\d{2}[a-f]?$")


@dataclass(frozen=True)
class Clause:
    id: str
    document: str
    section: str
    text: str
    how: str = ""
    parent: str | None = None

    @property
    def family(self) -> str:
        return self.id.rsplit("-", 1)[0]


@dataclass(frozen=True)
class Mutant:
    """A seeded defect: a switch compiled into the native code that breaks one clause."""

    clause: str
    where: str
    defect: str


def _load(name: str) -> dict:
    return tomllib.loads(resources.files("conformance").joinpath(name).read_text(encoding="utf-8"))


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
def mutants() -> dict[str, Mutant]:
    out = {}
    for raw in _load("mutants.toml")["mutant"]:
        m = Mutant(**raw)
        if m.clause not in clauses():
            raise ValueError(f"mutants.toml: seeded defect for unknown clause {m.clause}")
        out[m.clause] = m
    return out


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
