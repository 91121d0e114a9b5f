"""pytest plugin of the conformance suite. retro-conformance loads it (``-p
retro.conformance.plugin``); it is not registered into every pytest session of the environment.

- ``@pytest.mark.clause("CANCEL-03", ...)`` names the clauses a check proves; an unknown ID, or a
  check without the ``backend`` fixture, is a collection error.
- Every check runs once per selected backend (``--backend cpu,cuda`` or ``all``); on an absent
  backend it is reported "not available", never passed.
- Every check also runs once per seeded defect of each clause it cites, with that defect switched
  on. The run is "caught" when an assertion bound to that defect's clause failed (evidence.py),
  else "survived"; results.py passes a clause only when each of its defects was caught by one of
  its checks, and a check that caught nothing proves nothing (HARNESS-07).
- A check that takes the ``shape`` fixture runs once per profile of shapes.py that it names with
  ``@pytest.mark.shapes(...)`` (the default one when it names none) and ``--shape`` selected; its
  intact run that passed records the path ``shape=<name>``.
- ``--results-log FILE`` appends one JSON line when a case starts and one with its outcome, flushed
  at once, so that a runner can tell which case a crashed interpreter was running (HARNESS-05).

Outside clause-marked checks the plugin does nothing.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from . import backends as backends_mod
from . import evidence, outcomes, registry, results, shapes


@dataclass(frozen=True)
class Variant:
    backend: str
    defect: str | None  # the seeded defect switched on (mutants.toml id), None for the intact build

    @property
    def id(self) -> str:
        return self.backend if self.defect is None else f"{self.backend}-defect-{self.defect}"


class CaseMeta:
    def __init__(self, case: str, clauses: list[str], variant: Variant) -> None:
        self.case, self.clauses, self.variant = case, clauses, variant
        # of an intact run that returned: the clauses it asserted through and the paths it recorded
        self.asserted: list[str] = []
        self.ran: list[str] = []
        self.outcome: str | None = None
        self.ended_as: outcomes.Outcome | None = None  # how a check ended that neither passed nor failed
        self.message = ""
        self.duration = 0.0
        self.caught: dict[str, str] | None = None  # {clause, assertion} of a caught defect
        self.bounds: list[dict] = []  # errors held to a bound (evidence.within, against_oracle)
        self.measurements: list[dict] = []  # figures recorded beside the assertions (evidence.measure)


_META = pytest.StashKey[CaseMeta]()
_SELECTED = pytest.StashKey[list]()
_SHAPES = pytest.StashKey[list]()
_DISCOVERED = pytest.StashKey[dict]()


def not_supported(reason: str) -> None:
    """End a check as "not supported" on this backend (kept apart from pass and fail)."""
    raise outcomes.NotSupported(reason)


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("retro-conformance")
    g.addoption(
        "--backend",
        default=None,
        help=f"backends to certify: {', '.join(backends_mod.KNOWN)} or all, comma-separated (default cpu)",
    )
    g.addoption(
        "--shape",
        default=None,
        help=f"shape profiles to run the checks at: {', '.join(shapes.SHAPES)} or all, comma-separated "
        f"(default {shapes.DEFAULT}); a check runs at those of them it names (conformance/shapes.py)",
    )
    g.addoption("--results-log", default=None, help="append one JSON line per case start and outcome to this file")
    g.addoption("--no-defects", action="store_true", help="skip the seeded-defect runs (the clauses stay unproven)")
    g.addoption("--retro-seed", type=int, default=0, help="seed of the generated test models and data")
    g.addoption(
        "--clauses", default=None, help="run only checks citing a clause with one of these comma-separated prefixes"
    )
    g.addoption("--only-cases", default=None, help="run only the node ids listed in this file (one per line)")
    g.addoption(
        "--paths-report",
        default=None,
        help="write the paths the collected checks drive, per clause, to this JSON file (registry.undriven)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "clause(*ids): the contract clauses of shared/CONTRACTS.md that a conformance check proves"
    )
    config.addinivalue_line(
        "markers", f"shapes(*names): the shape profiles a check runs at (default {shapes.DEFAULT}; shapes.py)"
    )
    config.addinivalue_line(
        "markers",
        "drives(*paths): paths (name=value) a check drives inside each of its cases rather than as a parameter",
    )
    from retro._native import hooks

    if hooks.seeded_defects:  # a release build has none to hold against mutants.toml (--no-defects only)
        registry.check_switches(list(hooks.defects()))
    try:
        config.stash[_SELECTED] = backends_mod.parse_selection(config.getoption("--backend"))
    except ValueError as err:
        raise pytest.UsageError(str(err)) from None
    try:
        config.stash[_SHAPES] = shapes.parse(config.getoption("--shape"))
    except ValueError as err:
        raise pytest.UsageError(str(err)) from None
    config.pluginmanager.register(Recorder(config.getoption("--results-log")), "retro-conformance-recorder")


def discovered(config: pytest.Config) -> dict[str, backends_mod.Backend]:
    if _DISCOVERED not in config.stash:
        config.stash[_DISCOVERED] = backends_mod.discover()
    return config.stash[_DISCOVERED]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marker = metafunc.definition.get_closest_marker("clause")
    if marker is None:
        return
    where = metafunc.definition.nodeid
    if not marker.args:
        raise pytest.UsageError(f"{where}: @pytest.mark.clause needs at least one clause ID")
    unknown = registry.unknown_ids(marker.args)
    if unknown:
        raise pytest.UsageError(f"{where}: cites unknown clause ID(s) {unknown}; see conformance/clauses/")
    if "backend" not in metafunc.fixturenames:
        raise pytest.UsageError(f"{where}: a conformance check must take the `backend` fixture")
    no_defects = metafunc.config.getoption("--no-defects")
    variants = [
        Variant(b, d)
        for b in metafunc.config.stash[_SELECTED]
        for d in [None, *([] if no_defects else [d for c in marker.args for d in registry.defects_of(c, b)])]
    ]
    metafunc.parametrize("backend", variants, indirect=True, ids=[v.id for v in variants])
    if "shape" in metafunc.fixturenames:
        # every selected profile here; pytest_collection_modifyitems keeps those each case names
        # (a check's @pytest.mark.shapes, or one of its parameters' marks)
        at = metafunc.config.stash[_SHAPES]
        metafunc.parametrize("shape", at, ids=[f"{shapes.PATH_PREFIX}{s.name}" for s in at])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    prefixes = registry.prefixes(config.getoption("--clauses")) or []
    if prefixes:
        wanted = set(registry.select(prefixes))
        keep = [i for i in items if (m := i.get_closest_marker("clause")) is None or wanted & set(m.args)]
        dropped = [i for i in items if i not in keep]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = keep
    # a case runs at the profiles its check names, the default one when it names none
    for item in items:
        unknown = [n for n in _shapes_of(item) if n not in shapes.SHAPES]
        if unknown:
            raise pytest.UsageError(
                f"{item.nodeid}: names unknown shape profile(s) {unknown}; see conformance/shapes.py"
            )
    unshaped = [i for i in items if "shape" in _params(i) and _params(i)["shape"].name not in _shapes_of(i)]
    # a seeded-defect run at the profiles its defect names (the default one when it names none)
    # (a check that takes no profile is one whose sizes do not matter: the default one's runs)
    unshaped += [
        i
        for i in items
        if (defect := _params(i)["backend"].defect if "backend" in _params(i) else None)
        and (_params(i)["shape"].name if "shape" in _params(i) else shapes.DEFAULT)
        not in (registry.defects()[defect].shapes or (shapes.DEFAULT,))
        and i not in unshaped
    ]
    if unshaped:
        config.hook.pytest_deselected(items=unshaped)
        items[:] = [i for i in items if i not in unshaped]
    listed = config.getoption("--only-cases")
    if listed:
        wanted_ids = set(Path(listed).read_text(encoding="utf-8").splitlines())
        dropped = [i for i in items if i.nodeid not in wanted_ids]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = [i for i in items if i.nodeid in wanted_ids]
    if any(i.get_closest_marker("clause") for i in items):
        discovered(config)  # load the binding now, not inside the first case's time budget
    for item in items:
        marker = item.get_closest_marker("clause")
        callspec = getattr(item, "callspec", None)
        if marker is None or callspec is None or "backend" not in callspec.params:
            continue
        variant: Variant = callspec.params["backend"]
        # the case: module and function, plus every parameter but the backend variant
        case = f"{Path(str(item.fspath)).name}::{getattr(item, 'originalname', item.name)}"
        params = [f"{k}={v}" for k, v in callspec.params.items() if k != "backend"]
        if params:
            case += f"[{','.join(params)}]"
        item.stash[_META] = CaseMeta(case, list(marker.args), variant)
    report = config.getoption("--paths-report")
    if report:
        Path(report).write_text(json.dumps(_driven_paths(items), indent=1, sort_keys=True), encoding="utf-8")


def _shapes_of(item: pytest.Item) -> tuple[str, ...]:
    """The profiles a case runs at: its parameter's shapes mark, else its check's, else the default."""
    callspec = getattr(item, "callspec", None)
    own = [m for m in (callspec.marks if callspec is not None else ()) if m.name == "shapes"]
    named = own[-1] if own else item.get_closest_marker("shapes")
    return named.args if named is not None else (shapes.DEFAULT,)


def _params(item: pytest.Item) -> dict:
    callspec = getattr(item, "callspec", None)
    return callspec.params if callspec is not None else {}


def _driven_paths(items: list[pytest.Item]) -> dict[str, list[str]]:
    """Per clause, the paths its checks drive: their parameters (name=value) and their drives marks."""
    driven: dict[str, set[str]] = {}
    for item in items:
        meta = item.stash.get(_META, None)
        if meta is None:
            continue
        callspec = getattr(item, "callspec", None)
        paths = {f"{k}={v}" for k, v in (callspec.params.items() if callspec else ()) if k != "backend"}
        for mark in item.iter_markers("drives"):
            paths.update(mark.args)
        for clause in meta.clauses:
            driven.setdefault(clause, set()).update(paths)
    return {c: sorted(p) for c, p in driven.items()}


@pytest.fixture
def backend(request: pytest.FixtureRequest):
    """The backend this case certifies (the models and contexts it creates must live there)."""
    variant: Variant = request.param
    b = discovered(request.config)[variant.backend]
    if not b.available:
        raise outcomes.NotAvailable(b.reason)
    from retro._native import hooks

    hooks.reset()
    if variant.defect:
        hooks.set_defect(variant.defect, True)
    try:
        yield b
    finally:
        if variant.defect:
            hooks.set_defect(variant.defect, False)
        hooks.reset()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """An outcome that is neither pass nor fail is read by its type (outcomes.py), in any phase."""
    report = yield
    meta = item.stash.get(_META, None)
    if meta is not None and call.excinfo is not None and isinstance(call.excinfo.value, outcomes.Outcome):
        meta.ended_as = call.excinfo.value
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    meta = item.stash.get(_META, None)
    if meta is None:
        return (yield)
    defect = registry.defects()[meta.variant.defect] if meta.variant.defect else None
    ledger = evidence.begin(defect.clause if defect else None, meta.variant.backend)
    try:
        if defect is None:
            result = yield
            silent = [c for c in meta.clauses if c not in ledger.asserted]
            if silent:
                raise pytest.fail.Exception(f"cites {', '.join(silent)} but never asserted through it", pytrace=False)
            # what ran here is what the case recorded with on_path after the assertions that prove
            # it: a parameter's value alone is not a path run (a check that returned early, or ended
            # "not supported", ran none; results.clause_status requires each, per backend)
            shape = item.callspec.params.get("shape") if isinstance(item, pytest.Function) else None
            if shape is not None:  # the whole case ran at its profile
                ledger.paths.add(f"{shapes.PATH_PREFIX}{shape}")
            meta.asserted, meta.ran = sorted(ledger.asserted), sorted(ledger.paths)
            return result
        try:
            yield
        except evidence.ClauseViolation as err:
            if err.clause != defect.clause:
                raise
            meta.outcome, meta.caught = "caught", {"clause": err.clause, "assertion": err.message[:500]}
            meta.message = f"seeded defect {defect.id} caught by {err.clause}: {err.message[:300]}"
            return None
        except Exception as err:  # noqa: BLE001 - an error is not an assertion bound to the clause
            if registry.seeded("HARNESS-07.error"):
                meta.outcome = "caught"  # seeded defect: an error taken for a catch
                return None
            meta.outcome = "survived"
            meta.message = (
                f"seeded defect {defect.id}: raised {type(err).__name__}: {str(err)[:300]} "
                f"before any assertion bound to {defect.clause} failed"
            )
            return None
        meta.outcome = "survived"
        if registry.seeded("HARNESS-07.tolerated") and ledger.tolerated:
            meta.outcome = "caught"  # seeded defect: another clause's failed assertion taken for a catch
        others = "; ".join(str(v) for v in ledger.tolerated[:3])
        meta.message = f"seeded defect {defect.id} survived every assertion bound to {defect.clause}" + (
            f" (other clauses' assertions failed: {others})" if others else ""
        )
        return None
    finally:
        meta.bounds = list(ledger.bounds.values())
        meta.measurements = ledger.measurements
        evidence.end()


class Recorder:
    """Turns pytest reports into one result code per case and appends them to the results log."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.active: dict[str, CaseMeta] = {}

    def log(self, record: dict) -> None:
        if not self.path:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()  # in the kernel's hands: the record outlives an interpreter that dies next

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> None:
        meta = item.stash.get(_META, None)
        if meta is not None:
            self.active[item.nodeid] = meta
            self.log(
                {
                    "event": "start",
                    "nodeid": item.nodeid,
                    "id": meta.case,
                    "clauses": meta.clauses,
                    "backend": meta.variant.backend,
                    "defect": meta.variant.defect,
                    "t": time.time(),
                }
            )

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        meta = self.active.get(report.nodeid)
        if meta is None:
            return
        meta.duration += report.duration
        if report.failed:
            meta.outcome = "fail"
            meta.message = (meta.message + "\n" if meta.message else "") + _failure_text(report)
        elif report.skipped and meta.outcome != "fail":
            if meta.ended_as is not None:
                meta.outcome, meta.message = meta.ended_as.code, meta.ended_as.reason
            else:
                # a plain skip is no result: it must never read as a pass
                reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
                meta.outcome, meta.message = "fail", f"skipped without a result code: {reason}"
        elif report.when == "call" and report.passed and meta.outcome is None:
            meta.outcome = "pass"

    def pytest_runtest_logfinish(self, nodeid: str, location: tuple) -> None:
        meta = self.active.pop(nodeid, None)
        if meta is None:
            return
        self.log(
            results.case_record(
                nodeid=nodeid,
                id=meta.case,
                clauses=meta.clauses,
                backend=meta.variant.backend,
                defect=meta.variant.defect,
                outcome=meta.outcome or "fail",
                duration_s=meta.duration,
                message=meta.message,
                caught=meta.caught,
                bounds=meta.bounds,
                measurements=meta.measurements,
                asserted=meta.asserted,
                paths=meta.ran,
            )
        )


def _failure_text(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return f"{report.when}: {crash.message}"
    text = str(report.longrepr).strip().splitlines() if report.longrepr else []
    return f"{report.when}: {text[-1] if text else 'failed'}"
