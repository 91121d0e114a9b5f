"""Training through the native loop (native/retro_training.cpp)."""

from __future__ import annotations

import _ctypes
import ctypes
import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import NamedTuple

import numpy as np

from . import _checks, _native, topology
from ._handle import NativeHandle
from ._native_logs import forwarding
from .checkpoint import Checkpoint
from .context import Context
from .datasets import Dataset, _Windows
from .errors import InvalidStateError, PoisonedTrainerError
from .preflight import Budget, Preflight, check_budget, enforce


@dataclass(frozen=True)
class AdamW:
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0

    def _settings(self) -> _native.OptimizerSettings:
        s = _native.OptimizerSettings()
        s.type = _native.OptimizerType.ADAMW
        s.lr = _checks.real("lr", self.lr, low=0.0, high=math.inf, low_open=True)
        s.beta1 = _checks.real("beta1", self.beta1, low=0.0, high=1.0)
        s.beta2 = _checks.real("beta2", self.beta2, low=0.0, high=1.0)
        s.eps = _checks.real("eps", self.eps, low=0.0, high=math.inf)
        s.wd = _checks.real("weight_decay", self.weight_decay, low=0.0, high=1.0)
        return s


@dataclass(frozen=True)
class SGD:
    lr: float = 1e-3
    weight_decay: float = 0.0

    def _settings(self) -> _native.OptimizerSettings:
        s = _native.OptimizerSettings()
        s.type = _native.OptimizerType.SGD
        s.lr = _checks.real("lr", self.lr, low=0.0, high=math.inf, low_open=True)
        s.wd = _checks.real("weight_decay", self.weight_decay, low=0.0, high=1.0)
        return s


class Progress(NamedTuple):
    train: bool  # False during the evaluation tail
    done: int  # micro-batches of this phase completed, the current one included
    total: int  # micro-batches of this phase


ProgressCallback = Callable[[Progress], "bool | None"]
#: schedule(step, horizon) -> the learning rate of optimizer step `step` (0-based) of `horizon`
Schedule = Callable[[int, int], float]

#: ctypes type of a C-level epoch callback with upstream ggml's signature (ggml_opt_epoch_callback):
#: (train, opt_ctx, dataset, result, ibatch, ibatch_max, t_start_us) -> void. It is called after
#: every micro-batch, before the progress callback; it cannot cancel (the signature is void).
EpochCallback = ctypes.CFUNCTYPE(
    None,
    ctypes.c_bool,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_int64,
    ctypes.c_int64,
    ctypes.c_int64,
)
_BOOL_EPOCH_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_bool, *EpochCallback._argtypes_)  # CANCEL-01.signature's


class MicroBatchGradientWarning(UserWarning):
    """A trainer is training windows in micro-batches shorter than the window (``n_ubatch`` < the
    window's width). That is llama.cpp's training in micro-batches, the same on every backend:
    each micro-batch reads the keys and values of the window's earlier micro-batches from the KV
    cache as constants, so its gradient is not the whole window's, and the K and V projections
    (``attn_k``, ``attn_v``) get none. Said once per trainer; filter it as any warning
    (``warnings.filterwarnings("ignore", category=retro.MicroBatchGradientWarning)``).
    ``EpochMetrics.split_windows`` says it of each epoch."""


@dataclass(frozen=True)
class EpochMetrics:
    """What one epoch call executed. Losses are per token; eval values are None without an
    evaluation tail (none requested, or skipped by cancellation). ``split_windows``: the windows
    were trained in micro-batches shorter than themselves (:class:`MicroBatchGradientWarning`)."""

    train_loss: float
    train_loss_unc: float
    train_accuracy: float
    eval_loss: float | None
    eval_loss_unc: float | None
    eval_accuracy: float | None
    train_micro_batches: int
    eval_micro_batches: int
    optimizer_steps: int
    logical_tokens: int  # tokens with a real label
    physical_tokens: int  # tokens sent to compute, padding included
    epoch_complete: bool
    elapsed_s: float
    throttle_s: float  # slept by the duty-cycle limiter
    # where the micro-batches spent their time, summed: dynamic graphs are rebuilt (forward
    # build, backward expansion and allocation) before every compute, unless the packed-topology
    # cache runs its entry's graphs again
    staging_s: float  # batch, memory, inputs and labels
    graph_build_s: float
    backward_alloc_s: float
    backward_build_s: float  # of backward_alloc_s: the backward and optimizer graphs built
    alloc_s: float  # of backward_alloc_s: the step's graph allocated
    compute_s: float
    split_windows: bool = False  # of the call, not of the native loop: each window in several micro-batches

    @property
    def micro_batches(self) -> int:
        return self.train_micro_batches + self.eval_micro_batches

    @classmethod
    def _from_native(cls, m: _native.EpochMetrics, split_windows: bool) -> EpochMetrics:
        # the fields are native/core/epoch_metrics.def's, by name; eval values exist only with an eval tail
        values = {f.name: getattr(m, f.name) for f in fields(cls) if f.name != "split_windows"}
        if not m.has_eval:
            values.update(eval_loss=None, eval_loss_unc=None, eval_accuracy=None)
        return cls(**values, split_windows=split_windows)


#: the loss heads a trainer can use (see :class:`Trainer`)
HEADS = ("dense", "fused")


class Trainer(NativeHandle):
    """Trains every trainable weight of a context's model (see :class:`retro.Model` for the
    limits of the pinned llama.cpp). ``accumulation`` micro-batches of ``n_ubatch`` tokens make one
    optimizer step. One trainer per context at a time; close it to create another.

    ``duty_cycle`` < 1 throttles training to that share of wall time: after each micro-batch the
    limiter owes ``compute_time * (1 - duty) / duty`` of sleep, paid before the next compute and
    dropped, not slept, when the call returns.

    ``schedule(step, horizon) -> lr`` replaces the optimizer's fixed learning rate: it is asked for
    the rate of each optimizer step (0-based, of ``horizon`` planned steps) just before the
    micro-batch that takes it, and ggml's optimizer-parameter callback hands that rate out. A
    schedule that raises, or returns a rate that is not finite and > 0, cancels the call before
    that step (as a progress callback that raises does) and its exception is re-raised.

    ``head`` is the loss head. ``"dense"`` (the default): ggml's cross-entropy over a [vocab x
    tokens] label tensor, filled on the host and copied to the device every micro-batch.
    ``"fused"``: the cross-entropy of each token's k weighted targets, gathered from the softmax
    of the logits: no dense label tensor on the host or the device, k (index, weight) pairs and one
    best id per token instead (a probability below 1e-30 counts as 1e-30). Both train the same
    loss; the fused head saves the label memory and its copy (a top-k dataset at a large
    vocabulary), the dense head is ggml's own fused kernel (small vocabularies, one label per
    token). A backend that cannot run an op of the fused head fails the step with
    :class:`retro.UnsupportedHeadError` before anything is allocated.

    ``topology_cache`` switches on the fork's packed-topology cache (:mod:`retro.topology`): a
    micro-batch whose key (token geometry and sequence layout, target count, head, trainable
    tensors; an entry built for training serves evaluation too) matches the one entry's runs its
    graphs again instead of rebuilding them, in the one allocation the scheduler holds: a hit
    allocates nothing at any accumulation period. ``True`` needs a results package whose gate enables the cache for this build
    and for every backend the model runs on (``topology_gate``, a folder or its results.json, or
    ``$RETRO_TOPOLOGY_GATE``), else :class:`retro.TopologyGateError` says what is missing. (The
    checks that produce the gate's evidence waive it through the harness's test door, which a
    release build does not have.)"""

    _h: _native.Trainer

    def __init__(
        self,
        context: Context,
        *,
        optimizer: AdamW | SGD | None = None,
        accumulation: int = 1,
        duty_cycle: float = 1.0,
        schedule: Schedule | None = None,
        horizon: int | None = None,
        head: str = "dense",
        topology_cache: bool = False,
        topology_gate: str | os.PathLike[str] | None = None,
    ) -> None:
        if not isinstance(context, Context):
            raise TypeError("context must be a retro.Context")
        optimizer = AdamW() if optimizer is None else optimizer
        if not isinstance(optimizer, (AdamW, SGD)):
            raise TypeError("optimizer must be retro.AdamW or retro.SGD")
        settings = optimizer._settings()
        accumulation = _checks.integer("accumulation", accumulation, minimum=1)
        self.duty_cycle = _checks.real("duty_cycle", duty_cycle, low=0.0, high=1.0, low_open=True)
        if schedule is not None and not callable(schedule):
            raise TypeError("schedule must be callable: schedule(step, horizon) -> learning rate")
        if (schedule is None) != (horizon is None):
            raise ValueError("a schedule and its horizon (the planned optimizer steps) come together")
        if head not in HEADS:
            raise ValueError(f"head must be one of {', '.join(HEADS)}, not {head!r}")
        steps = None if horizon is None else _checks.integer("horizon", horizon, minimum=1, maximum=_checks.INT64_MAX)
        cache = topology.check_mode(topology_cache)
        if context.closed:
            raise ValueError("the context is closed")
        if not context.model.trainable:
            raise ValueError("the model was loaded read-only; load it with trainable=True to train")
        n_ctx, n_batch, n_ubatch = context.n_ctx, context.n_batch, context.n_ubatch
        if n_ctx % min(n_batch, n_ctx) or min(n_batch, n_ctx) % min(n_ubatch, n_batch):
            raise ValueError(
                f"training needs n_ctx ({n_ctx}) divisible by n_batch ({n_batch}) and n_batch "
                f"divisible by n_ubatch ({n_ubatch})"
            )
        if topology.gated(cache):  # before anything native: a refused gate leaves no trainer behind
            topology.require_gate(topology_gate, topology.backends_of(context.model.tensor_devices()))
        self.context = context
        self.optimizer = optimizer
        self.accumulation = accumulation
        self._told_split = False  # MicroBatchGradientWarning, once per trainer
        self._h = forwarding(_native.Trainer)(context._h, settings, accumulation)
        self._opened()
        self.schedule, self.horizon = schedule, steps
        self._head = head
        if head == "fused":
            self._h.set_head(True)
        if cache:
            self._h.set_topology_cache(True)
        if schedule is not None and steps is not None:
            self._h.set_schedule(_wrap_schedule(schedule), steps)

    # -- state --------------------------------------------------------------------------------
    @property
    def topology_cache(self) -> topology.TopologyCacheStats:
        """The packed-topology cache's counters, read from the fork (:mod:`retro.topology`)."""
        return topology.TopologyCacheStats._from_native(self._h.topology_stats)

    @property
    def head(self) -> str:
        """The loss head, ``"dense"`` or ``"fused"``: chosen at creation, kept for the trainer's life."""
        return self._head

    @property
    def iteration(self) -> int:
        """The optimizer iteration cursor: 1 + optimizer steps applied."""
        return int(self._h.iteration)

    @property
    def period_position(self) -> int:
        """Micro-batches accumulated since the last optimizer step."""
        return int(self._h.period_position)

    @property
    def stop_requests(self) -> int:
        """Stop requests the library recorded on this context since the trainer started (counted by
        llama.cpp's llama_opt_request_stop itself, not by the binding)."""
        return int(self._h.stop_requests)

    @property
    def poisoned(self) -> bool:
        """True once a backend compute failed: every later call raises PoisonedTrainerError."""
        return bool(self._h.poisoned)

    def parameters(self) -> dict[str, np.ndarray]:
        return self.context.model.parameters()

    @forwarding
    def moments(self, name: str) -> tuple[np.ndarray, np.ndarray] | None:
        """The AdamW first and second moments of a weight, or None (SGD, or before the first step)."""
        if not isinstance(name, str):
            raise TypeError("name must be a str")
        m, v = self._h.moment(name, 0), self._h.moment(name, 1)
        return None if m is None or v is None else (m, v)

    @forwarding
    def gradient_accumulator(self, name: str) -> np.ndarray | None:
        """The gradient accumulated for a weight in the current period, or None (not trained, or
        before the first backward pass)."""
        if not isinstance(name, str):
            raise TypeError("name must be a str")
        return self._h.gradient_accumulator(name)

    def _refuse_if_poisoned(self) -> None:
        # after a compute failure the parameters and moments may be half-written: no snapshot of
        # them may pass for a checkpoint, and nothing may be written into them
        if self.poisoned:
            raise PoisonedTrainerError(
                "an earlier backend compute failed; recreate the trainer and restore a checkpoint"
            )

    # -- checkpoints --------------------------------------------------------------------------
    def checkpoint(self) -> Checkpoint:
        """Parameters, AdamW moments and cursor, copied to host memory. Taken at an accumulation
        boundary only: a partial period's gradients are not part of a checkpoint."""
        self._refuse_if_poisoned()
        if self.period_position != 0:
            raise InvalidStateError(
                f"{self.period_position} micro-batches into an accumulation period: "
                "checkpoint at a boundary (after an optimizer step)"
            )
        # the weights, their moments and the cursor of one step, read under one guard
        params, moments, iteration = self._h.snapshot()
        meta = {"optimizer": type(self.optimizer).__name__, "accumulation": self.accumulation}
        return Checkpoint(dict(params), dict(moments), int(iteration), meta)

    @forwarding
    def restore(self, checkpoint: Checkpoint) -> None:
        """Write a checkpoint into this trainer and its model; training then continues as it
        would have from the checkpoint. Every array is checked before anything is written."""
        if not isinstance(checkpoint, Checkpoint):
            raise TypeError("checkpoint must be a retro.Checkpoint")
        self._refuse_if_poisoned()
        model = self.context.model
        names = set(model.tensor_names())
        if set(checkpoint.parameters) != names:
            raise ValueError("the checkpoint's tensors are not this model's")
        shapes = {n: model.tensor(n).shape for n in names}

        def check(arrays: list[tuple[str, np.ndarray]]) -> None:
            for n, a in arrays:
                if n not in names or np.shape(a) != shapes[n] or np.asarray(a).dtype != np.float32:
                    raise ValueError(f"checkpoint array for {n!r} is not float32 of shape {shapes.get(n)}")

        moments = [(n, a) for n, mv in checkpoint.moments.items() for a in mv]
        late = _checks.seeded("FAIL-08.partial")  # seeded defect: the moments checked once the parameters are written
        check(list(checkpoint.parameters.items()) + ([] if late else moments))
        if _checks.seeded("SHAPE-02.iteration"):
            iteration = int(checkpoint.iteration)  # seeded defect: taken unchecked, refused natively once written
        else:
            iteration = _checks.integer("iteration", checkpoint.iteration, minimum=1, maximum=_checks.INT64_MAX)
        if self.period_position != 0:
            raise InvalidStateError("restore at an accumulation boundary")
        self._h.prepare_state()
        # weights, moments and cursor written under the context's and the weights' guards at once
        writes = [(n, -1, np.ascontiguousarray(a)) for n, a in checkpoint.parameters.items()]
        if not _checks.seeded("FAIL-08"):  # seeded defect: the moments are not restored
            state = [
                (n, which, np.ascontiguousarray(a))
                for n, mv in checkpoint.moments.items()
                for which, a in enumerate(mv)
            ]
        else:
            state = []
        if late:
            self._h.restore(writes, None)
            check(moments)
            self._h.restore(state, iteration)
        else:
            self._h.restore(writes + state, iteration)

    # -- training -----------------------------------------------------------------------------
    def _split(self, dataset: Dataset, val_fraction: float) -> int:
        if not isinstance(dataset, _Windows):
            raise TypeError("dataset must be a retro.TokenDataset, WeightedDataset, TopKDataset or PackedDataset")
        frac = _checks.real("val_fraction", val_fraction, low=0.0, high=1.0)
        if frac >= 1.0:
            raise ValueError("val_fraction must be < 1")
        n_ctx, n_ubatch = self.context.n_ctx, self.context.training_ubatch
        width = dataset.width
        if width > n_ctx or width % n_ubatch:
            raise ValueError(
                f"window width {width} must be a multiple of n_ubatch ({n_ubatch}) and at most n_ctx ({n_ctx})"
            )
        if n_ubatch == n_ctx and width != n_ctx:
            raise ValueError(f"with n_ubatch == n_ctx every window must hold exactly n_ctx ({n_ctx}) tokens")
        if not _checks.seeded("SHAPE-01"):  # seeded defect: token ids left to the native loop
            dataset._check_ids(self.context.model.n_vocab)
        dataset._check_weights()
        _checks.integer("tokens per epoch", dataset.tokens.size, maximum=_checks.INT64_MAX)
        dataset._check_sequences(n_ubatch, self.context.sequences)
        return dataset.n_windows - math.ceil(dataset.n_windows * frac) if frac else dataset.n_windows

    @forwarding
    def epoch(
        self,
        dataset: Dataset,
        *,
        val_fraction: float = 0.0,
        progress: ProgressCallback | None = None,
        epoch_callback: _ctypes.CFuncPtr | None = None,
    ) -> EpochMetrics:
        """Train on the front of the dataset and evaluate on its last ``val_fraction``.

        ``progress`` is called after every micro-batch with a :class:`Progress`; returning False
        cancels: the finished micro-batch stays applied, an incomplete accumulation period is
        discarded, the rest (evaluation included) is skipped and the metrics say
        ``epoch_complete=False``. An exception raised by ``progress`` cancels the same way and is
        re-raised here, and so does Ctrl-C (a pending signal is raised at the next micro-batch
        boundary, with or without a progress callback): either exception carries ``.metrics``, the
        :class:`EpochMetrics` of the work that ran, and the trainer stays usable. ``epoch_callback`` (a :data:`EpochCallback`) is called after every
        micro-batch with upstream ggml's arguments. The dataset's arrays are read in place for
        the call: never copied, and not referenced once it returns."""
        n_train = self._split(dataset, val_fraction)
        if progress is not None and not callable(progress):
            raise TypeError("progress must be callable")
        split = dataset.width > self.context.training_ubatch
        if split and not self._told_split:
            self._told_split = True
            warnings.warn(
                f"windows of {dataset.width} tokens are trained in micro-batches of "
                f"{self.context.training_ubatch}: each micro-batch takes the earlier ones' keys and values from "
                "the KV cache as constants, and attn_k/attn_v get no gradient (docs/limits.md)",
                MicroBatchGradientWarning,
                stacklevel=3,
            )
        # seeded defect: the callback type declared returning bool, not upstream's void
        wanted = _BOOL_EPOCH_CALLBACK if _checks.seeded("CANCEL-01.signature") else EpochCallback
        if epoch_callback is not None and not isinstance(epoch_callback, wanted):
            raise TypeError("epoch_callback must be a retro.EpochCallback (ctypes) function")
        native_progress = None if progress is None else _wrap_progress(progress)
        address = 0 if epoch_callback is None else ctypes.cast(epoch_callback, ctypes.c_void_p).value or 0
        if _checks.seeded("HOST-01.retained"):
            self._last_dataset = dataset  # seeded defect: the trainer keeps the caller's arrays
        try:
            m = self._h.epoch(dataset._epoch_data(), n_train, native_progress, address, self.duty_cycle)
        except BaseException as e:  # a callback's exception, or Ctrl-C: it carries what ran
            ran = getattr(e, "metrics", None)
            if isinstance(ran, _native.EpochMetrics):
                e.metrics = EpochMetrics._from_native(ran, split)  # type: ignore[attr-defined]
            raise
        return EpochMetrics._from_native(m, split)

    @forwarding
    def preflight(self, dataset: Dataset, *, val_fraction: float = 0.0, budget: Budget | None = None) -> Preflight:
        """The memory an :meth:`epoch` call on ``dataset`` would allocate, per buffer type and
        purpose (:class:`retro.Preflight`), measured on the graphs its micro-batches would build
        with this trainer's head, optimizer and accumulation (the KV cache taken full, the largest a
        window reaches): nothing is allocated, computed or trained, and the weights, the optimizer
        state and the KV cache stay as they are. The context's next decode rebuilds its graph.

        ``budget`` (bytes in all, or a mapping of buffer type name to bytes) refuses the epoch
        with :class:`retro.MemoryBudgetError` when it would allocate more; the error carries the
        measurement as ``.preflight``. A fused head that the backend cannot run raises
        :class:`retro.UnsupportedHeadError`, as the epoch would."""
        limit = check_budget(budget)
        n_train = self._split(dataset, val_fraction)
        measured = Preflight._from_native(self._h.preflight(dataset._epoch_data(), n_train))
        enforce(measured, limit)
        return measured

    def plan(self, dataset: Dataset, *, val_fraction: float = 0.0) -> RowPlan:
        """The row plan an epoch call on ``dataset`` would iterate, as the native loop builds it:
        which micro-batches run, their tokens (padding included) and each packed token's sequence
        and position. Nothing is computed."""
        n_train = self._split(dataset, val_fraction)
        steps, seq, pos = self._h.plan(dataset._epoch_data(), n_train)
        return RowPlan(steps, seq, pos)


class RowPlan(NamedTuple):
    """An epoch call's row plan. ``steps`` is int64 [micro-batches, 5]: window, offset of its first
    token (into the flattened windows), tokens sent to compute, of them inside the window's active
    span, and 1 for a training micro-batch (0: the evaluation tail). ``seq`` and ``pos`` give each
    token of a packed dataset its sequence and position (empty for other datasets)."""

    steps: np.ndarray
    seq: np.ndarray
    pos: np.ndarray

    @property
    def physical_tokens(self) -> int:
        return int(self.steps[:, 2].sum())


def _wrap_schedule(schedule: Schedule) -> Callable[[int, int], float]:
    def call(step: int, horizon: int) -> float:
        lr = schedule(step, horizon)
        if isinstance(lr, bool) or not isinstance(lr, (int, float)):
            raise TypeError(f"the schedule must return a number, not {type(lr).__name__}")
        return float(lr)

    return call


def _wrap_progress(progress: ProgressCallback) -> Callable[[bool, int, int], bool]:
    def call(train: bool, done: int, total: int) -> bool:
        r = progress(Progress(train, done, total))
        if r is None:
            return True
        if not isinstance(r, bool):
            raise TypeError(f"the progress callback must return a bool or None, not {type(r).__name__}")
        return r

    return call
