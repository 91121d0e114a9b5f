"""The mutation command on a small fixed sample (the full run's score is in README.md): every
judged mutant is killed by the certification's intact runs (not only by a seeded-defect run); the
invalid and the known-equivalent ones are drawn past."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

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
