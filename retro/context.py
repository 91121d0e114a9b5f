"""A llama.cpp context: decoding, and the state a trainer runs on."""

from __future__ import annotations

import atexit
import contextlib
import time
import weakref

import numpy as np

from . import _checks, _native, _threads
from ._handle import NativeHandle
from ._native_logs import forwarding
from .model import Model
from .transactions import Capture, Generation, TensorTransactions, TransactionFailure

# Python need not free objects left alive at interpreter shutdown: a context whose tensor
# transactions hold a Python handler is closed at exit, so that llama_free runs and then the
# callback state (and the handler) is released while the interpreter is still whole. A daemon
# thread still inside one of its calls is let out before finalization begins: past that point
# Python ends such a thread where it next takes the GIL, which may be inside native code.
_WITH_TRANSACTIONS: weakref.WeakSet[Context] = weakref.WeakSet()
#: llama.cpp's LLAMA_MAX_SEQ: the most sequence ids a context may have
MAX_SEQUENCES = 256


def _sampling(temperature: object, seed: object) -> tuple[float, int]:
    """Generation's sampling options, checked: a temperature in [0, 100] (0: greedy) and a seed."""
    if not isinstance(temperature, (int, float)) or not 0.0 <= float(temperature) <= 100.0:
        raise ValueError("temperature must be a number in [0, 100]")
    return float(temperature), _checks.integer("seed", seed, minimum=0, maximum=2**32 - 1)


@atexit.register
def _close_at_exit() -> None:
    for ctx in list(_WITH_TRANSACTIONS):
        with contextlib.suppress(Exception):
            ctx.close()
        deadline = time.monotonic() + 5.0
        while ctx._h.callers > 0 and time.monotonic() < deadline:
            time.sleep(0.001)


class Context(NativeHandle):
    """A context on a model (decoding and generation use sequence 0).

    llama.cpp rounds ``n_ctx`` up to a multiple of 256. ``n_batch`` is the most tokens one
    :meth:`decode` takes; ``n_ubatch`` is the micro-batch a training step computes at once.
    ``sequences`` is how many documents a training micro-batch may hold at once, for a
    :class:`retro.PackedDataset` (each document is its own sequence); with more than one, the KV
    cache is one stream that the sequences share (llama.cpp's kv_unified).
    """

    _h: _native.Context
    _exit_order = 1

    def __init__(
        self,
        model: Model,
        *,
        n_ctx: int = 256,
        n_batch: int | None = None,
        n_ubatch: int | None = None,
        n_threads: int | None = None,
        sequences: int = 1,
        transactions: TensorTransactions | None = None,
    ) -> None:
        if not isinstance(model, Model):
            raise TypeError("model must be a retro.Model")
        n_ctx = _checks.integer("n_ctx", n_ctx, minimum=1)
        n_batch = n_ctx if n_batch is None else _checks.integer("n_batch", n_batch, minimum=1)
        n_ubatch = min(n_batch, 512) if n_ubatch is None else _checks.integer("n_ubatch", n_ubatch, minimum=1)
        if n_ubatch > n_batch:
            raise ValueError(f"n_ubatch ({n_ubatch}) must not exceed n_batch ({n_batch})")
        sequences = _checks.integer("sequences", sequences, minimum=1, maximum=MAX_SEQUENCES)
        threads, adaptive = (
            _threads.default_threads()
            if n_threads is None
            else (_checks.integer("n_threads", n_threads, minimum=1, maximum=512), False)
        )
        if model.closed:
            raise ValueError("the model is closed")
        if transactions is not None:
            if not isinstance(transactions, TensorTransactions):
                raise TypeError("transactions must be a retro.transactions.TensorTransactions")
            transactions.profile.validate(model)
        self.model = model
        self.n_threads = threads
        """The most CPU threads a compute gets (all of them unless ``adaptive_threads``)."""
        self.adaptive_threads = adaptive
        """Whether each compute gets only the cores no other runnable task holds (the default
        when neither ``n_threads`` nor RETRO_THREADS names a count)."""
        self.transactions = transactions
        """The tensor transactions this context took when it was created, if any."""
        given = transactions._h if transactions else None
        if transactions and not transactions.selectors and _checks.seeded("TX-OWN-01.captures-only"):
            given = None  # seeded defect: borrowed captures alone are never installed
        self._h = forwarding(_native.Context)(model._h, n_ctx, n_batch, n_ubatch, threads, adaptive, sequences, given)
        self._opened()
        if transactions is not None:
            _WITH_TRANSACTIONS.add(self)

    @property
    def n_ctx(self) -> int:
        return int(self._h.n_ctx)

    @property
    def sequences(self) -> int:
        """Sequence ids a training micro-batch may use: the documents it may hold at once."""
        return int(self._h.sequences)

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
        The GIL is released while the backend computes.

        With tensor transactions, a failed transaction raises TensorCallbackError (with
        `failure`) after the decode ran: the tokens stay in the KV cache."""
        ids = _checks.token_array("tokens", tokens, self.model.n_vocab, ndim=1)
        if ids.size > self.n_batch:
            raise ValueError(f"{ids.size} tokens exceed n_batch={self.n_batch}")
        if self.n_past + ids.size > self.n_ctx:
            raise ValueError(f"{self.n_past} + {ids.size} tokens exceed n_ctx={self.n_ctx}; call reset()")
        return self._h.decode(ids)

    @forwarding
    def generate(
        self,
        prompt: np.ndarray | list[int],
        max_new: int,
        *,
        temperature: float = 0.0,
        seed: int = 0,
        stop_at_eog: bool = True,
        draft: Context | None = None,
        n_draft: int = 4,
    ) -> Generation:
        """Append `prompt` and generate up to `max_new` tokens, natively: one call, one decode per
        token (greedy at temperature 0, else sampled with `seed`). With a `draft` context on a
        model of the same vocabulary, greedy speculative decoding: the draft proposes `n_draft`
        tokens and this context checks them in one decode; the tokens are the greedy ones. Both
        sequences must be empty. Every internal decode runs through each context's tensor
        transactions; a failed one raises with `.tokens`, the tokens generated before it. Ctrl-C
        stops the generation at the next token: the KeyboardInterrupt carries `.tokens` too."""
        ids = _checks.token_array("prompt", prompt, self.model.n_vocab, ndim=1)
        max_new = _checks.integer("max_new", max_new, minimum=1, maximum=self.n_ctx)
        temperature, seed = _sampling(temperature, seed)
        n_draft = _checks.integer("n_draft", n_draft, minimum=1, maximum=64)
        if ids.size < 1 or ids.size > self.n_batch:
            raise ValueError(f"the prompt must have 1 to n_batch={self.n_batch} tokens")
        # seeded defect: an off-by-one bound lets a generation one position past the context start
        room = self.n_ctx + 1 if _checks.seeded("SHAPE-02.n-ctx") else self.n_ctx
        # seeded defect SHAPE-02.room: the prompt counted once per token asked for
        wanted = ids.size * max_new if _checks.seeded("SHAPE-02.room") else ids.size + max_new
        if self.n_past + wanted > room:
            raise ValueError(f"{self.n_past} + {ids.size} + {max_new} tokens exceed n_ctx={self.n_ctx}")
        if draft is not None:
            if not isinstance(draft, Context) or draft is self:
                raise TypeError("draft must be another retro.Context")
            if temperature != 0.0:
                raise ValueError("speculative generation is greedy: temperature must be 0")
            if draft.model.n_vocab != self.model.n_vocab:
                raise ValueError("the draft model's vocabulary differs from this model's")
            if self.n_past or draft.n_past:
                raise ValueError("speculative generation starts on empty sequences: reset() both contexts")
            # seeded defect SHAPE-02.draft-room: the target's context taken for both
            both = self.n_ctx if _checks.seeded("SHAPE-02.draft-room") else min(draft.n_ctx, self.n_ctx)
            if ids.size + max_new + n_draft > both or n_draft + 1 > self.n_batch:
                raise ValueError("the prompt, max_new and n_draft do not fit both contexts")
        tokens, decodes, drafted, accepted = self._h.generate(
            ids.tolist(), max_new, temperature, seed, stop_at_eog, draft._h if draft else None, n_draft
        )
        return Generation(list(tokens), int(decodes), int(drafted), int(accepted))

    def drain_captures(self) -> list[Capture]:
        """The retained captures committed since the last drain, in decode order; frees their bytes."""
        return [
            Capture(name, int(decode), positions, data) for name, decode, positions, data in self._h.drain_captures()
        ]

    @property
    def retained_bytes(self) -> int:
        """Bytes of committed, undrained captures (at most the transactions' retained_limit)."""
        return int(self._h.retained_bytes)

    @property
    def transaction_failure(self) -> TransactionFailure | None:
        """The first failed tensor transaction of this context (sticky), if any."""
        raw = self._h.transaction_failure()
        return None if raw is None else TransactionFailure(*raw)

    def sequence_state(self) -> bytes:
        """llama.cpp's serialization of the sequence (positions and K/V cache contents)."""
        return bytes(self._h.sequence_state())

    def reset(self) -> None:
        """Forget the sequence: the next decode starts at position 0."""
        self._h.reset()
