"""The results package of a certification run: case records, expectations, per-clause status per
backend, the verdict, merge, and writing the four files (results.json here; junit.xml, report.md
and report.html by junit.py, markdown.py and html.py). Everything is derived from the backends
and the case records, so shards from several machines merge by re-aggregating. The result codes
are outcomes.py's."""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from retro import _gate
from retro._gate import digest as digest  # the package's integrity: the trainer's gate checks it too
from retro._gate import verify as verify

from . import evidence, gate, html, junit, markdown, registry
from .outcomes import CASE_CODES, CERTIFIED, NO_CHECK, NO_CHECK_RAN, PARTLY_IMPLEMENTED, SELECTION_PASSED
from .shapes import DEFAULT as DEFAULT_SHAPE
from .shapes import PATH_PREFIX, SHAPES, check_of, shape_of

SCHEMA = _gate.SCHEMA
BUILD_KEYS = ("retro", "llama_cpp", "patch_series_sha256")  # shards merge only when these agree


def case_record(
    *,
    nodeid: str,
    id: str,
    clauses: list[str],
    backend: str,
    defect: str | None,
    outcome: str,
    duration_s: float,
    message: str,
    caught: dict[str, str] | None = None,
    bounds: list[dict] | None = None,
    measurements: list[dict] | None = None,
    asserted: list[str] | None = None,
    paths: list[str] | None = None,
) -> dict:
    """The one shape of a case record: a result line of the results log (the plugin's, and the
    runner's for a crashed interpreter and the restart budget) and an entry of results.json's cases."""
    if outcome not in CASE_CODES:
        raise ValueError(f"unknown result code {outcome!r}")
    record: dict[str, object] = {
        "event": "result",
        "nodeid": nodeid,
        "id": id,
        "clauses": list(clauses),
        "backend": backend,
        "defect": defect,
        "outcome": outcome,
        "duration_s": round(duration_s, 6),
        "message": message[:4000],
        "caught": caught,
    }
    if bounds:
        record["bounds"] = bounds
    if measurements:
        record["measurements"] = measurements
    if asserted:  # an intact run that returned: the clauses it asserted through, the paths it ran
        record["asserted"] = list(asserted)
        record["paths"] = list(paths or ())
    return record


@dataclass(frozen=True)
class Expectation:
    case: str
    result: str  # "fail" or "not supported"
    reason: str  # the backend's own bug or limit, in words
    reference: str  # where it is tracked (an upstream issue, a driver bug)
    defect: str | None = None


def load_expectations(backend: str, folder: Path | None = None) -> list[Expectation]:
    """Per-backend expectation file (web-platform-tests style): cases expected not to pass there."""
    if folder is not None:
        path = folder / f"{backend}.toml"
        text = path.read_text(encoding="utf-8") if path.is_file() else ""
    else:
        res = resources.files(__package__).joinpath("expectations", f"{backend}.toml")
        text = res.read_text(encoding="utf-8") if res.is_file() else ""
    out = []
    for raw in tomllib.loads(text).get("expected", []):
        try:
            e = Expectation(**raw)
        except TypeError as err:
            raise ValueError(f"expectations/{backend}.toml: {raw.get('case')}: {err}") from None
        if e.result not in ("fail", "not supported"):
            raise ValueError(f"expectations/{backend}.toml: {e.case}: result must be 'fail' or 'not supported'")
        if not e.reason.strip() or not e.reference.strip():
            raise ValueError(f"expectations/{backend}.toml: {e.case}: an expectation needs a reason and a reference")
        out.append(e)
    return out


def stale_expectations(backend: str, expectations: list[Expectation], cases: list[dict]) -> list[Expectation]:
    """Expectations naming a case (and defect) that a full run on `backend` did not run: the check
    was renamed or removed, and the entry would hide nothing but itself."""
    ran = {(c["id"], c.get("defect")) for c in cases if c["backend"] == backend}
    return [e for e in expectations if (e.case, e.defect) not in ran]


def apply_expectations(cases: list[dict], expectations: dict[str, list[Expectation]]) -> list[dict]:
    out = []
    for c in cases:
        c = {k: v for k, v in c.items() if k != "event"}
        for e in expectations.get(c["backend"], []):
            if e.case == c["id"] and e.defect == c.get("defect"):
                if c["outcome"] == "fail" and e.result == "fail":
                    c["outcome"], c["message"] = "expected failure", f"{e.reason} | {c['message']}"
                elif c["outcome"] == "pass":
                    c["outcome"] = "fail"
                    c["message"] = f"unexpected pass: expectations/{c['backend']}.toml says {e.result} ({e.reason})"
        out.append(c)
    return out


def clause_status(clause: str, backend: dict, cases: list[dict], *, name: str | None = None) -> tuple[str, str]:
    """(status, why) of one clause on backend `name`. It passes when every intact run of a check
    citing it passed, each of its seeded defects was caught by an assertion bound to it in one of
    those checks (those of its seeded defects that run at a shape profile this backend's cases ran
    at), and each of those checks caught a defect of this clause (HARNESS-07: able to fail
    is judged per clause, not per check), and every path it names on this backend ran there in a
    passing check that asserted through it. A defect that ran and that no check caught fails the
    clause, named."""
    if backend["status"] != "available":
        return "not available", backend.get("reason", "")
    citing = [c for c in cases if clause in c["clauses"]]
    intact = [c for c in citing if c["defect"] is None]
    if not intact:
        return "not covered", NO_CHECK
    for code in ("crash", "fail"):
        bad = [c for c in intact if c["outcome"] == code]
        if bad:
            return code, "; ".join(sorted({c["id"] for c in bad}))
    if any(c["outcome"] == "expected failure" for c in intact):
        return "expected failure", "listed in the backend's expectation file"
    passed = [c for c in intact if c["outcome"] == "pass"]
    if not passed:
        if all(c["outcome"] == "not supported" for c in intact):
            return "not supported", intact[0]["message"]
        return "not covered", NO_CHECK_RAN
    # those that can show on this backend, at a profile its cases ran at
    ran_at = profiles_run(cases)
    defects = registry.defects_of(clause, name, shapes=ran_at)
    if not defects:
        return "not covered", "no seeded defect shows its checks able to fail"
    runs = {d: [c for c in citing if c["defect"] == d] for d in defects}
    caught = {
        d: next(c for c in rs if c["outcome"] == "caught")
        for d, rs in runs.items()
        if any(c["outcome"] == "caught" for c in rs)
    }
    escaped = [d for d in defects if runs[d] and d not in caught]
    if escaped:
        return "fail", "seeded defect(s) escaped every check citing the clause: " + "; ".join(
            f"{d} ({', '.join(sorted({c['outcome'] for c in runs[d]}))} in {', '.join(sorted({c['id'] for c in runs[d]}))})"
            for d in escaped
        )
    unrun = [d for d in defects if not runs[d]]
    if unrun:
        return "not covered", "seeded defect(s) not run: " + ", ".join(unrun)
    # per check, whatever shape profile each of its cases ran at (shapes.check_of)
    if registry.seeded("HARNESS-07"):  # seeded defect: a check that caught any clause's defect counts as able
        able = {check_of(c["id"]) for c in cases if c["defect"] is not None and c["outcome"] == "caught"}
    else:
        able = {check_of(c["id"]) for c in citing if c["defect"] in defects and c["outcome"] == "caught"}
    unable = sorted({check_of(c["id"]) for c in passed} - able)
    if unable:
        return "not covered", f"check(s) that caught no seeded defect of {clause}: " + ", ".join(unable)
    # every path the clause names on this backend ran there, in a passing check that asserted
    # through the clause: a check that returned early or read "not supported" ran none (a profile
    # the run did not select is its selection's, as a clause it did not select: see aggregate)
    ran = {p for c in passed if clause in c.get("asserted", ()) for p in c.get("paths", ())}
    unrun = [
        p
        for p in registry.clauses()[clause].paths_on(name)
        if p not in ran and not (p.startswith(PATH_PREFIX) and p.removeprefix(PATH_PREFIX) not in ran_at)
    ]
    if unrun:
        where = f" on {name}" if name else ""
        return "not covered", f"path(s) the clause names that no passing check ran{where}: " + ", ".join(unrun)
    how = "; ".join(f"{d} by {c['id']}" for d, c in caught.items())
    missing = registry.clauses()[clause].unimplemented
    if missing:
        return "not covered", f"{PARTLY_IMPLEMENTED} ({how}); not implemented: {missing}"
    return "pass", f"{len(passed)} check run(s) passed; defects caught: {how}"


def profiles_run(cases: list[dict]) -> set[str]:
    """The shape profiles one backend's cases ran at (a package whose case ids name none: the
    default one)."""
    return {s for c in cases if (s := shape_of(c["id"]))} or {DEFAULT_SHAPE}


def aggregate(
    run: dict,
    backends: dict[str, dict],
    cases: list[dict],
    selected: list[str],
    expectations: dict[str, list[Expectation]] | None = None,
    shards: list[dict] | None = None,
) -> dict:
    """Every clause of the registry gets a status per backend; the verdict counts the selected ones
    (the others read "not selected")."""
    # one order whatever the order the cases ran in (-j): the statuses and the digest follow it
    cases = sorted(apply_expectations(cases, expectations or {}), key=case_key)
    chosen = set(selected)
    clauses: dict[str, dict[str, str]] = {}
    why: dict[str, dict[str, str]] = {}
    for cid in registry.clauses():
        clauses[cid], why[cid] = {}, {}
        for name, b in backends.items():
            if cid in chosen:
                status, reason = clause_status(cid, b, [c for c in cases if c["backend"] == name], name=name)
            else:
                status, reason = "not selected", "outside this run's clause selection"
            clauses[cid][name], why[cid][name] = status, reason
    verdict = {}
    partial = run.get("partial")
    for name, b in backends.items():
        if b["status"] != "available":
            verdict[name] = "not available"
        else:
            ok = all(clauses[cid][name] == "pass" for cid in chosen)
            # a run that left out checks of its selected clauses (-k) never certifies them, and a
            # selection of clauses, or of the shape profiles, is never a certification, however it went
            if not ok or not chosen or partial:
                verdict[name] = "not certified"
            else:
                every_profile = profiles_run([c for c in cases if c["backend"] == name]) >= set(SHAPES)
                verdict[name] = CERTIFIED if chosen == set(clauses) and every_profile else SELECTION_PASSED
    out = {
        "schema": SCHEMA,
        "run": run,
        "shards": shards or [run],
        "selected": [c for c in registry.clauses() if c in chosen],
        "backends": backends,
        "clauses": clauses,
        "clause_details": why,
        "cases": cases,
        "verdict": verdict,
    }
    out["bounds"] = bound_table(cases)
    out["gates"] = {gate.NAME: gate.decide(out)}
    out["digest"] = digest(out)
    return out


def bound_table(cases: list[dict]) -> list[dict]:
    """Every bound the checks held an error to (evidence.within), by name: the limit applied on each
    backend and why it is that wide (each limit its own reason), the largest error an intact run
    measured there, and each seeded defect that crossed it with the largest error its run measured.
    `unexplained`: the backends where the limit is more than evidence.WIDE times the intact error
    and gives no reason there (another backend's reason does not count)."""
    table: dict[str, dict] = {}
    for c in cases:
        for b in c.get("bounds", ()):
            row = table.setdefault(
                b["bound"], {"bound": b["bound"], "reason": {}, "limit": {}, "intact": {}, "defects": {}}
            )
            name = c["backend"]
            row["limit"][name] = b["limit"]
            if b.get("reason"):
                row["reason"][name] = b["reason"]
            if c["defect"] is None:
                row["intact"][name] = max(row["intact"].get(name, 0.0), b["error"])
            elif b["error"] > b["limit"]:
                row["defects"][c["defect"]] = max(row["defects"].get(c["defect"], 0.0), b["error"])
    for row in table.values():
        row["unexplained"] = sorted(
            n for n, err in row["intact"].items() if row["limit"][n] > evidence.WIDE * err and not row["reason"].get(n)
        )
    return sorted(table.values(), key=lambda r: r["bound"])


def case_key(c: dict) -> tuple[str, str, str, str]:
    return (c["backend"], c["id"], c["defect"] or "", c.get("nodeid", ""))


def comparable(results: dict) -> dict:
    """A results package less what differs between two runs of one build on one machine by time
    and scheduling alone: when and how long (durations, the warm-ups, the checks' timing measurements and the
    gate's figures from them), the digest, the command line, the RPC servers' endpoints, and what a
    caught defect's run measured (its assertion's text and bounded errors: a timing, a thread
    interleaving, a process-wide counter). Outcomes, statuses, the verdict, the gate's decision and
    every intact run's message and bounded errors are kept (the bound table, which also reads the
    defects' runs, is left out)."""
    out = json.loads(json.dumps({k: v for k, v in results.items() if k not in ("digest", "bounds")}))
    for run in (out["run"], *out["shards"]):
        for key in ("start_time", "command", "host", "warm_up_s"):
            run.pop(key, None)
    for b in out["backends"].values():
        b.pop("device", None)
        b.pop("devices", None)
    for c in out["cases"]:
        c.pop("duration_s", None)
        c.pop("measurements", None)  # timings a check recorded (the gate's rebuild cost)
        if c["outcome"] == "caught":
            c["message"] = ""
            c["caught"] = {"clause": c["caught"]["clause"]}
            c.pop("bounds", None)
    for g in out.get("gates", {}).values():
        g["evidence"] = [e for e in g["evidence"] if " µs" not in e and "%" not in e]
    return out


def merge(parts: list[dict]) -> dict:
    """One verdict from several shards (machines): backends and cases are united, then re-aggregated.
    A backend is available if any shard had it; a case run on several shards keeps every record.
    Shards of different builds (retro version, llama.cpp pin, patch series) are refused."""
    for p in parts:
        verify(p)
    builds = {tuple(s.get(k) for k in BUILD_KEYS) for p in parts for s in p["shards"]}
    if len(builds) > 1:
        raise ValueError(
            "the shards come from different builds ("
            + "; ".join(", ".join(f"{k}={v}" for k, v in zip(BUILD_KEYS, b)) for b in sorted(builds, key=str))
            + ")"
        )
    backends: dict[str, dict] = {}
    for p in parts:
        for name, b in p["backends"].items():
            if name not in backends or (b["status"] == "available" and backends[name]["status"] != "available"):
                backends[name] = b
    selected = list(dict.fromkeys(cid for p in parts for cid in p["selected"]))
    shards = [s for p in parts for s in p["shards"]]
    run = {
        "merged": True,
        "shards": len(shards),
        "start_time": min(s.get("start_time", "") for s in shards),
        **{k: shards[0].get(k) for k in BUILD_KEYS},
    }
    partial = [s["partial"] for s in shards if s.get("partial")]
    if partial:
        run["partial"] = "; ".join(partial)
    cases = [c for p in parts for c in p["cases"]]  # expectations were applied when each shard ran
    return aggregate(run, backends, cases, selected, None, shards)


# ---- outputs -------------------------------------------------------------------------------------


def write_all(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    junit.write(results, out / "junit.xml")
    (out / "report.md").write_text(markdown.report(results), encoding="utf-8")
    (out / "report.html").write_text(html.report_html(results), encoding="utf-8")
