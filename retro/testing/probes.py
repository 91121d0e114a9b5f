"""Probes of native state that the binding's own calls tidy away before a caller can look."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .. import _checks, _native
from .._native_logs import forwarding
from ..context import Context
from ..training import Trainer


class TargetArrays(NamedTuple):
    """The host arrays a context's training steps fill with their targets, as llama.cpp holds them."""

    address: int  # of the flat indices (0 before the first training step)
    capacity: int  # in elements: the indices, the weights and the fused head's best ids together


def target_arrays(context: Context) -> TargetArrays:
    """The host arrays of a context's training steps' targets, on either head: k flat indices and k
    weights per token, and on the fused head one best id per token; the dense head's
    [vocab x tokens] label rows are made on the device from them. They are kept across steps, so
    steps of equal or smaller geometry never reallocate them."""
    if not isinstance(context, Context):
        raise TypeError("context must be a retro.Context")
    address, capacity = context._h.target_arrays
    return TargetArrays(int(address), int(capacity))


class PackedBatch(NamedTuple):
    """The packed batch of a context's last training step as llama.cpp holds it."""

    address: int  # of its positions array (0 before the first step)
    positions: np.ndarray  # int32, one per token
    sequences: np.ndarray  # int32, one per token


def packed_batch(context: Context) -> PackedBatch:
    """The batch llama.cpp computed the last training step on: each token's position and sequence
    id, and where the positions live. It keeps one token/membership geometry across steps and is
    replaced when the token count or the membership changes."""
    if not isinstance(context, Context):
        raise TypeError("context must be a retro.Context")
    address, positions, sequences = context._h.packed_batch
    return PackedBatch(int(address), np.asarray(positions), np.asarray(sequences))


class LiveAllocations(NamedTuple):
    """What ggml holds in the whole process, counted where the fork makes and frees it."""

    contexts: int  # ggml contexts (graph and tensor metadata)
    buffers: int  # backend buffers, of every backend (weights, optimizer state, compute)


def live_allocations() -> LiveAllocations:
    """The ggml contexts and backend buffers alive now (patch 0029): equal counts before and after
    an operation that should hold nothing new show that it leaked nothing."""
    contexts, buffers = _native.live_allocations()
    return LiveAllocations(int(contexts), int(buffers))


def scheduler_data_phase_entries() -> int:
    """The times any ggml scheduler in the process entered its eval callback's data phase, counted
    by the fork where the scheduler makes the call (patch 0054). Each entry follows an ask-phase
    answer of true and a synchronization of the backend: read around a decode, it shows which
    nodes the tensor transactions asked for, which their own handler cannot show once it is no
    longer called."""
    return int(_native.scheduler_data_phase_entries())


def runnable_elsewhere() -> int:
    """The runnable tasks on the machine that are not threads of this process, as the CPU thread
    governor reads them before each compute of a load-following context (one thread given up for
    each); -1 where the system does not say."""
    return int(_native.runnable_elsewhere())


def last_step_tokens(context: Context) -> int:
    """Tokens the last training step's graph computed, as llama.cpp split its micro-batch (padding
    included): what throughput counts as physical tokens."""
    if not isinstance(context, Context):
        raise TypeError("context must be a retro.Context")
    return int(context._h.last_step_tokens)


def last_step_forward_nodes(context: Context) -> int:
    """Nodes of the forward graph the last training step built, read from the fork's step timer
    (0: the step built no graph, the packed-topology cache ran its entry's)."""
    if not isinstance(context, Context):
        raise TypeError("context must be a retro.Context")
    return int(context._h.last_step_forward_nodes)


def topology_walk(trainer: Trainer) -> tuple[int, int]:
    """The walk of the packed-topology cache entry's graphs, by the fork: sources that are not the
    graphs' own tensors (a scheduler copy that entered them) and tensors left at a stale compute
    address; (-1, -1) without an entry."""
    if not isinstance(trainer, Trainer):
        raise TypeError("trainer must be a retro.Trainer")
    foreign, stale = trainer._h.topology_walk
    return int(foreign), int(stale)


def staged_targets(trainer: Trainer) -> tuple[int, int]:
    """Where the trainer stages a packed step's target ids (their address, 0 before the first
    packed step) and the staging's capacity in elements, ids and weights together: kept across
    steps and calls, so steps of equal or smaller geometry never reallocate it."""
    if not isinstance(trainer, Trainer):
        raise TypeError("trainer must be a retro.Trainer")
    address, capacity = trainer._h.staged_targets
    return int(address), int(capacity)


@forwarding
def micro_batch(trainer: Trainer, tokens: np.ndarray, labels: np.ndarray, *, pos0: int = 0, train: bool = True) -> None:
    """One training (or evaluation) micro-batch of the fork's step at positions pos0.., with
    nothing of :meth:`retro.Trainer.epoch` around it: the KV cache and the accumulation period keep
    exactly what the step (or its failure) left. Raises the step's typed error."""
    if not isinstance(trainer, Trainer):
        raise TypeError("trainer must be a retro.Trainer")
    n_vocab = trainer.context.model.n_vocab
    tok = _checks.token_array("tokens", tokens, n_vocab, ndim=1)
    lab = _checks.token_array("labels", labels, n_vocab, ndim=1)
    n_ubatch = trainer.context.training_ubatch
    pos0 = _checks.integer("pos0", pos0)
    if tok.size != lab.size or tok.size > n_ubatch or pos0 + tok.size > trainer.context.n_ctx:
        raise ValueError(f"tokens and labels must be of one length, at most n_ubatch ({n_ubatch}), within n_ctx")
    trainer._h.micro_batch(tok, lab, pos0, bool(train))
