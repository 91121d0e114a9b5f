"""The public API type-checks strictly (py.typed promises it), the harness without errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO

# the public API strictly (pyproject.toml); the harness's folders, which install as retro.conformance
# and retro.fault_injection (names mypy cannot map back to the folders), without following those imports
HARNESS = [
    "--disable-error-code=import-untyped",
    "--allow-untyped-defs",
    "--allow-incomplete-defs",
    "--allow-any-generics",
    "--allow-untyped-calls",
    "--no-warn-return-any",
    "conformance",
    "fault_injection",
]


@pytest.mark.parametrize("args", [["-p", "retro"], HARNESS], ids=["retro", "harness"])
def test_mypy(args):
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir=/dev/null", *args], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_error_stub_is_generated_from_the_native_table():
    from retro import _stubgen

    assert _stubgen.STUB.read_text(encoding="utf-8") == _stubgen.errors_stub(), (
        "retro/errors.pyi is stale: run python -m retro._stubgen"
    )


def test_the_native_stub_matches_the_compiled_module():
    """mypy's stubtest holds retro/_native.pyi against the compiled module (pybind11's own
    artifacts are listed, with the reason, in tests/stubtest-allowlist.txt)."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy.stubtest",
            "retro._native",
            "--mypy-config-file",
            str(REPO / "pyproject.toml"),
            "--allowlist",
            str(REPO / "tests" / "stubtest-allowlist.txt"),
        ],
        cwd=REPO / "tests",
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
