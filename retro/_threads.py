"""CPU threads: how many each compute gets, and how an idle one waits.

ggml's threads meet at a barrier after every graph node. On a machine where other processes want
the cores, a thread that is descheduled stalls every other one, and a compute becomes 5-60x
slower; ``python -m retro.bench`` measures each policy with busy processes beside it. So, unless
``n_threads`` or RETRO_THREADS fixes the count, each compute gets the cores that no other runnable
task holds at that moment (native/core/thread_governor.cpp). OpenMP's own settings
(OMP_WAIT_POLICY, GOMP_SPINCOUNT) are left to the user: with the free-core count, the spin of an
idle worker changed nothing measurable.
"""

from __future__ import annotations

import os

from ._checks import integer

MAX_DEFAULT_THREADS = 16


def default_threads() -> tuple[int, bool]:
    """Threads per context when the caller names none, and whether the count follows the load."""
    if os.environ.get("RETRO_THREADS"):
        return integer("RETRO_THREADS", int(os.environ["RETRO_THREADS"]), minimum=1, maximum=512), False
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, MAX_DEFAULT_THREADS)), True
