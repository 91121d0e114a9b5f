"""Preflight: the memory a training epoch will allocate, per buffer type, measured by the fork on
the graphs its micro-batches build (nothing allocated, nothing computed), and the budget policy
that refuses an epoch before it allocates more than the caller allows."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from . import _checks
from .errors import MemoryBudgetError

# the fork's purposes (enum llama_opt_buffer_purpose), in its order
PURPOSES = ("optimizer state", "compute", "output", "targets")


class BufferNeed(NamedTuple):
    """What training needs in one buffer type for one purpose. ``buffer_type`` is ggml's name
    (``"CPU"``, ``"Vulkan0"``, ``"Vulkan_Host"``, ``"RPC0[host:port]"``; ``"host"`` for heap
    memory); ``purpose`` one of :data:`PURPOSES`: the optimizer's state (gradient accumulators,
    moments: made once, kept), the compute buffer of the training graphs (the scheduler's, shared
    with decoding), the context's output buffer (every token's logits), the host arrays of the
    targets. A buffer grows to what a step needs and is kept: the step allocates ``needed -
    held`` when that is positive."""

    buffer_type: str
    purpose: str
    needed: int
    held: int

    @property
    def to_allocate(self) -> int:
        return max(self.needed - self.held, 0)


class Preflight(NamedTuple):
    """The memory an epoch call would allocate (:meth:`retro.Trainer.preflight`)."""

    buffers: tuple[BufferNeed, ...]

    def to_allocate(self, buffer_type: str | None = None) -> int:
        """Bytes the epoch would allocate, in one buffer type or (None) in all of them."""
        return sum(b.to_allocate for b in self.buffers if buffer_type in (None, b.buffer_type))

    def by_buffer_type(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for b in self.buffers:
            out[b.buffer_type] = out.get(b.buffer_type, 0) + b.to_allocate
        return out

    def __str__(self) -> str:
        rows = [f"{'buffer type':<24} {'purpose':<16} {'needed MiB':>11} {'held MiB':>9} {'new MiB':>8}"]
        for b in self.buffers:
            rows.append(
                f"{b.buffer_type:<24} {b.purpose:<16} {b.needed / 2**20:>11.2f} {b.held / 2**20:>9.2f} "
                f"{b.to_allocate / 2**20:>8.2f}"
            )
        rows.append(f"{'total to allocate':<41} {self.to_allocate() / 2**20:>30.2f}")
        return "\n".join(rows)

    @classmethod
    def _from_native(cls, needs: list[tuple[str, int, int, int]]) -> Preflight:
        return cls(tuple(BufferNeed(t, PURPOSES[p], needed, held) for t, p, needed, held in needs))


Budget = int | Mapping[str, int]


def check_budget(budget: object) -> Budget | None:
    """A budget as the caller gave it, validated: bytes in all, or bytes per buffer type."""
    if budget is None:
        return None
    if isinstance(budget, Mapping):
        out: dict[str, int] = {}
        for name, limit in budget.items():
            if not isinstance(name, str):
                raise TypeError("a budget's keys are buffer type names (str)")
            out[name] = _checks.integer(f"budget[{name!r}]", limit, minimum=0, maximum=_checks.INT64_MAX)
        return out
    return _checks.integer("budget", budget, minimum=0, maximum=_checks.INT64_MAX)


def enforce(preflight: Preflight, budget: Budget | None) -> None:
    """Raise :class:`retro.MemoryBudgetError` where the epoch would allocate more than the budget."""
    if budget is None:
        return
    limits = {None: budget} if isinstance(budget, int) else dict(budget)
    over = [
        f"{'in all' if name is None else name}: {preflight.to_allocate(name)} bytes to allocate, budget {limit}"
        for name, limit in limits.items()
        if preflight.to_allocate(name) > limit
    ]
    if over:
        err = MemoryBudgetError("training would allocate more than its budget (" + "; ".join(over) + ")")
        err.preflight = preflight  # type: ignore[attr-defined]
        raise err
