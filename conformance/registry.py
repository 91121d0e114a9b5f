"""The clause registry (clauses/, one file per seed) and the seeded-defect registry (mutants.toml)
as data, and the clause-ID grammar."""

from __future__ import annotations

import os
import re
import sys
import tomllib
from collections.abc import Collection
from dataclasses import dataclass, field
from functools import cache
from importlib import resources

from retro.devices import BACKENDS

from .shapes import DEFAULT as DEFAULT_SHAPE
from .shapes import SHAPES

#: the clause-ID grammar, defined once: the registry, the schema (results.schema.json, held to it
#: by tests/test_conformance_registry.py) and the tests read it from here
FAMILIES = (
    "BASE",
    "CANCEL",
    "FAIL",
    "SHAPE",
    "HOST",
    "TOPO",
    "TX-OWN",
    "TX-ACC",
    "TX-RET",
    "TX-FAIL",
    "TX-PROF",
    "HARNESS",
)
ID_GRAMMAR = "(?:" + "|".join(FAMILIES) + ")-[0-9]{2}[a-f]?"
#: a seeded defect's id: its clause's ID, or that ID, a dot and a name where a clause has several
DEFECT_GRAMMAR = ID_GRAMMAR + r"(?:\.[a-z0-9-]+)?"
ID_PATTERN = re.compile(f"^{ID_GRAMMAR}$")
ID_IN_TEXT = re.compile(rf"\b{ID_GRAMMAR}\b")
DEFECT_PATTERN = re.compile(rf"^(?P<clause>{ID_GRAMMAR})(?:\.[a-z0-9-]+)?$")
#: a path of a clause (Clause.paths): a check parameter and its value, as a case id writes them
PATH_PATTERN = re.compile(r"^[a-z_]+=[^,\[\]]+$")
#: the registry, one file per seed (clauses/), in this order
REGISTRY_FILES = ("training.toml", "transactions.toml", "harness.toml")
#: what a clause's checks prove: the binding (and the fork), or the harness's own code alone
SUBJECTS = ("binding", "harness")
#: where a path exists only on some backends (Clause.path_backends), besides backend names: every
#: backend with a device of its own to offload to, i.e. every one but the CPU
OFFLOAD = "offload"


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
    subject: str = "binding"  # SUBJECTS: "harness" for a clause whose checks run none of the binding
    # the paths the clause names, each of which must run, on every backend, in a check citing it
    # that asserted through it: "name=value", a parameter of the check (its case id shows it), or
    # one the check drives inside a case (declared with @pytest.mark.drives, recorded when it runs
    # with evidence.on_path)
    paths: tuple[str, ...] = ()
    # the paths that exist only on some backends (backend names, or OFFLOAD), with the reason in
    # `reading`; elsewhere they are not paths of the clause
    path_backends: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def family(self) -> str:
        return self.id.rsplit("-", 1)[0]

    @property
    def backend_independent(self) -> bool:
        """Its checks prove the harness's own code: one verdict, whichever backend ran them."""
        return self.subject == "harness"

    def paths_on(self, backend: str | None) -> tuple[str, ...]:
        """The paths that must run on `backend` (every path when None)."""
        return tuple(p for p in self.paths if backend is None or _exists_on(self.path_backends.get(p), backend))


def _exists_on(where: tuple[str, ...] | None, backend: str) -> bool:
    return where is None or backend in where or (OFFLOAD in where and backend != "cpu")


@dataclass(frozen=True)
class Defect:
    """A seeded defect: a switch compiled into the native code (or read by the Python layer) that
    breaks one clause the way a maintainer's mistake would."""

    id: str
    where: str
    defect: str
    # the backends where the mistake can show (empty: every backend); elsewhere it is not run
    backends: tuple[str, ...] = ()
    # who wrote it, when not the check's own author: a reviewer who had not read the check
    author: str = ""
    # a mistake of the runner (the plugin), which a check shows on a certification it starts: that
    # run's interpreters inherit the switch (INHERITED_ENV)
    inherited: bool = False
    # the shape profiles (conformance/shapes.py) its runs take: a check's intact run proves it at
    # each profile it names, its defect runs prove the check can fail at these (empty: the default)
    shapes: tuple[str, ...] = ()

    def applies_to(self, backend: str) -> bool:
        return not self.backends or backend in self.backends

    @property
    def clause(self) -> str:
        m = DEFECT_PATTERN.match(self.id)
        assert m is not None
        return m["clause"]


def _load(*path: str) -> dict:
    return tomllib.loads(resources.files(__package__).joinpath(*path).read_text(encoding="utf-8"))


@cache
def clauses() -> dict[str, Clause]:
    """Every clause by ID, in the order of REGISTRY_FILES and of each file."""
    out: dict[str, Clause] = {}
    for name in REGISTRY_FILES:
        data = _load("clauses", name)
        for raw in data["clause"]:
            where = {p: tuple(b) for p, b in raw.get("path_backends", {}).items()}
            c = Clause(**{**raw, "paths": tuple(raw.get("paths", ())), "path_backends": where})
            if any(not PATH_PATTERN.match(p) for p in c.paths):
                raise ValueError(f"clauses/{name}: {c.id}: a path is name=value, not {c.paths}")
            named = {b for bs in where.values() for b in bs}
            if any(p not in c.paths or not b for p, b in where.items()) or named - {*BACKENDS.values(), OFFLOAD}:
                raise ValueError(f"clauses/{name}: {c.id}: path_backends names a path it lacks, or no known backend")
            if not ID_PATTERN.match(c.id):
                raise ValueError(f"clauses/{name}: malformed clause id {c.id!r}")
            if c.id in out:
                raise ValueError(f"clauses/{name}: duplicate clause id {c.id}")
            if c.document not in data["documents"]:
                raise ValueError(f"clauses/{name}: {c.id} names unknown document {c.document!r}")
            if c.subject not in SUBJECTS:
                raise ValueError(f"clauses/{name}: {c.id} has unknown subject {c.subject!r}")
            out[c.id] = c
    return out


def spec_ids() -> list[str]:
    """The clause IDs shared/CONTRACTS.md names (retro/contracts.ids, the spec's list as data: the
    library carries it, since its topology gate requires clauses of it by ID)."""
    from retro._gate import contract_ids

    return list(contract_ids())


@cache
def defects() -> dict[str, Defect]:
    """Every seeded defect by id, in mutants.toml's order."""
    out: dict[str, Defect] = {}
    for raw in _load("mutants.toml")["defect"]:
        d = Defect(**{**raw, "backends": tuple(raw.get("backends", ())), "shapes": tuple(raw.get("shapes", ()))})
        if not DEFECT_PATTERN.match(d.id) or d.clause not in clauses():
            raise ValueError(f"mutants.toml: {d.id!r} names no clause of the registry")
        if set(d.shapes) - set(SHAPES):
            raise ValueError(
                f"mutants.toml: {d.id} names unknown shape profile(s) {sorted(set(d.shapes) - set(SHAPES))}"
            )
        if d.id in out:
            raise ValueError(f"mutants.toml: duplicate defect {d.id}")
        out[d.id] = d
    return out


@dataclass(frozen=True)
class ReviewedDefect:
    """A defect written by a reviewer who had not read the checks of its clause (reviewed_defects.toml),
    with what the checks of its day gave it at first judgment."""

    id: str
    clause: str
    round: str
    judged_at: str
    file: str
    original: str
    mutated: str
    why: str
    first_judgment: str  # "caught", "escaped" or "out of clause"
    caught_by: tuple[str, ...] = ()
    caught_since: str = ""  # an escape: what catches it now
    out_of_clause: str = ""  # why its clause does not govern it
    still_open: str = ""  # an escape no check catches yet: what it takes (a finding, named, not hidden)
    equivalent: str = ""  # an escape that cannot change what the binding does: why (as a mutant's)

    @property
    def counts(self) -> bool:
        """Counted for its clause by the published rule: its own clause's assertion caught it at first
        judgment (a catch by another clause, or by a check grown since, proves nothing for this one)."""
        return self.first_judgment == "caught" and self.clause in self.caught_by


# what a clause needs by the rule before its reviewers' evidence is enough (tests/test_conformance_registry.py)
OWN_CATCHES_WANTED = 3

FIRST_JUDGMENTS = ("caught", "escaped", "out of clause")


@cache
def reviewed_defects() -> dict[str, ReviewedDefect]:
    """Every reviewer's defect by id; each names a clause of the registry, and an escape says what
    catches it since (or why it lies outside its clause)."""
    out: dict[str, ReviewedDefect] = {}
    for raw in _load("reviewed_defects.toml")["defect"]:
        d = ReviewedDefect(**{**raw, "caught_by": tuple(raw.get("caught_by", ()))})
        unknown = [c for c in (d.clause, *d.caught_by) if c not in clauses()]
        if unknown or d.first_judgment not in FIRST_JUDGMENTS or d.id in out:
            raise ValueError(f"reviewed_defects.toml: {d.id}: unknown clause {unknown} or judgment, or a duplicate")
        if (d.first_judgment == "caught") != bool(d.caught_by):
            raise ValueError(f"reviewed_defects.toml: {d.id}: caught exactly when caught_by names clauses")
        if d.first_judgment == "escaped" and sum(map(bool, (d.caught_since, d.still_open, d.equivalent))) != 1:
            raise ValueError(
                f"reviewed_defects.toml: {d.id} escaped: name what catches it since, what is still open, or why "
                "it is equivalent (one of them)"
            )
        if d.first_judgment == "out of clause" and not d.out_of_clause:
            raise ValueError(f"reviewed_defects.toml: {d.id} is out of clause without a reason")
        out[d.id] = d
    return out


def reviewed_of(clause: str) -> list[ReviewedDefect]:
    """The reviewers' defects aimed at a clause."""
    return [d for d in reviewed_defects().values() if d.clause == clause]


def own_catches(clause: str) -> int:
    """The clause's reviewers' defects that count by the rule (ReviewedDefect.counts)."""
    return sum(d.counts for d in reviewed_of(clause))


def reviewed_summary(clause: str) -> str:
    """How a clause's reviewers' defects stand, counted by the rule first: caught by its own clause at
    first judgment; then beside it what does not count, each with its name: caught only by another
    clause, escapes caught since, equivalent, still open, out of the clause (empty parts left out)."""
    ds = reviewed_of(clause)
    beside = {
        "caught only by another clause": sum(d.first_judgment == "caught" and not d.counts for d in ds),
        "escaped, caught since": sum(bool(d.caught_since) for d in ds),
        "escaped, equivalent": sum(bool(d.equivalent) for d in ds),
        "escaped, still open": sum(bool(d.still_open) for d in ds),
        "out of clause": sum(d.first_judgment == "out of clause" for d in ds),
    }
    rest = ", ".join(f"{n} {k}" for k, n in beside.items() if n)
    return f"{sum(d.counts for d in ds)} of {len(ds)} counted (own clause, first judgment)" + (
        f"; {rest}" if rest else ""
    )


def defects_of(clause: str, backend: str | None = None, *, shapes: Collection[str] | None = None) -> list[str]:
    """The seeded defects of a clause (those that can show on `backend`, and that run at one of
    the shape profiles `shapes`, when given)."""
    return [
        d.id
        for d in defects().values()
        if d.clause == clause
        and (backend is None or d.applies_to(backend))
        and (shapes is None or not set(d.shapes or (DEFAULT_SHAPE,)).isdisjoint(shapes))
    ]


def check_switches(compiled: list[str]) -> None:
    """The descriptions must match the switches compiled into the build, one to one."""
    described = set(defects())
    if set(compiled) != described:
        raise ValueError(
            "mutants.toml and the switches this build was compiled with disagree (rebuild it): "
            f"undescribed {sorted(set(compiled) - described)}, without a switch {sorted(described - set(compiled))}"
        )


def prefixes(text: str | None) -> list[str] | None:
    """A --clauses selection as select() takes it: the comma-separated entries, stripped (None: all)."""
    return [p.strip() for p in text.split(",") if p.strip()] if text else None


#: the inherited seeded defects that are on, comma-separated, for a certification started under
#: them (a check certifying the canaries with the runner under test)
INHERITED_ENV = "RETRO_CONFORMANCE_INHERITED_DEFECTS"


def inherited_env() -> dict[str, str]:
    """The environment that passes this process's inherited seeded defects to a run it starts."""
    on = [d for d, info in defects().items() if info.inherited and seeded(d)]
    return {INHERITED_ENV: ",".join(on)} if on else {}


def seeded(defect: str) -> bool:
    """The harness's way to the one door to a seeded-defect switch (retro._checks.seeded), or, for
    an inherited defect, to the switch of the run that started this one. A switch can be on only
    in a process that loaded the binding, so a process that merely merges or compares results
    packages never loads it here."""
    if defect in os.environ.get(INHERITED_ENV, "").split(",") and defects()[defect].inherited:
        return True
    if "retro._native" not in sys.modules:
        return False
    from retro._checks import seeded as switched_on

    return switched_on(defect)


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


def undriven(driven: dict[str, set[str]]) -> dict[str, list[str]]:
    """The paths each clause names that no check citing it drives, given what the checks drive
    per clause (the plugin's --paths-report): empty when every named path is driven."""
    out = {}
    for cid, c in clauses().items():
        missing = [p for p in c.paths if p not in driven.get(cid, set())]
        if missing:
            out[cid] = missing
    return out
