"""The pytest plugin: citation lint, one run per backend and per seeded defect, result codes."""

from __future__ import annotations

import json

import pytest

from retro.conformance import registry

pytest_plugins = ["pytester"]


def _results(pytester: pytest.Pytester, *args: str) -> tuple[pytest.RunResult, list[dict]]:
    log = pytester.path / "results.jsonl"
    res = pytester.runpytest_subprocess(
        f"--results-log={log}", "-p", "no:cacheprovider", "-p", "retro.conformance.plugin", *args
    )
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return res, [r for r in records if r["event"] == "result"]


@pytest.mark.parametrize(
    "clause, signature, message",
    [
        ("BASE-99", "backend", "*unknown clause ID*BASE-99*"),
        ("BASE-01", "", "*must take the `backend` fixture*"),
    ],
)
def test_miscited_checks_are_collection_errors(pytester, clause, signature, message):
    pytester.makepyfile(
        test_x=f"""
        import pytest
        @pytest.mark.clause("{clause}")
        def test_x({signature}):
            assert True
    """
    )
    res, recs = _results(pytester)
    assert res.ret == pytest.ExitCode.INTERRUPTED and not recs
    res.stdout.fnmatch_lines([message])


def test_each_check_runs_per_backend_and_per_seeded_defect(pytester):
    pytester.makepyfile(
        test_x="""
        import pytest
        from retro._native import hooks
        from retro.conformance.evidence import expect
        @pytest.mark.clause("BASE-01", "HARNESS-05")
        def test_x(backend):
            expect("BASE-01", not hooks.defect_on("BASE-01"), "defect seen")
            expect("HARNESS-05", True)
    """
    )
    res, recs = _results(pytester, "--backend=cpu,cuda")
    by = {(r["backend"], r["defect"]): r for r in recs}
    assert by[("cpu", None)]["outcome"] == "pass"
    assert by[("cpu", "BASE-01")]["outcome"] == "caught"
    assert by[("cpu", "BASE-01")]["caught"] == {"clause": "BASE-01", "assertion": "defect seen"}
    assert by[("cpu", "BASE-01.eval-period")]["outcome"] == "survived"  # this check does not catch that one
    assert by[("cuda", None)]["outcome"] == "not available"  # absent here: never "pass"
    assert by[("cpu", None)]["clauses"] == ["BASE-01", "HARNESS-05"]
    assert by[("cpu", "HARNESS-05")]["outcome"] == "survived"
    # per backend: the intact run, each defect of BASE-01, the one of HARNESS-05
    # (those of the default shape profile: the check takes none)
    assert len(recs) == 2 * (1 + len(registry.defects_of("BASE-01", shapes=["tiny"])) + 1)
    assert res.ret == pytest.ExitCode.OK


def test_a_defect_is_caught_only_by_an_assertion_bound_to_its_clause(pytester):
    pytester.makepyfile(
        test_x="""
        import pytest
        from retro._native import hooks
        from retro.conformance.evidence import bound, expect
        @pytest.mark.clause("BASE-01", "BASE-03")
        def test_x(backend):
            expect("BASE-03", not hooks.defect_on("BASE-01"), "BASE-03's assertion sees BASE-01's defect")
            with bound("BASE-03"):
                assert not hooks.defect_on("BASE-03"), "a plain assert bound to BASE-03"
            expect("BASE-01", True)
    """
    )
    _, recs = _results(pytester)
    by = {r["defect"]: r for r in recs}
    assert by[None]["outcome"] == "pass"
    assert by["BASE-01"]["outcome"] == "survived"
    assert "BASE-03's assertion sees" in by["BASE-01"]["message"]
    assert by["BASE-03"]["outcome"] == "caught" and by["BASE-03"]["caught"]["clause"] == "BASE-03"


def test_an_exception_escaping_a_bound_block_is_its_clauses_failure(pytester):
    """A pytest.raises bound to a clause that meets another kind of exception (the refusal the
    clause promised did not come), or a bound call that raises, fails the clause's assertion: the
    defect is caught by its own clause, not left to an error outside every assertion."""
    pytester.makepyfile(
        test_x="""
        import pytest
        from retro._native import hooks
        from retro.conformance.evidence import bound, expect, succeeds
        @pytest.mark.clause("BASE-01", "BASE-03")
        def test_x(backend):
            with bound("BASE-01"), pytest.raises(ValueError):
                raise (KeyError if hooks.defect_on("BASE-01") else ValueError)("refused")
            def call():
                if hooks.defect_on("BASE-03"):
                    raise RuntimeError("the call failed")
                return 3
            expect("BASE-03", succeeds("BASE-03", "the call", call) == 3)
    """
    )
    _, recs = _results(pytester)
    by = {r["defect"]: r for r in recs if r["backend"] == "cpu"}
    assert by[None]["outcome"] == "pass"
    assert by["BASE-01"]["outcome"] == "caught", by["BASE-01"]["message"]
    assert "raised KeyError" in by["BASE-01"]["caught"]["assertion"]
    assert by["BASE-03"]["outcome"] == "caught", by["BASE-03"]["message"]
    assert "the call failed: RuntimeError" in by["BASE-03"]["caught"]["assertion"]


def test_a_check_must_assert_through_every_clause_it_cites(pytester):
    pytester.makepyfile(
        test_x="""
        import pytest
        from retro.conformance.evidence import expect
        @pytest.mark.clause("BASE-02", "BASE-03")
        def test_x(backend):
            expect("BASE-02", True)
    """
    )
    _, recs = _results(pytester, "--no-defects")
    assert recs[0]["outcome"] == "fail" and "BASE-03 but never asserted" in recs[0]["message"]


def test_a_check_that_cannot_fail_is_reported_as_a_failure_under_its_defect(pytester):
    pytester.makepyfile(
        test_x="""
        import pytest
        from retro.conformance.evidence import expect
        @pytest.mark.clause("BASE-02")
        def test_x(backend):
            expect("BASE-02", 1 + 1 == 2)
    """
    )
    _res, recs = _results(pytester)
    by = {r["defect"]: r for r in recs}
    assert by[None]["outcome"] == "pass"
    assert by["BASE-02"]["outcome"] == "survived" and "survived" in by["BASE-02"]["message"]


def test_skips_need_a_result_code(pytester):
    pytester.makepyfile(
        test_x="""
        import pytest
        from retro.conformance.plugin import not_supported
        @pytest.mark.clause("HOST-01")
        def test_plain_skip(backend):
            pytest.skip("no reason code")
        @pytest.mark.clause("HOST-02")
        def test_unsupported(backend):
            not_supported("no such op here")
    """
    )
    _, recs = _results(pytester)
    by = {r["id"]: r for r in recs}
    assert by["test_x.py::test_plain_skip"]["outcome"] == "fail"
    assert by["test_x.py::test_unsupported"]["outcome"] == "not supported"
    assert by["test_x.py::test_unsupported"]["message"] == "no such op here"


def test_the_clause_filter_deselects_other_checks(pytester):
    pytester.makepyfile(
        test_x="""
        import pytest
        from retro.conformance.evidence import expect
        @pytest.mark.clause("HARNESS-06")
        def test_a(backend):
            expect("HARNESS-06", True)
        @pytest.mark.clause("HOST-01")
        def test_b(backend):
            expect("HOST-01", True)
    """
    )
    _, recs = _results(pytester, "--clauses=HARNESS-06")
    assert {r["id"] for r in recs} == {"test_x.py::test_a"}  # intact and its defect run


def test_a_path_counts_only_when_the_case_records_it_after_its_assertions(pytester):
    """TX-ACC-09's values as parameters: the case that returns early for +inf after a generic
    assertion ran no path; only on_path, reached after the assertions that prove it, credits one."""
    pytester.makepyfile(
        test_x="""
        import pytest
        from retro.conformance.evidence import expect, on_path
        @pytest.mark.clause("TX-ACC-09")
        @pytest.mark.parametrize("value", ["nan", "+inf"])
        def test_x(backend, value):
            expect("TX-ACC-09", True)
            if value == "+inf":
                return
            on_path(f"value={value}")
    """
    )
    _, recs = _results(pytester, "--backend=cpu", "--no-defects")
    ran = {r["nodeid"].split("[")[1]: r["paths"] for r in recs if r["outcome"] == "pass"}
    assert ran == {"cpu-nan]": ["value=nan"], "cpu-+inf]": []}, ran


def test_a_check_runs_at_the_shape_profiles_it_names_and_records_each(pytester):
    """A check taking `shape` runs at the profiles of conformance/shapes.py it names (the default one
    when it names none) that --shape selected, and its passing intact run records the path
    shape=<name>; a seeded-defect run only at its defect's profiles (BASE-01.class-blocks only at
    the realistic one, the clause's others only at the default one)."""
    pytester.makepyfile(
        test_x="""
        import pytest
        from retro.conformance.evidence import expect
        @pytest.mark.clause("BASE-01")
        def test_default(backend, shape):
            expect("BASE-01", shape.window % shape.micro_batch == 0)
        @pytest.mark.clause("BASE-01")
        @pytest.mark.shapes("tiny", "realistic")
        def test_both(backend, shape):
            expect("BASE-01", shape.window % shape.micro_batch == 0)
        @pytest.mark.clause("BASE-01")
        @pytest.mark.shapes("tiny")
        @pytest.mark.parametrize("part", ["a", pytest.param("b", marks=pytest.mark.shapes("realistic"))])
        def test_param(backend, shape, part):
            expect("BASE-01", True)
    """
    )
    _, recs = _results(pytester, "--no-defects", "--shape=all")
    assert sorted((r["id"], tuple(r["paths"])) for r in recs) == [
        ("test_x.py::test_both[shape=realistic]", ("shape=realistic",)),
        ("test_x.py::test_both[shape=tiny]", ("shape=tiny",)),
        ("test_x.py::test_default[shape=tiny]", ("shape=tiny",)),
        ("test_x.py::test_param[shape=realistic,part=b]", ("shape=realistic",)),
        ("test_x.py::test_param[shape=tiny,part=a]", ("shape=tiny",)),
    ]
    (pytester.path / "results.jsonl").unlink()  # a new log for the next run
    _, recs = _results(pytester, "--shape=realistic")
    assert {(r["id"], r["defect"]) for r in recs} == {
        (case, defect)
        for case in ("test_x.py::test_both[shape=realistic]", "test_x.py::test_param[shape=realistic,part=b]")
        for defect in (None, "BASE-01.class-blocks")
    }
    (pytester.path / "results.jsonl").unlink()
    res, recs = _results(pytester, "--shape=huge")
    assert res.ret == pytest.ExitCode.USAGE_ERROR and not recs
