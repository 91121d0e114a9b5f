"""Helpers for tests of retro and of code built on it: tiny deterministic models, upstream's own
training loop as an oracle, a numpy reference of the tiny model's training math
(``retro.testing.reference``, imported on its own: it needs the conformance extra's autograd), and
probes of native state."""

from .load import busy_processes
from .models import TinyLlamaSpec, write_tiny_llama
from .oracle import upstream_epoch
from .probes import (
    LiveAllocations,
    PackedBatch,
    TargetArrays,
    last_step_forward_nodes,
    last_step_tokens,
    live_allocations,
    micro_batch,
    packed_batch,
    runnable_elsewhere,
    scheduler_data_phase_entries,
    staged_targets,
    target_arrays,
    topology_walk,
)

__all__ = [
    "LiveAllocations",
    "PackedBatch",
    "TargetArrays",
    "TinyLlamaSpec",
    "busy_processes",
    "last_step_forward_nodes",
    "last_step_tokens",
    "live_allocations",
    "micro_batch",
    "packed_batch",
    "runnable_elsewhere",
    "scheduler_data_phase_entries",
    "staged_targets",
    "target_arrays",
    "topology_walk",
    "upstream_epoch",
    "write_tiny_llama",
]
