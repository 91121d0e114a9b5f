"""A selector: one node of a recorded profile to read or edit (retro.transactions.Profile.select).

Kept apart from retro.transactions so that retro.unsafe, whose borrowed captures take a selector,
and retro.transactions, which takes those captures, import it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from .transactions import Profile

Access = Literal["read-only", "mutable-f32"]
DType = Literal["f32", "i32"]
RowKind = Literal["tokens", "outputs"]

# the native layer's codes of each
_DTYPES = {"f32": 0, "i32": 1}
_ACCESS = {"read-only": 0, "mutable-f32": 1}
_ROWS = {"tokens": 0, "outputs": 1}

_SELECTOR_TOKEN = object()


@dataclass(frozen=True)
class Selector:
    """One node to read or edit, bound to the profile it was made from (:meth:`Profile.select`)."""

    name: str
    dtype: DType
    row_elements: int
    max_rows: int  # inclusive
    access: Access
    retain: bool
    rows: RowKind
    profile: Profile = field(repr=False, compare=False)
    _token: object = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self._token is not _SELECTOR_TOKEN:
            raise TypeError("make selectors with Profile.select(): a selector is bound to a validated profile")

    def _spec(self, borrowed: int = 0, capacity: int = 0) -> tuple[object, ...]:
        return (
            self.name,
            _DTYPES[self.dtype],
            self.row_elements,
            self.max_rows,
            _ACCESS[self.access],
            self.retain,
            _ROWS[self.rows],
            borrowed,
            capacity,
        )
