"""The public API type-checks strictly (py.typed promises it), the harness without errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO


@pytest.mark.parametrize("args", [["--strict", "retro"], ["conformance", "fault_injection"]])
def test_mypy(args):
    done = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir=/dev/null", *args], cwd=REPO,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
