"""What every object backed by a native handle shares: close, closed, use as a context manager."""

from __future__ import annotations

from typing import Any, Self


class NativeHandle:
    _h: Any

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
