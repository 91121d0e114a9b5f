"""Load beside a check: processes that keep cores busy, as other work on a shared machine does."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

from .. import _child

#: a spinner ends on its own if whoever started it dies without killing it
_SPIN = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end: pass\n"


@contextmanager
def busy_processes(n: int | None = None, *, seconds: float = 120.0) -> Iterator[None]:
    """n spinning processes (one per usable core by default), runnable while the block runs."""
    count = len(os.sched_getaffinity(0)) if n is None else n
    spinners = [subprocess.Popen(_child.python("-c", _SPIN.format(s=seconds))) for _ in range(count)]
    try:
        time.sleep(0.3)  # started and runnable: /proc/loadavg counts them
        yield
    finally:
        for s in spinners:
            s.kill()
            s.wait()
