"""The exceptions of retro. Native failures arrive as one of these classes, with the backend's
diagnostic lines in the message; invalid arguments raise ValueError, TypeError or OverflowError
before anything native changes."""

from __future__ import annotations


class RetroError(Exception):
    """Base class of every error raised by the native layer."""


class ModelLoadError(RetroError):
    """The model file could not be loaded."""


class ContextError(RetroError):
    """A context could not be created."""


class DecodeError(RetroError):
    """llama_decode failed."""


class InvalidStateError(RetroError):
    """The object is closed, or the call does not fit its state (e.g. a second trainer)."""


class TrainingError(RetroError):
    """A training call failed."""


class BeforeComputeError(TrainingError):
    """A training step failed before compute. The step was abandoned at its update boundary
    (partial accumulation, allocation, graph metadata and sequence state dropped); steps completed
    earlier in the call stay applied and the trainer stays usable."""


class BatchInitError(BeforeComputeError):
    """The batch of a training step could not be initialized."""


class MemoryInitError(BeforeComputeError):
    """The memory (KV cache) of a training step could not be initialized."""


class OutputReserveError(BeforeComputeError):
    """The output buffer of a training step could not be reserved."""


class GraphBuildError(BeforeComputeError):
    """The graph of a training step could not be built."""


class AllocationError(BeforeComputeError):
    """The graph of a training step could not be allocated."""


class ComputeError(TrainingError):
    """The backend compute failed. The backend may have written part of the parameters, which
    cannot be rolled back: the trainer refuses every later call. Recreate it and restore a
    checkpoint."""


class PoisonedTrainerError(TrainingError):
    """Refused: an earlier backend compute failed on this trainer."""


__all__ = [
    "RetroError",
    "ModelLoadError",
    "ContextError",
    "DecodeError",
    "InvalidStateError",
    "TrainingError",
    "BeforeComputeError",
    "BatchInitError",
    "MemoryInitError",
    "OutputReserveError",
    "GraphBuildError",
    "AllocationError",
    "ComputeError",
    "PoisonedTrainerError",
]
