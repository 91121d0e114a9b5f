"""retro-conformance end to end: the four files, exit codes, crash isolation, -j."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from retro.conformance import outcomes, registry, results
from retro.conformance.backends import PRECOMPILED

#: where CI wants the package of the whole certification below, as one shard of its matrix (.ci/run)
SHARD_ENV = "RETRO_CI_SHARD"
SCHEMA = json.loads((Path(registry.__file__).parent / "results.schema.json").read_text(encoding="utf-8"))


def certify(tmp_path: Path, *args: str) -> tuple[int, dict, str]:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "retro.conformance.cli", "certify", "--out", str(out), *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        # a full certification takes about 2 minutes on 2 idle cores; xdist runs it beside the
        # mutation and unpatched builds, and a loaded machine may slow it several times over
        timeout=2400,
    )
    res = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else {}
    return proc.returncode, res, proc.stdout + proc.stderr


def what_fell_short(res: dict, log: str) -> str:
    """The clauses that are not pass on an available backend, with their reasons, and the cases
    that did not end as they should: the log of a whole certification is too long to read in CI."""
    if not res:
        return log[-6000:]
    lines = [
        f"{cid} on {name}: {status} ({res['clause_details'][cid][name]})"
        for cid, row in res["clauses"].items()
        for name, status in row.items()
        if res["backends"][name]["status"] == "available" and status != "pass"
    ]
    lines += [
        f"{c['backend']} {c['id']} [{c['defect'] or 'intact'}]: {c['outcome']}: {c['message'][:600]}"
        for c in res["cases"]
        if c["outcome"] in ("fail", "crash")
    ]
    return "\n".join(lines) or log[-6000:]


def test_certify_everything_writes_four_files_and_is_honest_about_what_is_missing(tmp_path):
    """Every clause has a check: on the CPU (and RPC, where built) every clause passes and the
    backend reads certified, exit 0, every intact case passing and every seeded
    defect caught by a check of a clause it names; the backends absent here read not available, and
    keep the topology-cache gate refused for a package that holds them. The package is four files,
    its results.json valid against the schema and naming the build.

    The RPC servers compute like a GPU (--numerics gpu-like: products rounded as CUDA's kernel for
    their row count rounds them, forward and backward, in a warp's summation order), so that every
    bound is proved against a GPU's numerics with every seeded defect still caught, while the CPU
    keeps its own bounds: a GPU-like RPC certified is what lets a CUDA or Vulkan device's numerics
    pass the clauses it honours."""
    rc, res, log = certify(tmp_path, "--backend", "all", "--numerics", "gpu-like")
    if os.environ.get(SHARD_ENV):  # CI merges this package with its other builds' shards
        shutil.copytree(tmp_path / "out", os.environ[SHARD_ENV], dirs_exist_ok=True)
    available = [n for n, b in res["backends"].items() if b["status"] == "available"]
    short = [(cid, name) for name in available for cid, status in res["clauses"].items() if status[name] != "pass"]
    assert rc == 0 and not short, what_fell_short(res, log)
    assert all(res["verdict"][n] == "certified" for n in available), res["verdict"]
    jsonschema.validate(res, SCHEMA)
    assert {p.name for p in (tmp_path / "out").iterdir()} == {"results.json", "junit.xml", "report.md", "report.html"}
    assert res["schema"] == results.SCHEMA == 3 and set(res["clauses"]) == set(res["selected"]) == set(
        registry.clauses()
    )
    for key in ("retro", "llama_cpp", "patch_series_sha256", "python", "platform", "start_time", "seed"):
        assert res["run"][key] != "", key
    if "rpc" in available:
        assert res["run"]["numerics"] == {"rpc": "gpu-like"}, res["run"]
    intact = {c["outcome"] for c in res["cases"] if c["defect"] is None and c["backend"] in available}
    assert intact <= {"pass", "not supported"}, intact
    # a defect is caught only by checks of the clauses it may show on
    cited = {d for c in res["cases"] for clause in c["clauses"] for d in registry.defects_of(clause)}
    assert {c["defect"] for c in res["cases"] if c["outcome"] == "caught"} <= cited
    assert res["clauses"]["HARNESS-05"]["cpu"] == res["clauses"]["HARNESS-07"]["cpu"] == "pass"
    # each path a clause names ran on each backend where it exists, as the case records say
    for name in available:
        for cid, clause in registry.clauses().items():
            ran = {
                p
                for c in res["cases"]
                if c["backend"] == name
                and c["defect"] is None
                and c["outcome"] == "pass"
                and cid in c.get("asserted", ())
                for p in c["paths"]
            }
            assert set(clause.paths_on(name)) <= ran, f"{cid} on {name}: {set(clause.paths_on(name)) - ran} never ran"
    # every bound sits within evidence.WIDE times what the intact runs measured, or says why not
    unexplained = {b["bound"]: (b["limit"], b["intact"]) for b in res["bounds"] if b["unexplained"]}
    assert not unexplained, unexplained
    # a backend-independent clause's pass says so in the matrix
    assert "| HARNESS-05 | pass (backend-independent) |" in (tmp_path / "out" / "report.md").read_text()
    # every available backend that compiles kernels on first use was warmed up before its checks,
    # and the run says how long
    assert set(res["run"]["warm_up_s"]) == set(available) - set(PRECOMPILED), res["run"]
    decision = res["gates"]["topology-cache"]
    assert not [m for m in decision["missing"] if " on cpu: " in m], decision["missing"]
    for name in set(res["backends"]) - set(available):
        assert res["verdict"][name] == "not available"
        assert set(res["clauses"][c][name] for c in res["clauses"]) <= {"not available"}
        assert decision["decision"] == "refuse"
        assert any(m.startswith(f"{name}: not available") for m in decision["missing"]), decision["missing"]


def test_the_warm_up_runs_the_checks_operations(tmp_path):
    """The warm-up's workload (decode, generate, both heads, packed documents) runs through the
    public API in a child interpreter, as certify starts it: a warm-up that failed would leave the
    kernels to be compiled inside the checks, silently."""
    done = subprocess.run(
        [sys.executable, "-m", "retro.conformance.warm_up", "cpu", str(tmp_path / "new-folder")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_requested_backend_that_is_absent_is_not_a_pass(tmp_path):
    import retro

    absent = [n for n in ("cuda", "vulkan") if n not in retro.build_info()["backends"]]
    if not absent:
        pytest.skip("every backend is built here")
    rc, res, log = certify(tmp_path, "--backend", absent[0], "--clauses", "BASE")
    assert rc == 1 and res["verdict"] == {absent[0]: "not available"}
    assert "nothing was certified" in log


def test_a_results_package_that_breaks_the_schema_is_caught(tmp_path):
    _, res, _ = certify(tmp_path, "--clauses", "BASE-03", "--no-defects", "--shape", "tiny")
    jsonschema.validate(res, SCHEMA)
    res["cases"][0]["outcome"] = "passed"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(res, SCHEMA)


def test_crashing_and_hanging_cases_are_isolated_and_the_run_goes_on(tmp_path):
    cases = tmp_path / "cases"
    cases.mkdir()
    (cases / "test_crash.py").write_text(
        "import os, pytest\nfrom retro.conformance.evidence import expect\n"
        "@pytest.mark.clause('BASE-01')\ndef test_before(backend):\n    expect('BASE-01', True)\n"
        "@pytest.mark.clause('BASE-02')\ndef test_crash(backend):\n    os.abort()\n"
        "@pytest.mark.clause('BASE-02')\ndef test_hang(backend):\n    import time; time.sleep(600)\n"
        "@pytest.mark.clause('BASE-03')\ndef test_after(backend):\n    expect('BASE-03', True)\n"
    )
    # relative to the caller's folder (the CLI runs pytest elsewhere)
    rc, res, log = certify(tmp_path, "--cases", "cases", "--no-defects", "--clauses", "BASE", "--case-timeout", "10")
    assert rc == 1, log
    outcome = {c["id"]: c["outcome"] for c in res["cases"]}
    assert outcome == {
        "test_crash.py::test_before": "pass",
        "test_crash.py::test_crash": "crash",
        "test_crash.py::test_hang": "crash",
        "test_crash.py::test_after": "pass",
    }
    messages = {c["id"]: c["message"] for c in res["cases"]}
    assert "died" in messages["test_crash.py::test_crash"]
    assert "ran over 10 s" in messages["test_crash.py::test_hang"]
    assert res["clauses"]["BASE-02"]["cpu"] == "crash"
    assert res["clauses"]["BASE-01"]["cpu"] == "not covered"  # --no-defects: not shown able to fail


def test_exitfirst_stops_at_the_first_failure_and_never_certifies(tmp_path):
    cases = tmp_path / "cases"
    cases.mkdir()
    (cases / "test_first.py").write_text(
        "import pytest\nfrom retro.conformance.evidence import expect\n"
        "@pytest.mark.clause('BASE-01')\ndef test_a(backend):\n    expect('BASE-01', True)\n"
        "@pytest.mark.clause('BASE-02')\ndef test_b(backend):\n    expect('BASE-02', False)\n"
        "@pytest.mark.clause('BASE-03')\ndef test_c(backend):\n    expect('BASE-03', True)\n"
    )
    rc, res, log = certify(tmp_path, "--cases", "cases", "--no-defects", "--clauses", "BASE", "--exitfirst")
    assert rc == 1, log
    assert {c["id"]: c["outcome"] for c in res["cases"]} == {
        "test_first.py::test_a": "pass",
        "test_first.py::test_b": "fail",
    }
    assert "exitfirst" in res["run"]["partial"] and res["verdict"] == {"cpu": "not certified"}
    assert res["clauses"]["BASE-03"]["cpu"] == "not covered"


def test_bad_arguments_exit_2(tmp_path):
    rc, _, log = certify(tmp_path, "--backend", "tpu")
    assert rc == 2 and "unknown backend" in log


def _case(clauses: list[str], outcome: str = "pass", message: str = "", defect: str | None = None) -> dict:
    """A case record as results.json holds it, on the CPU."""
    return {
        "id": "test_x.py::test_y",
        "clauses": clauses,
        "backend": "cpu",
        "defect": defect,
        "outcome": outcome,
        "message": message,
    }


def test_the_summary_says_why_a_backend_is_not_certified(tmp_path, capsys) -> None:
    """The lines after a backend's verdict name each clause short of a pass and the first line of
    each failed check's message, so the end of a log says what failed; a certified backend gets none."""
    from retro.conformance import cli

    res = {
        "verdict": {"cpu": "not certified"},
        "selected": ["BASE-01", "BASE-02", "HOST-01"],
        "clauses": {"BASE-01": {"cpu": "fail"}, "BASE-02": {"cpu": "pass"}, "HOST-01": {"cpu": "not covered"}},
        "clause_details": {c: {"cpu": f"why {c}"} for c in ("BASE-01", "BASE-02", "HOST-01")},
        "cases": [
            _case(["BASE-01"], "fail", "AssertionError: loss 2.5 != 2.4\nmore lines"),
            _case(["BASE-01"], "survived", "escaped", defect="BASE-01"),
            _case(["BASE-02"]),
        ],
    }
    assert cli._summarize(res, tmp_path) == 1
    out = capsys.readouterr().out.splitlines()
    at = out.index("cpu: not certified (1 fail, 1 pass, 1 not covered): 1 of 3 clauses pass")
    assert out[at + 1 : at + 4] == [
        "  BASE-01 fail: why BASE-01",
        "    fail: test_x.py::test_y: AssertionError: loss 2.5 != 2.4",
        "  HOST-01 not covered: why HOST-01",
    ]
    res["verdict"]["cpu"] = "certified"
    cli._summarize(res, tmp_path)
    assert not [line for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]


def test_a_selection_that_passes_has_its_own_verdict_and_exit_code(tmp_path, capsys) -> None:
    """A run of some clauses reads "selection passed" and exits 3, never certified and 0: a CI job
    with a stray --clauses cannot ship a backend as certified; all of the registry exits 0."""
    from retro.conformance import cli

    every = list(registry.clauses())
    res = {
        "verdict": {"cpu": outcomes.SELECTION_PASSED, "cuda": "not available"},
        "selected": every[:3],
        "clauses": {c: {"cpu": "pass" if c in every[:3] else "not selected", "cuda": "not available"} for c in every},
        "clause_details": {c: {"cpu": "", "cuda": ""} for c in every},
        "cases": [],
    }
    assert cli._summarize(res, tmp_path) == outcomes.EXIT_SELECTION_PASSED == 3
    assert (
        f"cpu: selection passed (3 pass): passed 3 of 3 selected; not a certification ({len(every)} clauses in the registry)"
        in capsys.readouterr().out
    )
    res["verdict"]["cpu"], res["selected"] = outcomes.CERTIFIED, every
    res["clauses"] = {c: {"cpu": "pass", "cuda": "not available"} for c in every}
    assert cli._summarize(res, tmp_path) == outcomes.EXIT_CERTIFIED == 0
    assert f"cpu: certified ({len(every)} pass): {len(every)} of {len(every)} clauses pass" in capsys.readouterr().out
    assert cli.exit_code({"cpu": outcomes.SELECTION_PASSED, "rpc": "not certified"}) == 1
    assert cli.exit_code({"cuda": "not available"}) == 1


def test_parallel_certification_gives_the_results_of_a_sequential_one(tmp_path):
    """-j 2 deals the cases of both backends to two workers; the package equals -j 1's but for
    timings and scheduling (results.comparable)."""
    from retro.conformance import results

    packages = []
    for jobs in ("1", "2"):
        (tmp_path / jobs).mkdir()
        rc, res, log = certify(tmp_path / jobs, "--backend", "cpu,rpc", "--clauses", "FAIL-03,HARNESS-02", "-j", jobs)
        assert rc == 3 and set(res["verdict"].values()) == {"selection passed"}, log
        packages.append(res)
    one, two = packages
    assert len(one["cases"]) == len(two["cases"]) > 0
    # the clauses outside the selection are listed, and read so
    assert set(one["clauses"]) == set(registry.clauses()) and one["selected"] == ["FAIL-03", "HARNESS-02"]
    assert {one["clauses"]["BASE-01"][n] for n in ("cpu", "rpc")} == {"not selected"}
    assert results.comparable(one) == results.comparable(two)
