"""Clause status, verdict, expectations, merge and the three output files."""

from __future__ import annotations

import dataclasses
import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from retro.conformance import markdown, outcomes, registry, results

AVAILABLE = {"status": "available", "reason": "", "devices": []}
ABSENT = {"status": "not available", "reason": "not compiled into this build", "devices": []}


def case(name, clauses, outcome, backend="cpu", defect=None, message="", paths=None):
    """A case record; an intact pass asserted through each clause it cites and, unless `paths`
    says otherwise, ran every path they name."""
    record = {
        "nodeid": name,
        "id": name,
        "clauses": clauses,
        "backend": backend,
        "defect": defect,
        "outcome": outcome,
        "duration_s": 0.1,
        "message": message,
        "caught": None,
    }
    if defect is None and outcome == "pass":
        every = [p for c in clauses for p in registry.clauses()[c].paths]
        record |= {"asserted": list(clauses), "paths": every if paths is None else paths}
    return record


def proven(name, clause, backend="cpu"):
    """An intact pass of `name` and every seeded defect of `clause` caught by it."""
    return [case(name, [clause], "pass", backend)] + [
        case(name, [clause], "caught", backend, defect=d) for d in registry.defects_of(clause)
    ]


def test_a_clause_passes_only_when_each_of_its_defects_was_caught():
    ok = proven("a", "CANCEL-04")
    assert results.clause_status("CANCEL-04", AVAILABLE, ok)[0] == "pass"
    assert results.clause_status("CANCEL-04", AVAILABLE, ok[:1]) == (
        "not covered",
        "seeded defect(s) not run: " + ", ".join(registry.defects_of("CANCEL-04")),
    )
    # a defect that ran and that no check caught fails the clause, named (HARNESS-07)
    one_survived = [c for c in ok if c["defect"] != "CANCEL-04.exception"]
    one_survived.append(case("a", ["CANCEL-04"], "survived", defect="CANCEL-04.exception"))
    status, why = results.clause_status("CANCEL-04", AVAILABLE, one_survived)
    assert status == "fail" and why.endswith("CANCEL-04.exception (survived in a)")
    # another check citing the clause may catch the defect this one missed
    other = [case("b", ["CANCEL-04"], "pass"), case("b", ["CANCEL-04"], "caught", defect="CANCEL-04.exception")]
    assert results.clause_status("CANCEL-04", AVAILABLE, one_survived + other)[0] == "pass"
    assert results.clause_status("CANCEL-04", AVAILABLE, [])[0] == "not covered"
    assert results.clause_status("CANCEL-04", ABSENT, ok)[0] == "not available"
    assert results.clause_status("HOST-01", AVAILABLE, [case("h", ["HOST-01"], "pass")])[0] == "not covered"


def test_a_partly_implemented_clause_passes_where_implemented_and_never_certifies(monkeypatch):
    """A clause whose registry entry names a part the binding does not implement reads partial once
    its checks pass and its defects are caught: "not covered", saying what passed and what is not
    implemented, and its backend is not certified; short of that it reads as any other clause."""
    partial = dataclasses.replace(registry.clauses()["CANCEL-04"], unimplemented="the rest of it")
    monkeypatch.setitem(registry.clauses(), "CANCEL-04", partial)
    ok = proven("a", "CANCEL-04")
    status, why = results.clause_status("CANCEL-04", AVAILABLE, ok)
    assert status == "not covered" and why.startswith(outcomes.PARTLY_IMPLEMENTED), why
    assert why.endswith("not implemented: the rest of it")
    assert results.clause_status("CANCEL-04", AVAILABLE, ok[:1])[1].startswith("seeded defect(s) not run")
    res = results.aggregate({"start_time": "t"}, {"cpu": AVAILABLE}, ok, ["CANCEL-04"])
    assert res["verdict"] == {"cpu": "not certified"}


def test_a_clause_passes_on_a_backend_only_where_each_path_it_names_ran_there():
    """Paths are read from what each intact run recorded at run time (its parameters, and what it
    recorded with evidence.on_path), per backend: one that ran elsewhere, or in a run that did not
    assert through the clause, does not count; a path that exists only on other backends (the
    split over two RPC servers) is not asked for."""
    clause = registry.clauses()["HARNESS-01"]
    assert clause.path_backends["rpc_servers=2"] == ("rpc",)
    # "offload": every backend but the CPU, the oracle, which has no device to offload to
    assert clause.paths_on("cpu") == ()
    assert clause.paths_on("vulkan") == ("gpu_layers=0", "gpu_layers=1", "gpu_layers=-1")
    assert clause.paths_on("rpc") == clause.paths
    defects = [
        case("a", ["HARNESS-01"], "caught", b, defect=d)
        for b in ("cpu", "rpc")
        for d in registry.defects_of("HARNESS-01", b)
    ]
    placements = ["gpu_layers=0", "gpu_layers=1", "gpu_layers=-1"]
    checks = [case("a", ["HARNESS-01"], "pass", b, paths=[] if b == "cpu" else placements) for b in ("cpu", "rpc")]
    runs = [*defects, *checks]
    on = {b: [c for c in runs if c["backend"] == b] for b in ("cpu", "rpc")}
    assert results.clause_status("HARNESS-01", AVAILABLE, on["cpu"], name="cpu")[0] == "pass"
    assert results.clause_status("HARNESS-01", AVAILABLE, on["rpc"], name="rpc") == (
        "not covered",
        "path(s) the clause names that no passing check ran on rpc: rpc_servers=2",
    )
    split = case("b", ["HARNESS-01"], "pass", "rpc", paths=["rpc_servers=2"])
    split_caught = [
        case("b", ["HARNESS-01"], "caught", "rpc", defect=d) for d in registry.defects_of("HARNESS-01", "rpc")
    ]
    assert results.clause_status("HARNESS-01", AVAILABLE, [*on["rpc"], split, *split_caught], name="rpc")[0] == "pass"
    # a run that never asserted through the clause ran none of its paths for it
    silent = split | {"asserted": ["HOST-01"]}
    assert (
        results.clause_status("HARNESS-01", AVAILABLE, [*on["rpc"], silent, *split_caught], name="rpc")[0]
        == "not covered"
    )
    # a path counts on the backend that ran it only
    run = {"start_time": "2026-01-01T00:00:00+00:00", "retro": "x", "llama_cpp": "y", "patch_series_sha256": "z"}
    elsewhere = [c | {"backend": "cpu"} for c in (split, *split_caught)]
    res = results.aggregate(run, {"cpu": AVAILABLE, "rpc": AVAILABLE}, [*runs, *elsewhere], ["HARNESS-01"])
    assert res["clauses"]["HARNESS-01"] == {"cpu": "pass", "rpc": "not covered"}


def test_a_check_that_caught_nothing_leaves_its_clause_unproven():
    cs = [*proven("a", "BASE-02"), case("b", ["BASE-02"], "pass"), case("b", ["BASE-02"], "survived", defect="BASE-02")]
    assert results.clause_status("BASE-02", AVAILABLE, cs) == (
        "not covered",
        "check(s) that caught no seeded defect of BASE-02: b",
    )
    # able to fail is per clause: catching another clause's defect proves nothing for this one
    both = [case("b", ["BASE-02", "BASE-03"], "pass"), case("b", ["BASE-02", "BASE-03"], "caught", defect="BASE-03")]
    assert results.clause_status("BASE-02", AVAILABLE, [*proven("a", "BASE-02"), *both]) == (
        "not covered",
        "check(s) that caught no seeded defect of BASE-02: b",
    )


def test_crash_and_fail_dominate():
    cs = [*proven("a", "BASE-02"), case("b", ["BASE-02"], "crash")]
    assert results.clause_status("BASE-02", AVAILABLE, cs)[0] == "crash"


def test_not_supported_and_expected_failures_never_certify():
    unsupported = [case("a", ["BASE-02"], "not supported", message="no such op")]
    expected = [case("a", ["BASE-02"], "expected failure")]
    for cs in (unsupported, expected):
        res = results.aggregate({"start_time": "t"}, {"cpu": AVAILABLE}, cs, ["BASE-02"])
        assert res["clauses"]["BASE-02"]["cpu"] in ("not supported", "expected failure")
        assert res["verdict"]["cpu"] == "not certified"


def test_a_partial_run_never_certifies():
    res = results.aggregate(
        {"start_time": "t", "partial": "-k x"}, {"cpu": AVAILABLE}, proven("a", "BASE-02"), ["BASE-02"]
    )
    assert res["clauses"]["BASE-02"]["cpu"] == "pass" and res["verdict"]["cpu"] == "not certified"
    assert "- partial: `-k x`" in markdown.report(res)


def test_expectations_turn_failures_into_expected_ones_and_passes_into_failures():
    exp = {"cpu": [results.Expectation(case="a", result="fail", reason="upstream bug", reference="issue 1")]}
    out = results.apply_expectations([case("a", ["CANCEL-04"], "fail", message="boom")], exp)
    assert out[0]["outcome"] == "expected failure" and "upstream bug" in out[0]["message"]
    out = results.apply_expectations([case("a", ["CANCEL-04"], "pass")], exp)
    assert out[0]["outcome"] == "fail" and "unexpected pass" in out[0]["message"]


def test_an_expectation_needs_a_reason_and_a_reference_and_goes_stale_with_its_case(tmp_path):
    (tmp_path / "cpu.toml").write_text('[[expected]]\ncase = "a"\nresult = "fail"\nreason = "bug"\n')
    with pytest.raises(ValueError, match="reference"):
        results.load_expectations("cpu", tmp_path)
    (tmp_path / "cpu.toml").write_text('[[expected]]\ncase = "a"\nresult = "fail"\nreason = "bug"\nreference = " "\n')
    with pytest.raises(ValueError, match="a reason and a reference"):
        results.load_expectations("cpu", tmp_path)
    exp = [results.Expectation(case="a", result="fail", reason="bug", reference="issue 1")]
    assert results.stale_expectations("cpu", exp, [case("a", ["CANCEL-04"], "fail")]) == []
    assert results.stale_expectations("cpu", exp, [case("b", ["CANCEL-04"], "fail")]) == exp


def test_every_registry_clause_is_listed_and_the_verdict_counts_the_selection():
    cs = proven("a", "CANCEL-04")
    res = results.aggregate({"start_time": "t"}, {"cpu": AVAILABLE, "cuda": ABSENT}, cs, ["CANCEL-04"])
    assert set(res["clauses"]) == set(registry.clauses())
    assert res["clauses"]["BASE-02"]["cpu"] == "not selected"
    # a selection that passed is not a certification
    assert res["verdict"] == {"cpu": "selection passed", "cuda": "not available"}
    full = results.aggregate({"start_time": "t"}, {"cpu": AVAILABLE}, cs, list(registry.clauses()))
    assert full["verdict"]["cpu"] == "not certified"


def test_shards_merge_into_one_verdict_and_tampering_is_detected():
    build = {"retro": "0.1.0", "llama_cpp": "0c1e57098", "patch_series_sha256": "abc"}
    cpu = results.aggregate(
        {"start_time": "1", **build}, {"cpu": AVAILABLE, "cuda": ABSENT}, proven("a", "CANCEL-04"), ["CANCEL-04"]
    )
    gpu = results.aggregate(
        {"start_time": "2", **build},
        {"cpu": ABSENT, "cuda": AVAILABLE},
        [case("a", ["CANCEL-04"], "fail", backend="cuda", message="diff")],
        ["CANCEL-04"],
    )
    merged = results.merge([cpu, gpu])
    assert merged["backends"]["cpu"]["status"] == merged["backends"]["cuda"]["status"] == "available"
    assert merged["verdict"] == {"cpu": "selection passed", "cuda": "not certified"}
    assert len(merged["shards"]) == 2
    results.verify(merged)
    other = results.aggregate(
        {"start_time": "3", **build, "patch_series_sha256": "def"},
        {"cpu": ABSENT, "cuda": AVAILABLE},
        [],
        ["CANCEL-04"],
    )
    with pytest.raises(ValueError, match="different builds"):
        results.merge([cpu, other])
    gpu["verdict"]["cuda"] = "selection passed"
    with pytest.raises(ValueError, match="digest"):
        results.merge([cpu, gpu])


def test_outputs_are_well_formed(tmp_path):
    cs = [
        case("a", ["CANCEL-04"], "pass"),
        case("b", ["CANCEL-04"], "fail", message="x <&> y"),
        case("c", ["BASE-02"], "crash"),
        case("d", ["BASE-03"], "not supported", message="no op"),
    ]
    selected = ["CANCEL-04", "BASE-03"]
    res = results.aggregate({"start_time": "t", "seed": 0}, {"cpu": AVAILABLE, "vulkan": ABSENT}, cs, selected)
    results.write_all(res, tmp_path)
    loaded = json.loads((tmp_path / "results.json").read_text())
    results.verify(loaded)
    suites = {s.get("name"): s for s in ET.parse(tmp_path / "junit.xml").getroot().findall("testsuite")}
    cpu = suites["cpu"]
    assert (cpu.get("tests"), cpu.get("failures"), cpu.get("errors"), cpu.get("skipped")) == ("4", "1", "1", "1")
    # one test case per clause: CANCEL-04 failed and BASE-03 not supported (red, with its reason:
    # it keeps the backend from being certified); the others are outside the selection (skipped)
    # and one for the verdict: not certified, red
    clauses = suites["cpu.clauses"]
    assert int(clauses.get("tests")) == len(registry.clauses()) + 1
    assert (clauses.get("failures"), clauses.get("errors")) == ("3", "0")
    assert int(clauses.get("skipped")) == len(registry.clauses()) - 2
    assert clauses.find("testcase[@name='verdict']/failure") is not None
    assert clauses.find("testcase[@name='CANCEL-04']/failure") is not None
    unsupported = clauses.find("testcase[@name='BASE-03']/failure")
    assert unsupported is not None and unsupported.get("message", "").startswith("not supported: ")
    assert suites["vulkan.clauses"].get("skipped") == str(len(registry.clauses()) + 1)
    report = (tmp_path / "report.md").read_text()
    assert "| cpu | available | **not certified** |" in report and "### cpu: b (fail)" in report


def _dashboard(path):
    """What a JUnit consumer (junitparser, as CI systems' test reports read the file) counts per suite."""
    from junitparser import Error, Failure, JUnitXml

    counts = {}
    for suite in JUnitXml.fromfile(str(path)):
        failed = [tc.name for tc in suite if any(isinstance(r, (Failure, Error)) for r in (tc.result or []))]
        counts[suite.name] = (suite.failures, suite.errors, sorted(failed))
    return counts


def test_a_dashboard_shows_a_certified_run_green_and_a_failed_clause_red(tmp_path):
    """Certified: every clause's defects caught somewhere, some of them surviving other cases (as in
    any real run: a defect is written for one path) -> no failure and no error in any suite. One
    defect escaping every check -> exactly its clause is red, with the defect named."""
    cs = [*proven("a", "CANCEL-04"), *proven("b", "BASE-02")]
    cs += [case("c", ["CANCEL-04", "BASE-02"], "pass")]
    cs += [case("c", ["CANCEL-04", "BASE-02"], "caught", defect=d) for d in registry.defects_of("BASE-02")]
    cs += [case("c", ["CANCEL-04", "BASE-02"], "survived", defect=d) for d in registry.defects_of("CANCEL-04")[1:]]
    cs += [case("c", ["CANCEL-04", "BASE-02"], "caught", defect=registry.defects_of("CANCEL-04")[0])]
    green = results.aggregate({"start_time": "t"}, {"cpu": AVAILABLE}, cs, ["CANCEL-04", "BASE-02"])
    assert green["verdict"]["cpu"] == "selection passed"
    results.write_all(green, tmp_path / "green")
    counts = _dashboard(tmp_path / "green" / "junit.xml")
    assert counts == {"cpu.clauses": (0, 0, []), "cpu": (0, 0, [])}, counts

    escaped = registry.defects_of("BASE-02")[0]
    red_cases = [c for c in cs if not (c["defect"] == escaped and c["outcome"] == "caught")]
    red_cases += [case(n, ["BASE-02"], "survived", defect=escaped) for n in ("b", "c")]
    red = results.aggregate({"start_time": "t"}, {"cpu": AVAILABLE}, red_cases, ["CANCEL-04", "BASE-02"])
    results.write_all(red, tmp_path / "red")
    counts = _dashboard(tmp_path / "red" / "junit.xml")
    # the clause, and the verdict: not certified
    assert counts == {"cpu.clauses": (2, 0, ["BASE-02", "verdict"]), "cpu": (0, 0, [])}, counts
    message = ET.parse(tmp_path / "red" / "junit.xml").find(".//testcase[@name='BASE-02']/failure").get("message")
    assert escaped in message


def test_the_schema_speaks_the_result_codes_of_outcomes():
    """One vocabulary: the case and clause codes the schema allows are outcomes.py's, in order, and
    each outcome type's code is a case code."""
    schema = json.loads((Path(results.__file__).parent / "results.schema.json").read_text(encoding="utf-8"))
    assert tuple(schema["$defs"]["caseCode"]["enum"]) == outcomes.CASE_CODES
    assert tuple(schema["$defs"]["clauseCode"]["enum"]) == outcomes.CLAUSE_CODES
    assert {outcomes.NotSupported.code, outcomes.NotAvailable.code} <= set(outcomes.CASE_CODES)


def test_each_bound_is_shown_beside_what_intact_runs_and_seeded_defects_measured():
    """The bound table (results.bound_table): per bound, the limit on each backend, the largest
    intact error there, each seeded defect that crossed it, and the backends where the limit is
    more than evidence.WIDE times the intact error with no reason given."""
    from retro.conformance import evidence

    def held(c, name, error, limit, reason=""):
        record = {"bound": name, "observation": "x", "error": error, "limit": limit}
        return c | {"bounds": [record | ({"reason": reason} if reason else {})]}

    cs = [
        held(case("a", ["CANCEL-04"], "pass"), "tight", 2e-7, 1e-6),
        held(case("a", ["CANCEL-04"], "pass", "rpc"), "tight", 0.0, 1e-6),
        held(case("a", ["CANCEL-04"], "caught", defect="CANCEL-04"), "tight", 3e-2, 1e-6),
        held(case("a", ["CANCEL-04"], "caught", defect="CANCEL-04.exception"), "tight", 5e-7, 1e-6),  # within: not it
        held(case("b", ["BASE-02"], "pass"), "explained", 0.0, 1e-5, reason="sized for a GPU"),
    ]
    table = {b["bound"]: b for b in results.bound_table(cs)}
    assert table["tight"] == {
        "bound": "tight",
        "reason": {},
        "limit": {"cpu": 1e-6, "rpc": 1e-6},
        "intact": {"cpu": 2e-7, "rpc": 0.0},
        "defects": {"CANCEL-04": 3e-2},
        "unexplained": ["rpc"],
    }
    assert table["explained"]["unexplained"] == []
    # a limit for the CPU's kernels (CPU and RPC) tighter than a GPU's
    b = evidence.Bound("b", 1e-3, cpu=1e-6)
    assert (b.on("cpu"), b.on("rpc"), b.on("vulkan")) == (1e-6, 1e-6, 1e-3)
    res = results.aggregate({"start_time": "t"}, {"cpu": AVAILABLE, "rpc": AVAILABLE}, cs, ["CANCEL-04", "BASE-02"])
    assert res["bounds"] == results.bound_table(cs)
    report = markdown.report(res)
    assert "| tight | cpu 1e-06; rpc 1e-06 | cpu 2e-07; rpc 0 | CANCEL-04 0.03 | NONE, yet wide on rpc |" in report
    assert "| explained | cpu 1e-05 | cpu 0 | - | cpu: sized for a GPU |" in report


def test_a_wide_limit_needs_its_own_reason_and_the_rule_fails_without_one(monkeypatch):
    """Each limit of a bound gives its own reason: a GPU limit's reason does not excuse the CPU's,
    so a CPU limit more than evidence.WIDE times what the CPU measures, and explained only for the
    GPU, is unexplained on the CPU and on an RPC server computing as it does, and the report says
    so (the whole-certification test fails on any such row)."""
    from retro.conformance import backends, evidence

    monkeypatch.delenv(backends.RPC_NUMERICS_ENV, raising=False)
    b = evidence.Bound("b", 1e-3, cpu=1e-6, reason="a GPU's products at TF32: measured 2e-4")
    assert (b.reason_on("vulkan"), b.reason_on("cpu"), b.reason_on("rpc")) == (b.reason, "", "")
    monkeypatch.setenv(backends.RPC_NUMERICS_ENV, "gpu-like")  # a server computing as a GPU: the GPU's
    assert (b.on("rpc"), b.reason_on("rpc")) == (1e-3, b.reason)
    monkeypatch.delenv(backends.RPC_NUMERICS_ENV)

    def run(backend: str, error: float) -> dict:
        c = case("a", ["CANCEL-04"], "pass", backend)
        ledger = evidence.begin(None, backend)
        try:
            evidence.within("CANCEL-04", b, "x", error)
            return c | {"bounds": list(ledger.bounds.values())}
        finally:
            evidence.end()

    cs = [run("cpu", 1e-8), run("rpc", 2e-7), run("vulkan", 1e-5)]
    (row,) = results.bound_table(cs)
    assert row["reason"] == {"vulkan": b.reason}  # 100 times vulkan's error, with its reason
    assert row["unexplained"] == ["cpu"]  # 100 times the CPU's: its own limit gives no reason
    res = results.aggregate({"start_time": "t"}, {n: AVAILABLE for n in ("cpu", "rpc", "vulkan")}, cs, ["CANCEL-04"])
    assert "vulkan: a GPU's products at TF32: measured 2e-4; NONE, yet wide on cpu |" in markdown.report(res)


def test_a_check_shown_able_to_fail_at_one_shape_profile_is_that_check_at_another():
    """HARNESS-07 is judged per check: a check whose seeded-defect runs caught at the tiny profile
    and whose intact run also passed at the realistic one (where no defect runs) is able to fail;
    a check that passed only at the realistic profile and caught nothing anywhere is not."""
    tiny = [dict(c, id=c["id"] + "[shape=tiny,head=dense]") for c in proven("a", "CANCEL-04")]
    realistic = case("a[shape=realistic,head=dense]", ["CANCEL-04"], "pass")
    assert results.clause_status("CANCEL-04", AVAILABLE, [*tiny, realistic])[0] == "pass"
    alone = case("b[shape=realistic]", ["CANCEL-04"], "pass")
    assert results.clause_status("CANCEL-04", AVAILABLE, [*tiny, realistic, alone]) == (
        "not covered",
        "check(s) that caught no seeded defect of CANCEL-04: b",
    )


def test_a_run_at_some_shape_profiles_is_a_selection_and_a_path_of_another_is_not_asked():
    """A clause naming the path shape=realistic: a run whose cases ran at the tiny profile only
    does not ask for it (the profile was not selected) and passes a clause selection; the verdict
    over every clause is then "selection passed", never certified, as a selection of clauses. A run
    that also ran at the realistic profile asks for the path: passing there certifies it, a
    realistic case that never passed leaves it not covered. A seeded defect runs, and is needed,
    only at the profiles its entry names."""
    clause = "TX-ACC-08"
    assert "shape=realistic" in registry.clauses()[clause].paths
    tiny = "test_t[shape=tiny]"
    cs = [case(tiny, [clause], "pass", paths=["shape=tiny"])]
    cs += [case(tiny, [clause], "caught", defect=d) for d in registry.defects_of(clause, shapes=["tiny"])]
    assert results.clause_status(clause, AVAILABLE, cs, name="cpu")[0] == "pass"
    realistic = "test_t[shape=realistic]"
    ran = [*cs, case(realistic, [clause], "pass", paths=["shape=realistic"])]
    assert results.clause_status(clause, AVAILABLE, ran, name="cpu")[0] == "pass"
    skipped = [*cs, case(realistic, [clause], "not supported", message="skipped")]
    status, why = results.clause_status(clause, AVAILABLE, skipped, name="cpu")
    assert status == "not covered" and "shape=realistic" in why, why
    # BASE-01.class-blocks names the realistic profile only: needed once a case ran there
    base = "BASE-01"
    at_tiny = [case("test_b[shape=tiny]", [base], "pass", paths=[*registry.clauses()[base].paths])]
    at_tiny += [
        case("test_b[shape=tiny]", [base], "caught", defect=d) for d in registry.defects_of(base, shapes=["tiny"])
    ]
    assert results.clause_status(base, AVAILABLE, at_tiny, name="cpu")[0] == "pass"
    both = [*at_tiny, case("test_b[shape=realistic]", [base], "pass", paths=["shape=realistic"])]
    status, why = results.clause_status(base, AVAILABLE, both, name="cpu")
    assert status == "not covered" and "BASE-01.class-blocks" in why, why
    # the verdict over every clause: a run at the tiny profile alone is a selection
    every = [c for cid in registry.clauses() for c in proven(f"test_{cid}[shape=tiny]", cid)]
    res = results.aggregate({"start_time": "t"}, {"cpu": AVAILABLE}, every, list(registry.clauses()))
    assert res["verdict"]["cpu"] == outcomes.SELECTION_PASSED, [
        (cid, s["cpu"], res["clause_details"][cid]["cpu"]) for cid, s in res["clauses"].items() if s["cpu"] != "pass"
    ]
