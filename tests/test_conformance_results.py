"""Clause status, verdict, expectations, merge and the three output files."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from conformance import registry, results

AVAILABLE = {"status": "available", "reason": "", "devices": []}
ABSENT = {"status": "not available", "reason": "not compiled into this build", "devices": []}


def case(name, clauses, outcome, backend="cpu", defect=None, message=""):
    return {"nodeid": name, "id": name, "clauses": clauses, "backend": backend, "defect": defect,
            "outcome": outcome, "duration_s": 0.1, "message": message}


def test_a_clause_passes_only_with_a_passing_check_and_its_defect_caught():
    ok = [case("a", ["BASE-01"], "pass"), case("a", ["BASE-01"], "pass", defect="BASE-01")]
    assert results.clause_status("BASE-01", AVAILABLE, ok)[0] == "pass"
    assert results.clause_status("BASE-01", AVAILABLE, ok[:1]) == (
        "not covered", "not run against its seeded defect: a")
    survived = [ok[0], case("a", ["BASE-01"], "fail", defect="BASE-01")]
    assert results.clause_status("BASE-01", AVAILABLE, survived)[0] == "fail"
    assert results.clause_status("BASE-01", AVAILABLE, [])[0] == "not covered"
    assert results.clause_status("BASE-01", ABSENT, ok)[0] == "not available"
    assert results.clause_status("HOST-01", AVAILABLE, [case("h", ["HOST-01"], "pass")])[0] == "not covered"


def test_crash_and_fail_dominate():
    cs = [case("a", ["BASE-02"], "pass"), case("a", ["BASE-02"], "pass", defect="BASE-02"), case("b", ["BASE-02"], "crash")]
    assert results.clause_status("BASE-02", AVAILABLE, cs)[0] == "crash"


def test_expectations_turn_failures_into_expected_ones_and_passes_into_failures():
    exp = {"cpu": [results.Expectation(case="a", result="fail", reason="upstream bug")]}
    out = results.apply_expectations([case("a", ["BASE-01"], "fail", message="boom")], exp)
    assert out[0]["outcome"] == "expected failure" and "upstream bug" in out[0]["message"]
    out = results.apply_expectations([case("a", ["BASE-01"], "pass")], exp)
    assert out[0]["outcome"] == "fail" and "unexpected pass" in out[0]["message"]


def test_every_registry_clause_is_listed_and_the_verdict_counts_the_selection():
    cs = [case("a", ["BASE-01"], "pass"), case("a", ["BASE-01"], "pass", defect="BASE-01")]
    res = results.aggregate({"start_time": "t"}, {"cpu": AVAILABLE, "cuda": ABSENT}, cs, ["BASE-01"])
    assert set(res["clauses"]) == set(registry.clauses())
    assert res["clauses"]["BASE-02"]["cpu"] == "not selected"
    assert res["verdict"] == {"cpu": "certified", "cuda": "not available"}
    full = results.aggregate({"start_time": "t"}, {"cpu": AVAILABLE}, cs, list(registry.clauses()))
    assert full["verdict"]["cpu"] == "not certified"


def test_shards_merge_into_one_verdict_and_tampering_is_detected():
    cpu = results.aggregate({"start_time": "1"}, {"cpu": AVAILABLE, "cuda": ABSENT},
                            [case("a", ["BASE-01"], "pass"), case("a", ["BASE-01"], "pass", defect="BASE-01")], ["BASE-01"])
    gpu = results.aggregate({"start_time": "2"}, {"cpu": ABSENT, "cuda": AVAILABLE},
                            [case("a", ["BASE-01"], "fail", backend="cuda", message="diff")], ["BASE-01"])
    merged = results.merge([cpu, gpu])
    assert merged["backends"]["cpu"]["status"] == merged["backends"]["cuda"]["status"] == "available"
    assert merged["verdict"] == {"cpu": "certified", "cuda": "not certified"}
    assert len(merged["shards"]) == 2
    results.verify(merged)
    gpu["verdict"]["cuda"] = "certified"
    with pytest.raises(ValueError, match="digest"):
        results.merge([cpu, gpu])


def test_outputs_are_well_formed(tmp_path):
    cs = [case("a", ["BASE-01"], "pass"), case("b", ["BASE-01"], "fail", message="x <&> y"),
          case("c", ["BASE-02"], "crash"), case("d", ["BASE-03"], "not supported", message="no op")]
    res = results.aggregate({"start_time": "t", "seed": 0}, {"cpu": AVAILABLE, "vulkan": ABSENT}, cs, ["BASE-01"])
    results.write_all(res, tmp_path)
    loaded = json.loads((tmp_path / "results.json").read_text())
    results.verify(loaded)
    suites = ET.parse(tmp_path / "junit.xml").getroot().findall("testsuite")
    cpu = next(s for s in suites if s.get("name") == "cpu")
    assert (cpu.get("tests"), cpu.get("failures"), cpu.get("errors"), cpu.get("skipped")) == ("4", "1", "1", "1")
    report = (tmp_path / "report.md").read_text()
    assert "| cpu | available | **not certified** |" in report and "### cpu: b (fail)" in report
