"""What a failed tensor transaction left behind (the ``failure`` of a TensorCallbackError, and
Context.transaction_failure), apart from retro.transactions so that the error classes' stub can
name it without importing the transaction machinery."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TransactionFailure:
    """The contained failure of a tensor transaction (text only: no exception object is kept)."""

    kind: str  # "handler", "layout", "coverage", "non-finite", "unsubmitted"
    node: str
    type: str  # the handler's exception type, qualified
    message: str  # bounded
    traceback: str  # bounded
