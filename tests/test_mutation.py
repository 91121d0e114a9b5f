"""The mutation command on a small fixed sample (the full run's score is in README.md): every
judged mutant is killed by the certification's intact runs (not only by a seeded-defect run); the
invalid and the known-equivalent ones are drawn past."""

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
def test_a_fixed_sample_of_mutants_is_killed(tmp_path):
    out = tmp_path / "mutation.json"
    run = subprocess.run(
        [
            sys.executable,
            str(REPO / "tests" / "mutation" / "run.py"),
            "--sample",
            "3",
            "--seed",
            "7",
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
    assert res["judged"] == 3 and res["complete"] and res["generated"] > 1000
    let_through = [m for m in res["mutants"] if m["outcome"] in ("survived", "weak")]
    assert not let_through, let_through


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
