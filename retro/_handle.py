"""What every object backed by a native handle shares: close, closed, use as a context manager,
and being closed at interpreter exit."""

from __future__ import annotations

import atexit
import contextlib
import time
import weakref
from typing import Any, Self

#: every open model, context and trainer. At interpreter exit they are closed (trainers, then
#: contexts, then models) while the interpreter is still whole: a call in progress on another
#: thread (a daemon thread inside a decode or an epoch) is waited for and returns normally. Left to
#: finalization instead, such a thread asking for the GIL is ended by CPython (pthread_exit), and
#: the unwinding aborts the process where it meets a C++ destructor that takes the GIL back.
_open: weakref.WeakSet[NativeHandle] = weakref.WeakSet()


class NativeHandle:
    _h: Any
    #: the order objects are closed in at exit, lowest first: a trainer before its context, a
    #: context before its model
    _exit_order = 0

    def _opened(self) -> None:
        """Called once the native object exists: it is closed at exit if the caller has not."""
        _open.add(self)

    @property
    def closed(self) -> bool:
        return bool(self._h.closed)

    def close(self) -> None:
        """Free the native object now (it is also freed when garbage-collected)."""
        self._h.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: how long exit waits for native calls of other threads to return once everything is closed
EXIT_WAIT_S = 30.0


@atexit.register
def _close_all_at_exit() -> None:
    from . import _native
    from ._checks import seeded
    from .errors import RetroError

    for handle in sorted(list(_open), key=lambda h: h._exit_order):
        with contextlib.suppress(RetroError):
            handle.close()
    # from here no call releases the GIL: one that starts now (on a closed object) fails holding it
    _native.set_exiting()
    # a call that was waiting for a close returns now, with the GIL still to be had: it is
    # given the GIL (sleeping releases it) until it has taken it back and left native code
    deadline = time.monotonic() + EXIT_WAIT_S
    without_end = seeded("TX-OWN-03.exit-wait")  # seeded defect: the wait has no deadline
    while _native.calls_in_flight() > 0 and (without_end or time.monotonic() < deadline):
        time.sleep(0.001)
