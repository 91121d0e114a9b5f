"""The mutation command on the mutants CI pins (tests/mutation/pinned.toml; the score of a drawn
sample is in docs/evidence.md): each is put in place in its room and killed by the certification's intact
runs, not only by a seeded-defect run."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mutate") is None, reason="universalmutator is not installed")
def test_the_pinned_mutants_are_killed(tmp_path):
    out = tmp_path / "mutation.json"
    run = subprocess.run(
        [
            sys.executable,
            str(REPO / "tests" / "mutation" / "run.py"),
            "--pinned",
            str(REPO / "tests" / "mutation" / "pinned.toml"),
            # the full certification test proves the seeded defects on these same sources
            "--no-defect-proof",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=2400,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["judged"] == 3 and res["complete"]
    assert {m["file"].split("/")[0] for m in res["mutants"]} == {"retro", "native", "llama.cpp"}
    not_killed = [m for m in res["mutants"] if m["outcome"] != "killed"]
    assert not not_killed, not_killed


def _runner():
    spec = importlib.util.spec_from_file_location("mutation_run", REPO / "tests" / "mutation" / "run.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_a_mutant_drawn_at_an_earlier_commit_lands_on_its_line_today(tmp_path, monkeypatch):
    """Resuming a draw after the sources moved: a mutant goes onto today's file where the lines
    around its own are unchanged (lines added above it move it down), and reads stale where its
    line itself changed."""
    run = _runner()
    then, today = tmp_path / "then", tmp_path / "today"
    old = ["int f(int a) {\n", "    if (a < 0) {\n", "        return -1;\n", "    }\n", "    return a;\n", "}\n"]
    new = [
        "// added\n",
        "int f(int a) {\n",
        "    if (a < 0) {\n",
        "        return -1;\n",
        "    }\n",
        "    return a + 0;\n",
        "}\n",
    ]
    for root, lines in ((then, old), (today, new)):
        (root / "native").mkdir(parents=True)
        (root / "native" / "f.cpp").write_text("".join(lines))
    monkeypatch.setattr(run, "SOURCE", today)

    def mutant(line: int, mutated: str) -> object:
        text = old.copy()
        text[line - 1] = mutated
        path = tmp_path / f"m{line}.cpp"
        path.write_text("".join(text))
        return run.Mutant("native/f.cpp", line, old[line - 1].strip(), mutated.strip(), str(path))

    moved = mutant(2, "    if (a <= 0) {\n")
    assert run.port(moved, then, tmp_path)
    assert Path(moved.path).read_text().splitlines(keepends=True) == [*new[:2], "    if (a <= 0) {\n", *new[3:]]
    assert moved.line == 2  # the line in the draw's sources
    assert not run.port(mutant(5, "    return -a;\n"), then, tmp_path)


def test_a_pinned_mutant_lands_on_the_line_that_reads_as_its_original(tmp_path, monkeypatch):
    """Found by its text, indentation kept, the nearest of equal lines to the line it names; a
    pinned line that no longer exists stops the run."""
    run = _runner()
    (tmp_path / "native").mkdir()
    (tmp_path / "native" / "f.cpp").write_text("int x = 1;\n// moved\n  int x = 1;\n  return x;\n")
    monkeypatch.setattr(run, "SOURCE", tmp_path)
    spec = tmp_path / "pinned.toml"
    spec.write_text('[[mutant]]\nfile = "native/f.cpp"\nline = 4\noriginal = "int x = 1;"\nmutated = "int x = 2;"\n')
    (m,) = run.pinned(spec, tmp_path / "work")
    assert m.line == 3
    assert Path(m.path).read_text() == "int x = 1;\n// moved\n  int x = 2;\n  return x;\n"
    spec.write_text('[[mutant]]\nfile = "native/f.cpp"\nline = 2\noriginal = "int y = 1;"\nmutated = "int y = 2;"\n')
    with pytest.raises(SystemExit, match="no line"):
        run.pinned(spec, tmp_path / "work")


def test_equivalence_rules_tell_an_annotation_and_a_line_by_the_one_above(tmp_path):
    """An annotation-only change is equivalent only where annotations are never evaluated; an entry
    with `preceded_by` holds for its own line, not for an equal line elsewhere; one with `originals`
    for each line it lists."""
    run = _runner()
    known = run.equivalents()

    def mutant(lines: list[str], line: int, mutated: str, rel: str) -> object:
        text = lines.copy()
        text[line - 1] = text[line - 1][: len(text[line - 1]) - len(text[line - 1].lstrip())] + mutated + "\n"
        path = tmp_path / f"{len(list(tmp_path.iterdir()))}.txt"
        path.write_text("".join(text))
        return run.Mutant(rel, line, lines[line - 1].strip(), mutated, str(path))

    module = ["from __future__ import annotations\n", "def f(x: int) -> list[int]:\n", "    return [x]\n"]
    assert run.known_equivalent(mutant(module, 2, "def f(x: int) -> list:", "retro/m.py"), known)
    assert not run.known_equivalent(mutant(module, 3, "return [x, x]", "retro/m.py"), known)
    assert not run.known_equivalent(mutant(module[1:], 1, "def f(x: int) -> list:", "retro/m.py"), known)

    fork = "llama.cpp/ggml/src/ggml-opt.cpp"
    body = ["    if (opt_ctx->backend_failed) {\n", "        return false;\n", "    }\n"]
    in_eval = ["    GGML_ASSERT(opt_ctx->eval_ready);\n", *body]
    in_alloc = ["    GGML_ASSERT(!opt_ctx->eval_ready);\n", *body]
    assert run.known_equivalent(mutant(in_eval, 2, "if (0==1) {", fork), known)
    assert not run.known_equivalent(mutant(in_alloc, 2, "if (0==1) {", fork), known)

    # an entry naming a block by its lines holds for each of them, and for no other line
    snapshot = ["    void restore() const {\n", "        for (const auto & [t, bytes] : saved_) {\n", "    }\n"]
    assert run.known_equivalent(
        mutant(snapshot, 2, "for (const auto & [t, bytes] : {}) {", "native/core/epoch.cpp"), known
    )
    assert not run.known_equivalent(mutant(snapshot, 3, "}}", "native/core/epoch.cpp"), known)


def test_every_native_switch_form_in_the_sources_opens_a_branch_no_mutant_is_drawn_from():
    """The runner knows a seeded-defect switch by one form: a call on a RETRO_DEFECT_ constant. Each
    way the sources read a switch (the fork's retro_defect_on, the core's snapshot members) is
    recognised, alone or &&-joined; a negated switch opens the intact path and is drawn from."""
    import re

    run = _runner()
    sources = [
        *(REPO / "native").rglob("*.cpp"),
        *(REPO / "native").rglob("*.h"),
        *(REPO / "vendor" / "patches").glob("*"),
    ]
    forms = {m for f in sources for m in re.findall(r"([\w.>-]+)\(RETRO_DEFECT_\w+\)", f.read_text())}
    assert {"retro_defect_on", "defect_"} <= forms
    for form in forms:
        for cond in (f"{form}(RETRO_DEFECT_X)", f"{form}(RETRO_DEFECT_X) && n > 0", f"n > 0 && {form}(RETRO_DEFECT_X)"):
            assert run.defect_bodies([f"    if ({cond}) {{\n", "        n = 0;\n", "    }\n"]) == {2}, cond
        assert run.defect_bodies([f"    if (!{form}(RETRO_DEFECT_X)) {{\n", "        n = 0;\n", "    }\n"]) == set()
        assert run.SKIP.search(f"    const bool on = {form}(RETRO_DEFECT_X);")


def test_a_function_no_clause_governs_is_not_drawn_from():
    """A Python function named as uncontracted is left out whole, its decorators included; its
    neighbours and the module's other functions of other names are drawn from."""
    run = _runner()
    source = "import x\n\n\n@x.deco\ndef _sampling(t):\n    if t < 0:\n        raise ValueError(t)\n    return t\n\n\ndef g(t):\n    return t + 1\n"
    assert run.python_not_mutated(source, ("_sampling",)) == {4, 5, 6, 7, 8}
    assert run.python_not_mutated(source) == set()
    drawn = {rel for rel in run.PYTHON}
    assert "retro/scoring.py" not in drawn and "retro/context.py" in drawn


def test_a_certification_that_loses_a_pass_kills_the_mutant(tmp_path, monkeypatch):
    """A mutant whose intact runs fail nothing but read a clause otherwise than the unmutated
    build's intact runs do (its backend gone: "not available") is killed when the rerun repeats it; a
    difference the rerun does not repeat is chance, and a run that reads as the baseline survives."""
    run = _runner()
    # an intact run (no seeded defects) reads "not covered" where a whole certification reads pass
    whole = {f"{c} on {b}": "not covered" for c in ("BASE-01", "FAIL-07") for b in ("cpu", "rpc")}
    gone = {**whole, "BASE-01 on rpc": "not available", "FAIL-07 on rpc": "not available"}
    runs: list[dict[str, str]] = []

    def certify(site, out, timeout, *, defects, clauses=run.COVERED, keyword=None):
        verdicts = runs.pop(0)
        wanted = clauses.split(",")
        return run.Certification(0, [], {k: v for k, v in verdicts.items() if k.split(" on ")[0] in wanted})

    monkeypatch.setattr(run, "certify", certify)
    judge = run.Judge(tmp_path, tmp_path, 60.0)
    runs.append(whole)
    judge.intact_baseline()
    m = run.Mutant("native/core/remote.cpp", 34, "a", "b", str(tmp_path / "m"))
    runs.extend([gone, gone])
    assert judge._killed(m) and m.outcome == "killed"
    assert "BASE-01, FAIL-07" in m.detail and "BASE-01 on rpc" in m.detail
    runs.extend([gone, whole, gone, whole])  # twice a difference the rerun does not repeat
    assert judge._killed(m) and m.detail.startswith("failed intermittently")
    runs.append(whole)
    assert not judge._killed(m)
    assert not runs
