"""The harness itself (HARNESS-05, -06, -07): a certification of the canaries (canaries/), cases
that end with one known result code each (one kills its interpreter, one hangs), run by the same
runner as every certification, and its records and outputs held to what each canary does. The
canary run certifies the CPU whatever the backend under test: what is proven is the harness.
(HARNESS-02 and -03 are proven beside the sweeps they describe: test_failures.py, test_cancel.py.)"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from pathlib import Path

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from retro.conformance import cli, registry, results, shapes
from retro.conformance.evidence import bound, expect

CANARIES = Path(cli.__file__).parent / "canaries"
CANARY = "test_canaries.py::"
HANG_TIMEOUT_S = 6.0  # a trivial canary ends in milliseconds even on a loaded machine
#: the clauses the canaries cite, and one no check cites (its JUnit case must read failed)
SELECTED = ["HARNESS-03", "HARNESS-05", "HARNESS-06", "HARNESS-07", "BASE-01"]
BUILD = {"retro": "canary", "llama_cpp": "canary", "patch_series_sha256": "canary"}
#: what each canary variant must end as: (canary, defect) -> result code
EXPECTED = {
    ("test_kills_its_interpreter", None): "crash",
    ("test_kills_its_interpreter", "HARNESS-05"): "survived",
    ("test_hangs", None): "crash",
    ("test_hangs", "HARNESS-05"): "survived",
    ("test_runs_after_them", None): "pass",
    ("test_runs_after_them", "HARNESS-05"): "caught",
    ("test_passes", None): "pass",
    ("test_passes", "HARNESS-06"): "caught",
    ("test_fails", None): "fail",
    ("test_fails", "HARNESS-06"): "caught",
    ("test_fails_as_expected", None): "expected failure",
    ("test_fails_as_expected", "HARNESS-06"): "caught",
    ("test_is_not_supported", None): "not supported",
    ("test_is_not_supported", "HARNESS-06"): "not supported",
    ("test_is_blind_to_its_defect", None): "pass",
    ("test_is_blind_to_its_defect", "HARNESS-07"): "survived",
    ("test_errs_under_its_defect", None): "pass",
    ("test_errs_under_its_defect", "HARNESS-07"): "survived",
    ("test_catches_its_defect", None): "pass",
    ("test_catches_its_defect", "HARNESS-03"): "caught",
    ("test_catches_only_another_clauses_defect", None): "pass",
    ("test_catches_only_another_clauses_defect", "HARNESS-03"): "survived",
    ("test_catches_only_another_clauses_defect", "HARNESS-06"): "caught",
}
# the runner's own seeded defects of HARNESS-07 run on its canaries too, where nothing trips them
EXPECTED.update(
    {
        (canary, d): "survived"
        for d in registry.defects_of("HARNESS-07")
        if d != "HARNESS-07"
        for canary in ("test_is_blind_to_its_defect", "test_errs_under_its_defect")
    }
)
#: how a JUnit dashboard must show each result code of an intact run: written here, not read from
#: results.py. A seeded-defect run (caught or survived) is never a failure or an error there: the
#: clause's own test case says whether its defect escaped, so a certified run reads all green.
JUNIT = {
    "pass": None,
    "fail": "failure",
    "crash": "error",
    "not supported": "skipped",
    "expected failure": "skipped",
}
DEFECT_CODES = ("caught", "survived")

#: the canary runs of this interpreter, by the inherited seeded defects they ran under, shared by
#: the checks that only read them
_records: dict[tuple, list[dict]] = {}


def canary_run(workdir: Path) -> list[dict]:
    """Certify the canaries on the CPU with the runner every certification uses."""
    args = argparse.Namespace(
        cases=CANARIES,
        clauses=None,
        no_defects=False,
        exitfirst=False,
        keyword=None,
        seed=0,
        shape=shapes.DEFAULT,  # the canaries take no shape profile
        case_timeout=HANG_TIMEOUT_S,
        progress=False,
        verbose=False,
    )
    workdir.mkdir(parents=True, exist_ok=True)
    # a seeded defect of the runner this check runs under is the runner's in that run too
    return cli.run_backend("cpu", args, workdir, registry.inherited_env())


def shared_run(tmp_path: Path) -> list[dict]:
    inherited = tuple(registry.inherited_env().items())
    if inherited not in _records:
        _records[inherited] = canary_run(tmp_path / "canaries")
    return [dict(r) for r in _records[inherited]]


def package(records: list[dict], start: str = "canary") -> dict:
    backends = {"cpu": {"status": "available", "reason": ""}}
    expectations = {"cpu": results.load_expectations("cpu", CANARIES / "expectations")}
    return results.aggregate({"start_time": start, **BUILD}, backends, records, SELECTED, expectations)


def outcomes(records: list[dict]) -> dict[tuple[str, str | None], str]:
    return {
        (r["id"].removeprefix(CANARY), r["defect"]): r["outcome"]
        for r in results.apply_expectations(
            records, {"cpu": results.load_expectations("cpu", CANARIES / "expectations")}
        )
    }


@pytest.mark.clause("HARNESS-05")
def test_a_crash_and_a_hang_are_recorded_and_the_run_goes_on(backend, tmp_path):
    """One canary kills its interpreter (abort), one hangs past the case timeout: each reads
    crash, with what happened, and every canary after them ran, each once."""
    records = canary_run(tmp_path)
    got = outcomes(records)
    expect(
        "HARNESS-05",
        sorted(got, key=str) == sorted(EXPECTED, key=str) and len(records) == len(EXPECTED),
        f"the run recorded {sorted(got, key=str)} ({len(records)} records), expected each of {len(EXPECTED)} canary runs once",
    )
    by_case = {(r["id"].removeprefix(CANARY), r["defect"]): r for r in records}
    killed, hung = by_case.get(("test_kills_its_interpreter", None)), by_case.get(("test_hangs", None))
    expect(
        "HARNESS-05",
        killed is not None and killed["outcome"] == "crash" and "interpreter died" in killed["message"],
        f"the canary that aborts its interpreter reads {killed}",
    )
    expect(
        "HARNESS-05",
        hung is not None and hung["outcome"] == "crash" and f"ran over {HANG_TIMEOUT_S:g} s" in hung["message"],
        f"the canary that hangs reads {hung}",
    )
    after = by_case.get(("test_runs_after_them", None))
    expect("HARNESS-05", after is not None and after["outcome"] == "pass", f"the canary after them reads {after}")


@pytest.mark.clause("HARNESS-06")
def test_the_outputs_carry_every_result_code_and_shards_merge_into_one_run(backend, tmp_path):
    """The canary run's results.json validates against the published schema and its digest; every
    result code is in it; junit.xml carries each case run with the element its code calls for (a
    seeded-defect run is never a failure) and each clause as a case of its own (an escaped defect a
    failure that names it, a clause no check cites skipped), each suite's counts agreeing with its
    elements; report.md gives the verdict and each failure and crash; the run cut into two shards
    merges into the package of the whole run, and two shards that ran the same cases keep every
    record."""
    records = shared_run(tmp_path)
    whole = package(records)
    out = tmp_path / "out"
    results.write_all(whole, out)
    written = json.loads((out / "results.json").read_text(encoding="utf-8"))
    schema = json.loads((Path(results.__file__).parent / "results.schema.json").read_text(encoding="utf-8"))
    with bound("HARNESS-06"):
        jsonschema.validate(written, schema)
        results.verify(written)
    codes = {c["outcome"] for c in written["cases"]}
    want_codes = {*JUNIT, *DEFECT_CODES}
    expect("HARNESS-06", want_codes <= codes, f"result codes {sorted(codes)} lack {sorted(want_codes - codes)}")

    root = ET.parse(out / "junit.xml").getroot()
    suites = {s.get("name", ""): s for s in root.findall("testsuite")}
    expect("HARNESS-06", {"cpu", "cpu.clauses"} <= set(suites), f"junit.xml suites {sorted(suites)}")

    def element(tc: ET.Element) -> str | None:
        kinds = [e.tag for e in tc if e.tag in ("failure", "error", "skipped")]
        return kinds[0] if kinds else None

    runs = {tc.get("name"): element(tc) for tc in suites.get("cpu", ET.Element("x")).findall("testcase")}
    for c in written["cases"]:
        label = c["id"] + (f"[defect-{c['defect']}]" if c["defect"] else "")
        want = None if c["defect"] else JUNIT[c["outcome"]]
        expect(
            "HARNESS-06",
            label in runs and runs[label] == want,
            f"junit.xml shows {label} ({c['outcome']}) as {runs.get(label, 'missing')}, expected {want}",
        )
    # a dashboard reads a suite's counts, not its elements: they must agree, suite by suite
    for suite_name, suite in suites.items():
        kinds = [element(tc) for tc in suite.findall("testcase")]
        counted = {k: suite.get(k) for k in ("tests", "failures", "errors", "skipped")}
        held = {
            "tests": str(len(kinds)),
            "failures": str(kinds.count("failure")),
            "errors": str(kinds.count("error")),
            "skipped": str(kinds.count("skipped")),
        }
        expect("HARNESS-06", counted == held, f"junit.xml suite {suite_name} counts {counted}, holds {held}")
    clauses = {tc.get("name"): tc for tc in suites.get("cpu.clauses", ET.Element("x")).findall("testcase")}
    expect(
        "HARNESS-06", set(clauses) - {"verdict"} == set(registry.clauses()), "junit.xml lacks a test case per clause"
    )
    expect("HARNESS-06", element(clauses["verdict"]) == "failure", "a backend not certified has no red verdict case")
    escaped = clauses.get("HARNESS-07")
    expect(
        "HARNESS-06",
        escaped is not None and element(escaped) == "failure" and "HARNESS-07" in escaped[0].get("message", ""),
        "a clause whose defect escaped is not a failure naming the defect in junit.xml",
    )
    expect("HARNESS-06", element(clauses["HARNESS-05"]) == "error", "a crashed clause is not an error in junit.xml")
    # red wherever the clause keeps its backend from being certified; skipped only outside the run
    expect("HARNESS-06", element(clauses["BASE-01"]) == "failure", "a selected clause no check cites is not a failure")
    expect("HARNESS-06", element(clauses["TOPO-01"]) == "skipped", "a clause outside the selection is not skipped")
    props = {p.get("name"): p.get("value") or "" for p in suites["cpu.clauses"].findall("properties/property")}
    expect(
        "HARNESS-06",
        props.get("verdict") == "not certified" and "not a certification" in props.get("clauses", ""),
        f"junit.xml's cpu.clauses suite does not say the selection is not a certification: {props}",
    )

    report = (out / "report.md").read_text(encoding="utf-8")
    expect("HARNESS-06", "| cpu | available | **not certified** |" in report, "report.md lacks the verdict")
    for c in written["cases"]:
        if c["defect"] is None and c["outcome"] in ("fail", "crash"):
            heading = f"### cpu: {c['id']} ({c['outcome']})"
            expect("HARNESS-06", heading in report, f"report.md lacks {heading}")

    first = {CANARY + n for n in ("test_kills_its_interpreter", "test_hangs", "test_runs_after_them")}
    shards = [
        package([r for r in records if r["id"] in first], "1"),
        package([r for r in records if r["id"] not in first], "2"),
    ]
    merged = results.merge(shards)
    for key in ("selected", "clauses", "clause_details", "cases", "verdict"):
        expect("HARNESS-06", merged[key] == whole[key], f"two merged shards differ from the whole run in {key}")
    # the same cases run on two machines: the merge keeps every record of both
    again = package([r for r in records if r["id"] in first], "3")
    twice = results.merge([shards[0], again])
    expect(
        "HARNESS-06",
        len(twice["cases"]) == len(shards[0]["cases"]) + len(again["cases"]),
        f"a merge of two shards that ran the same cases kept {len(twice['cases'])} of "
        f"{len(shards[0]['cases']) + len(again['cases'])} records",
    )


@pytest.mark.clause("HARNESS-07")
def test_ability_to_fail_is_judged_per_clause_from_the_defect_runs(backend, tmp_path):
    """A clause whose defect no check caught fails, naming the defect; a check that caught only
    another clause's defect proves nothing for this one (the clause is not passed), even where
    another of its checks caught its defect."""
    records = shared_run(tmp_path)
    whole = package(records)
    # a defect run that ends in an error, not in an assertion bound to the clause, caught nothing
    erred = [
        r
        for r in records
        if (r["id"].removeprefix(CANARY), r["defect"]) == ("test_errs_under_its_defect", "HARNESS-07")
    ]
    expect(
        "HARNESS-07",
        len(erred) == 1 and erred[0]["outcome"] == "survived" and "raised RuntimeError" in erred[0]["message"],
        f"a defect run that raised an error reads {erred}",
    )
    status, why = whole["clauses"]["HARNESS-07"]["cpu"], whole["clause_details"]["HARNESS-07"]["cpu"]
    expect(
        "HARNESS-07",
        status == "fail" and "HARNESS-07" in why and "test_is_blind_to_its_defect" in why,
        f"a clause whose defect escaped reads {status}: {why}",
    )
    status, why = whole["clauses"]["HARNESS-03"]["cpu"], whole["clause_details"]["HARNESS-03"]["cpu"]
    expect(
        "HARNESS-07",
        status != "pass" and "test_catches_only_another_clauses_defect" in why,
        f"a clause with a check unable to fail for it reads {status}: {why}",
    )


#: the able-to-fail rule's parts, by name: what a mix of a clause's defect runs must read
_CODES = ("caught", "survived", "crash", "not supported", "fail")
_CHECKS = ("test_a[p=1]", "test_a[p=2]", "test_b", "test_c[q=x]")


def _rule(checks: list[str], defects: list[str], runs: dict[tuple[str, str], str]) -> bool:
    """The reading, written here from its text and not from results.py: each seeded defect caught
    (outcome "caught": an assertion bound to the clause) in some check citing it, and each check
    citing it (each case: a parametrisation is its own check) caught one of the clause's defects."""
    every_defect = all(any(runs.get((k, d)) == "caught" for k in checks) for d in defects)
    every_check = all(any(runs.get((k, d)) == "caught" for d in defects) for k in checks)
    return every_defect and every_check


def _status(monkeypatch, clause: str, checks, defects, runs, other: dict[str, str]) -> tuple[str, str]:
    """results.clause_status over synthetic records: every intact run passed; `runs` the clause's
    defect runs by (check, defect) (absent: not run); `other` a run of another clause's defect by check."""

    def record(check: str, defect: str | None, outcome: str) -> dict:
        return {
            "id": check,
            "clauses": [clause],
            "defect": defect,
            "outcome": outcome,
            "message": "",
            "asserted": [clause],
            "paths": [],
            "backend": "cpu",
        }

    cases = [record(k, None, "pass") for k in checks]
    cases += [record(k, d, o) for (k, d), o in runs.items()]
    cases += [record(k, "OTHER-01", o) for k, o in other.items()]
    with monkeypatch.context() as m:
        m.setattr(
            registry, "defects_of", lambda c, name=None, shapes=None: list(defects) if c == clause else ["OTHER-01"]
        )
        return results.clause_status(clause, {"status": "available"}, cases, name="cpu")


#: mixes that decide the rule, each with the runs that make it so (check, defect) -> outcome, and
#: another clause's defect caught by every check: a generated sweep may draw them late or never
DECISIVE: dict[str, dict[tuple[str, str], str | None]] = {
    "one parametrisation caught, the other did not": {
        ("test_a[p=1]", "D-1"): "caught",
        ("test_a[p=2]", "D-1"): "survived",
    },
    "one defect caught, another escaped": {("test_a[p=1]", "D-1"): "caught", ("test_a[p=1]", "D-2"): "survived"},
    "a defect that only crashed": {("test_b", "D-1"): "caught", ("test_b", "D-2"): "crash"},
    "a defect that was only skipped or failed": {
        ("test_b", "D-1"): "caught",
        ("test_b", "D-2"): "not supported",
        ("test_c[q=x]", "D-2"): "fail",
        ("test_c[q=x]", "D-1"): "caught",
    },
    "a check that caught only another clause's defect": {
        ("test_b", "D-1"): "caught",
        ("test_c[q=x]", "D-1"): "survived",
    },
    "a defect that never ran": {
        ("test_b", "D-1"): "caught",
        ("test_c[q=x]", "D-1"): "caught",
        ("test_c[q=x]", "D-3"): None,
    },
    "each defect caught, each check able": {("test_b", "D-1"): "caught", ("test_c[q=x]", "D-2"): "caught"},
}


@pytest.mark.clause("HARNESS-07")
def test_the_rule_reads_the_mixes_that_decide_it_as_its_text_does(backend, monkeypatch):
    """The rule itself (results.clause_status) on the mixes of defect runs that decide it (DECISIVE),
    each beside another clause's defect caught by every check: it passes only the last."""
    for name, runs in DECISIVE.items():
        checks = sorted({k for k, _ in runs})
        defects = sorted({d for _, d in runs})
        ran = {kd: o for kd, o in runs.items() if o is not None}  # None: a defect of the clause that never ran
        status, why = _status(monkeypatch, "HARNESS-07", checks, defects, ran, dict.fromkeys(checks, "caught"))
        want = _rule(checks, defects, ran)
        expect("HARNESS-07", (status == "pass") == want, f"{name}: {status} ({why}) where the rule reads {want}")


@pytest.mark.clause("HARNESS-07")
def test_the_rule_reads_every_mix_of_defect_runs_as_its_text_does(backend, monkeypatch):
    """The rule itself (results.clause_status), held to the reading over generated mixes of a
    clause's defect runs: one to three defects, one to four cases (parametrisations of one check
    among them), each run caught, survived, crashed, not supported or failed, or not run, and runs
    of another clause's defect caught or not. The clause passes exactly when each of its defects was
    caught and each case caught one of them; a defect that ran and was never caught fails the
    clause and is named; a crash, an error or a skip under a defect is no catch."""

    @settings(max_examples=300, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def sweep(data) -> None:
        clause = "HARNESS-07"
        checks = data.draw(st.lists(st.sampled_from(_CHECKS), min_size=1, max_size=4, unique=True))
        defects = data.draw(st.lists(st.sampled_from(("D-1", "D-2", "D-3")), min_size=1, max_size=3, unique=True))
        runs = {
            (k, d): o
            for k in checks
            for d in defects
            if (o := data.draw(st.sampled_from((None, *_CODES)), label=f"{k} under {d}")) is not None
        }
        other = {k: data.draw(st.sampled_from(("caught", "survived")), label=f"{k} under another's") for k in checks}
        status, why = _status(monkeypatch, clause, checks, defects, runs, other)
        want = _rule(checks, defects, runs)
        expect(
            clause, (status == "pass") == want, f"{status} ({why}) where the rule reads {want}: {runs}, other {other}"
        )
        escaped = [
            d
            for d in defects
            if any((k, d) in runs for k in checks) and not any(runs.get((k, d)) == "caught" for k in checks)
        ]
        for d in escaped:
            expect(
                clause,
                status == "fail" and d in why,
                f"defect {d} ran uncaught ({runs}) and the clause reads {status}: {why}",
            )

    sweep()
