"""retro-conformance diff: what changed between two results packages, regressions first."""

from __future__ import annotations

import copy

from test_conformance_results import ABSENT, AVAILABLE, case, proven

from retro.conformance import cli, diff, registry, results

BUILD = {"retro": "0.1.0", "llama_cpp": "0c1e57098", "patch_series_sha256": "abc", "patches": ["0001-a.patch"]}


def _package(cases: list[dict], backends: dict | None = None, **run: object) -> dict:
    return results.aggregate(
        {"start_time": "t", **BUILD, **run},
        backends or {"cpu": AVAILABLE, "rpc": AVAILABLE},
        cases,
        ["CANCEL-04", "BASE-02", "BASE-03"],
    )


def _release() -> list[dict]:
    cs = [*proven("a", "CANCEL-04"), *proven("b", "BASE-02"), *proven("c", "BASE-03")]
    cs += [*proven("a", "CANCEL-04", "rpc"), *proven("b", "BASE-02", "rpc"), *proven("c", "BASE-03", "rpc")]
    cs[0]["bounds"] = [{"bound": "logits NMSE", "observation": "logits", "error": 1e-8, "limit": 1e-6}]
    return cs


def _write(tmp_path, name: str, res: dict):
    results.write_all(res, tmp_path / name)
    return str(tmp_path / name)


def test_a_seeded_regression_is_found_first_and_exits_1(tmp_path, capsys):
    old = _package(_release())
    cases = copy.deepcopy(_release())
    # the regression: BASE-02's defect now escapes its check (a check gone blind)
    blind = next(c for c in cases if c["defect"] == "BASE-02")
    blind["outcome"], blind["message"] = "survived", "seeded defect BASE-02 survived every assertion"
    cases[0]["bounds"][0]["error"] = 5e-7  # moved by half the limit, still within it
    cases[0]["duration_s"] = 3.0  # 0.1 s before
    new = _package(cases, patch_series_sha256="def", patches=["0001-a.patch", "0002-b.patch"])
    d = diff.compare(old, new)
    assert d.regressed
    assert [c.where for c in d.regressions] == ["BASE-02 on cpu"]
    assert [c.where for c in d.defect_runs] == ["cpu: b [defect BASE-02]"]
    assert d.regressions[0].old == "pass" and d.regressions[0].new == "fail"
    assert [v.line() for v in d.verdicts] == ["cpu: selection passed -> not certified"]
    assert "patch series: abc -> def" in d.builds and any("added ['0002-b.patch']" in b for b in d.builds)
    assert [c.where for c in d.bounded] == ["cpu: a: logits"] and not any(c in d.regressions for c in d.bounded)
    assert [c.where for c in d.timings] == ["cpu: a"]

    rc = cli.main(
        ["diff", _write(tmp_path, "old", old), _write(tmp_path, "new", new), "--markdown", str(tmp_path / "pr.md")]
    )
    out = capsys.readouterr().out
    assert rc == 1
    assert out.splitlines()[:3] == [
        "diff: 1 regression(s); 1 clause status(es) changed: BASE-02 on cpu: pass -> fail",
        "Regressions:",
        "  BASE-02 on cpu: pass -> fail (" + new["clause_details"]["BASE-02"]["cpu"] + ")",
    ]
    md = (tmp_path / "pr.md").read_text()
    assert md.index("### Regressions") < md.index("### Builds") and "**1 regression(s); " in md


def test_the_same_package_twice_has_no_change_and_an_absent_backend_is_not_a_regression(tmp_path, capsys):
    old = _package(_release())
    assert cli.main(["diff", _write(tmp_path, "a", old), _write(tmp_path, "b", old)]) == 0
    assert capsys.readouterr().out.splitlines() == ["diff: no regression"]
    gone = _package([c for c in _release() if c["backend"] == "cpu"], {"cpu": AVAILABLE, "rpc": ABSENT})
    d = diff.compare(old, gone)
    assert not d.regressed and "CANCEL-04 on rpc" in [c.where for c in d.not_compared]
    # a fixed clause reads as an improvement the other way round
    assert not diff.compare(_package([case("a", ["CANCEL-04"], "fail")]), old).regressed


def test_a_clause_that_now_passes_leads_and_defect_runs_decided_elsewhere_are_no_regression():
    """A check that crashed and passes now: its defects, once 'caught' by the crash, survive on the
    cases whose path they are not on and are caught by their own. The headline is the clause's
    change; nothing regressed."""
    fixed = _release()
    crashed = copy.deepcopy(fixed)
    for c in crashed:
        if c["id"] == "b" and c["backend"] == "cpu":
            c["outcome"] = "crash" if c["defect"] is None else "caught"
    # in the fixed run a second check of BASE-02 lets its defect through (another case catches it)
    first, *rest = registry.defects_of("BASE-02")
    caught_rest = [case("d", ["BASE-02"], "caught", defect=r) for r in rest]
    extra = [case("d", ["BASE-02"], "pass"), case("d", ["BASE-02"], "survived", defect=first), *caught_rest]
    old_extra = [case("d", ["BASE-02"], "pass"), case("d", ["BASE-02"], "caught", defect=first), *caught_rest]
    d = diff.compare(_package(crashed + old_extra), _package(fixed + extra))
    assert not d.regressed, [c.line() for c in d.regressions]
    assert [c.line() for c in d.clauses] == [
        "BASE-02 on cpu: crash -> pass (" + _package(fixed + extra)["clause_details"]["BASE-02"]["cpu"] + ")"
    ]
    assert diff.summary(d)[0].startswith(
        "diff: no regression; 1 clause status(es) changed: BASE-02 on cpu: crash -> pass"
    )
    assert f"cpu: d [defect {first}]: caught -> survived" in [c.line() for c in d.defect_runs]
