"""A llama.cpp context: decoding, and the state a trainer runs on."""

from __future__ import annotations

import numpy as np

from . import _checks, _native, _threads
from ._handle import NativeHandle
from ._native_logs import forwarding
from .model import Model


class Context(NativeHandle):
    """A context on a model (sequence 0 only).

    llama.cpp rounds ``n_ctx`` up to a multiple of 256. ``n_batch`` is the most tokens one
    :meth:`decode` takes; ``n_ubatch`` is the micro-batch a training step computes at once.
    """

    _h: _native.Context

    def __init__(
        self,
        model: Model,
        *,
        n_ctx: int = 256,
        n_batch: int | None = None,
        n_ubatch: int | None = None,
        n_threads: int | None = None,
    ) -> None:
        if not isinstance(model, Model):
            raise TypeError("model must be a retro.Model")
        n_ctx = _checks.integer("n_ctx", n_ctx, minimum=1)
        n_batch = n_ctx if n_batch is None else _checks.integer("n_batch", n_batch, minimum=1)
        n_ubatch = min(n_batch, 512) if n_ubatch is None else _checks.integer("n_ubatch", n_ubatch, minimum=1)
        if n_ubatch > n_batch:
            raise ValueError(f"n_ubatch ({n_ubatch}) must not exceed n_batch ({n_batch})")
        threads, adaptive = (
            _threads.default_threads()
            if n_threads is None
            else (_checks.integer("n_threads", n_threads, minimum=1, maximum=512), False)
        )
        if model.closed:
            raise ValueError("the model is closed")
        self.model = model
        self.n_threads = threads
        """The most CPU threads a compute gets (all of them unless ``adaptive_threads``)."""
        self.adaptive_threads = adaptive
        """Whether each compute gets only the cores no other runnable task holds (the default
        when neither ``n_threads`` nor RETRO_THREADS names a count)."""
        self._h = forwarding(_native.Context)(model._h, n_ctx, n_batch, n_ubatch, threads, adaptive)

    @property
    def n_ctx(self) -> int:
        return int(self._h.n_ctx)

    @property
    def n_batch(self) -> int:
        return int(self._h.n_batch)

    @property
    def n_ubatch(self) -> int:
        return int(self._h.n_ubatch)

    @property
    def threads_now(self) -> int:
        """The CPU threads the last compute ran with."""
        return int(self._h.threads_now)

    @property
    def training_ubatch(self) -> int:
        """Tokens a training micro-batch computes at once: n_ubatch, capped at n_batch and n_ctx."""
        return int(self._h.training_ubatch)

    @property
    def n_past(self) -> int:
        """Tokens of the current sequence decoded through this binding."""
        return int(self._h.n_past)

    @property
    def sequence_length(self) -> int:
        """Positions of sequence 0 held in the KV cache (0 when it is empty), as llama.cpp sees it."""
        return int(self._h.sequence_length)

    @forwarding
    def decode(self, tokens: np.ndarray | list[int]) -> np.ndarray:
        """Append tokens to the sequence; returns their logits, float32 [len(tokens), n_vocab].
        The GIL is released while the backend computes."""
        ids = _checks.token_array("tokens", tokens, self.model.n_vocab, ndim=1)
        if ids.size > self.n_batch:
            raise ValueError(f"{ids.size} tokens exceed n_batch={self.n_batch}")
        if self.n_past + ids.size > self.n_ctx:
            raise ValueError(f"{self.n_past} + {ids.size} tokens exceed n_ctx={self.n_ctx}; call reset()")
        return self._h.decode(ids)

    def reset(self) -> None:
        """Forget the sequence: the next decode starts at position 0."""
        self._h.reset()
