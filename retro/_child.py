"""The command line of a child interpreter, spelled once. Every child that retro or its harness
starts (an RPC server, a certification's pytest, a check's probe, a benchmark's workload) must
import the retro this interpreter imports."""

from __future__ import annotations

import sys


def python(*args: str) -> list[str]:
    """This interpreter with ``args``: -P keeps the working directory and a script's folder off
    sys.path (never a source tree that happens to be there), and -S is passed on where this
    interpreter runs without site (a build picked by PYTHONPATH, a separate site view)."""
    return [sys.executable, "-P", *(["-S"] if sys.flags.no_site else []), *args]
