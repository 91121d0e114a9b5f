"""Interfaces whose safety rests on the caller, kept apart and named so.

:class:`TensorCapture` is the older capture callback: it copies a selected node's rows straight
into an array the caller owns, through a raw address, without keeping that array alive. If the
array is freed or resized while the context can still decode, the next decode writes into freed
memory. Use :class:`retro.transactions.TensorTransactions` with ``retain=True`` instead."""

from __future__ import annotations

import numpy as np

from . import _checks
from ._selector import Selector

__all__ = ["TensorCapture"]


class TensorCapture:
    """Rows of one node, written into caller memory that this object borrows (see the module).

    Only :meth:`unsafe_borrow` makes one."""

    selector: Selector
    address: int
    capacity: int

    def __init__(self, *args: object, **kwargs: object) -> None:
        if not _checks.seeded("TX-PROF-03"):  # seeded defect: the borrowing constructor is public
            raise TypeError(
                "TensorCapture borrows memory it does not keep alive: make one with "
                "TensorCapture.unsafe_borrow(selector, out), or use TensorTransactions (retain=True)"
            )
        self._borrow(*args)  # type: ignore[arg-type]

    @classmethod
    def unsafe_borrow(cls, selector: Selector, out: np.ndarray) -> TensorCapture:
        """Unsafe: the node's rows of each micro-batch are copied into `out` (float32 or int32,
        C-contiguous, writable), as many bytes as fit. The caller must keep `out` alive and
        unresized for as long as the context that takes this capture exists."""
        capture = cls.__new__(cls)
        capture._borrow(selector, out)
        return capture

    def _borrow(self, selector: Selector, out: np.ndarray) -> None:
        if not isinstance(selector, Selector):
            raise TypeError("selector must come from Profile.select()")
        if selector.access != "read-only" or selector.retain:
            raise ValueError("a borrowed capture's selector is read-only and not retained")
        if not isinstance(out, np.ndarray) or out.dtype != np.dtype(
            np.float32 if selector.dtype == "f32" else np.int32
        ):
            raise TypeError(f"out must be a numpy array of the node's type ({selector.dtype})")
        # seeded defect: contiguity checked, writability not (the native copy writes into it)
        if not out.flags.c_contiguous or not (out.flags.writeable or _checks.seeded("TX-PROF-03.read-only")):
            raise ValueError("out must be C-contiguous and writable")
        self.selector = selector
        self.address = int(out.ctypes.data)
        self.capacity = int(out.nbytes)
