"""BASE-01 against the library without its fix: the conformance check must fail there.

Builds retro with patch 0001 (the accumulator reset) left out, and 0015, 0030, 0033, 0039 and 0053
(seeded-defect switches, which touch the lines 0001 adds or sit beside 0015's or 0033's), and 0056
with its switches (0057), which rewrites lines of 0015's and 0039's, into a separate
folder, then runs the BASE-01 check of that build in an interpreter that sees it and not the
installed one.

The build is the one a fresh machine makes: an isolated build environment and an empty sdist
cache, so pip must fetch the pinned sources from inside it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from site_view import build_into, site_view_env

from conftest import REPO


@pytest.mark.slow
def test_base01_check_fails_against_the_unpatched_library(tmp_path):
    target = tmp_path / "unpatched"
    # a build folder kept from an earlier run has its sources already: nothing is fetched then
    fresh = not (REPO / "build" / "unpatched" / "llama.cpp").exists()
    build_into(
        target,
        REPO / "build" / "unpatched",
        "RETRO_EXCLUDE_PATCHES=0001,0015,0030,0033,0039,0053,0056,0057",
        env=dict(os.environ, RETRO_CACHE_DIR=str(tmp_path / "cache")),
    )
    assert not fresh or (tmp_path / "cache" / "llama_cpp_python-0.3.36.tar.gz").is_file()

    # -S: no .pth processing, so an editable install of retro cannot shadow the unpatched build
    env = site_view_env(target, tmp_path / "site-view")
    probe = subprocess.run(
        [sys.executable, "-S", "-c", "import json, retro; print(json.dumps(retro.build_info()))"],
        env=env,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert probe.returncode == 0, probe.stderr
    info = json.loads(probe.stdout)
    left_out = ("0001", "0015", "0030", "0033", "0039", "0053", "0056", "0057")
    assert not any(p.startswith(left_out) for p in info["patches"]), info["patches"]

    log = tmp_path / "results.jsonl"
    harness = target / "retro" / "conformance"
    run = subprocess.run(
        [
            sys.executable,
            "-S",
            "-m",
            "pytest",
            str(harness / "cases"),
            "-c",
            str(harness / "pytest.ini"),
            "--rootdir",
            str(harness),
            "--import-mode=importlib",
            "-p",
            "retro.conformance.plugin",
            "--backend=cpu",
            "--no-defects",
            "--clauses=BASE-01",
            "-k",
            "test_each_step_applies_only_its_own_period",
            f"--results-log={log}",
            "-q",
        ],
        env=env,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    records = [json.loads(line) for line in log.read_text().splitlines()]
    outcomes = {r["id"]: r["outcome"] for r in records if r["event"] == "result"}
    assert outcomes and set(outcomes.values()) == {"fail"}, run.stdout[-3000:]
    assert all(
        "SGD steps in one call vs one fresh optimizer per step" in r["message"]
        for r in records
        if r["event"] == "result"
    )
