"""The exceptions of retro, created from the native layer's one table of error kinds
(native/core/error_kinds.def); retro/errors.pyi, their types, is generated from the same table
(``python -m retro._stubgen``) and checked by a test. Native failures arrive as one of these
classes with the backend's diagnostic lines in the message; invalid arguments raise ValueError,
TypeError or OverflowError before anything native changes."""

from __future__ import annotations

from . import _native
from ._failure import TransactionFailure

__all__: list[str] = []


def _failure(self: BaseException) -> TransactionFailure:
    """The failed transaction, from the fields the native layer attached to the error."""
    return TransactionFailure(*self._failure_fields)  # type: ignore[attr-defined]


def _define() -> None:
    defined: dict[str, type[BaseException]] = {"Exception": Exception}
    for name, base, doc in _native.error_kinds():
        namespace: dict[str, object] = {"__doc__": doc, "__module__": __name__}
        if name == "TensorCallbackError":
            namespace["failure"] = property(_failure)
        cls = type(name, (defined[base],), namespace)
        defined[name] = globals()[name] = cls
        __all__.append(name)
    _native._set_error_classes({name: defined[name] for name in __all__})


_define()
