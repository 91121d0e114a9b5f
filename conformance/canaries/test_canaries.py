"""Canaries: cases that end with one known result code each, whatever the build. The harness's
own checks (cases/test_harness.py, HARNESS-05/06/07) certify this folder in a run of its own and
hold that run's records and outputs to what each canary does. They are never part of a
certification of the contracts: they prove the harness, not the binding."""

from __future__ import annotations

import os
import time

import pytest

from retro._checks import seeded
from retro.conformance.evidence import expect
from retro.conformance.plugin import not_supported

# the two that kill their interpreter come first: every canary after them must still run


@pytest.mark.clause("HARNESS-05")
def test_kills_its_interpreter(backend):
    if seeded("HARNESS-05"):
        return  # its defect run asserts nothing: "survived"
    os.abort()


@pytest.mark.clause("HARNESS-05")
def test_hangs(backend):
    if seeded("HARNESS-05"):
        return
    time.sleep(3600)


@pytest.mark.clause("HARNESS-05")
def test_runs_after_them(backend):
    expect("HARNESS-05", not seeded("HARNESS-05"), "the canary's defect is on")


@pytest.mark.clause("HARNESS-06")
def test_passes(backend):
    expect("HARNESS-06", not seeded("HARNESS-06"), "the canary's defect is on")


@pytest.mark.clause("HARNESS-06")
def test_fails(backend):
    expect("HARNESS-06", False, "a canary that always fails")


@pytest.mark.clause("HARNESS-06")
def test_fails_as_expected(backend):
    expect("HARNESS-06", False, "a canary that fails, listed in expectations/cpu.toml")


@pytest.mark.clause("HARNESS-06")
def test_is_not_supported(backend):
    not_supported("a canary of the 'not supported' result code")


@pytest.mark.clause("HARNESS-07")
def test_is_blind_to_its_defect(backend):
    expect("HARNESS-07", True, "never fails: its clause's defect escapes")


@pytest.mark.clause("HARNESS-07")
def test_errs_under_its_defect(backend):
    # an error is not an assertion bound to the clause: its defect escapes
    if seeded("HARNESS-07"):
        raise RuntimeError("the canary's defect is on")
    expect("HARNESS-07", True, "never fails")


@pytest.mark.clause("HARNESS-03")
def test_catches_its_defect(backend):
    expect("HARNESS-03", not seeded("HARNESS-03"), "the canary's defect is on")


@pytest.mark.clause("HARNESS-03", "HARNESS-06")
def test_catches_only_another_clauses_defect(backend):
    expect("HARNESS-03", True, "never fails: this check cannot fail for HARNESS-03")
    # under HARNESS-03's defect only another clause's assertion fails: tolerated there, and no
    # catch of HARNESS-03's defect
    expect("HARNESS-06", not seeded("HARNESS-06") and not seeded("HARNESS-03"), "a canary's defect is on")
