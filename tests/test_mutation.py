"""The mutation command on a small fixed sample (the full run's score is in README.md): every
sampled mutant that compiles is killed by the certification, or listed as equivalent with a reason."""

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
    assert res["sampled"] == 3 and res["generated"] > 100
    survivors = [m for m in res["mutants"] if m["outcome"] == "survived"]
    assert not survivors, survivors
