"""Datasets a trainer consumes. Each kind owns how it crosses into the native loop
(``_epoch_data``: the arrays it lends an epoch call, in one descriptor), so that the trainer never
asks which kind it holds."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from . import _checks, _native


def _lend(
    tokens: np.ndarray,
    *,
    targets: np.ndarray | None = None,
    weights: np.ndarray | None = None,
    documents: np.ndarray | None = None,
) -> _native.EpochData:
    """The arrays an epoch call reads in place: the caller's own, never a copy."""
    if _checks.seeded("HOST-01"):  # seeded defect: a defensive copy of the caller's arrays
        tokens = tokens.copy()
        targets, weights, documents = (None if a is None else a.copy() for a in (targets, weights, documents))
    return _native.EpochData(tokens, targets, weights, documents)


class _Windows:
    """What every dataset says of its windows: tokens are int32 [n_windows, width]."""

    tokens: np.ndarray

    def _epoch_data(self) -> _native.EpochData:
        raise NotImplementedError

    def _check_ids(self, n_vocab: int) -> None:
        """Every id the call will read is in [0, n_vocab): a typed error before anything native."""
        _checks.token_array("dataset.tokens", self.tokens, n_vocab, ndim=2)

    def _check_weights(self) -> None:
        """Every loss weight finite and >= 0."""
        weights = getattr(self, "weights", None)
        if weights is not None:
            _checks.weights("dataset.weights", weights)

    def _check_sequences(self, n_ubatch: int, sequences: int) -> None:
        """The context's sequences hold what one micro-batch of the kind needs (one, but packed)."""

    @property
    def n_windows(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1])

    def __len__(self) -> int:
        return self.n_windows


@dataclass(frozen=True)
class TokenDataset(_Windows):
    """Next-token windows over a token stream, labelled as upstream's common_opt_dataset_init does:
    window i holds tokens[i*stride : i*stride+width], each labelled by the token that follows it.
    Every window that fits is kept (upstream's count, (len - width - 1) // stride, drops the last
    one). The width must equal the training context's n_ctx or divide into its micro-batches."""

    tokens: np.ndarray  # int32 [n_windows, width]
    labels: np.ndarray  # int32 [n_windows, width]

    @classmethod
    def from_tokens(cls, tokens: np.ndarray | list[int], *, width: int, stride: int | None = None) -> TokenDataset:
        arr = np.asarray(tokens)
        if arr.dtype.kind not in "iu":
            raise TypeError(f"tokens must hold integers, not {arr.dtype}")
        if arr.ndim != 1:
            raise ValueError(f"tokens must be a 1-D stream, got shape {arr.shape}")
        if arr.size and int(arr.max()) > _checks.INT32_MAX:
            raise OverflowError("token ids must fit int32")
        if arr.size and int(arr.min()) < 0:
            raise ValueError("token ids must be >= 0")
        width = _checks.integer("width", width, minimum=1)
        stride = width if stride is None else _checks.integer("stride", stride, minimum=1)
        if arr.size < width + 1:
            raise ValueError(f"{arr.size} tokens cannot fill one window of {width} plus its last label")
        n = (arr.size - width - 1) // stride + 1
        starts = np.arange(n, dtype=np.int64)[:, None] * stride + np.arange(width, dtype=np.int64)[None, :]
        stream = arr.astype(np.int32, copy=False)
        return cls(np.ascontiguousarray(stream[starts]), np.ascontiguousarray(stream[starts + 1]))

    def __post_init__(self) -> None:
        # the same borrowing rule as every other kind: an int64 array is refused here, by name,
        # not by the binding's generic conversion error at the first epoch
        _borrowable("tokens", self.tokens, np.int32, 2)
        _borrowable("labels", self.labels, np.int32, 2)
        if self.tokens.shape != self.labels.shape:
            raise ValueError("tokens and labels must be 2-D arrays of one shape")

    def _epoch_data(self) -> _native.EpochData:
        return _lend(self.tokens, targets=self.labels)

    def _check_ids(self, n_vocab: int) -> None:
        super()._check_ids(n_vocab)
        _checks.token_array("dataset.labels", self.labels, n_vocab, ndim=2)


def _borrowable(name: str, arr: object, dtype: type[np.generic], ndim: int) -> np.ndarray:
    """The caller's own array, as the native loop will read it: never a converted copy."""
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"{name} must be a numpy array, not {type(arr).__name__}")
    if arr.dtype != dtype:
        raise TypeError(f"{name} must be {np.dtype(dtype).name}, not {arr.dtype} (convert it once, outside the call)")
    if arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {arr.shape}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (np.ascontiguousarray), so that it is read in place")
    return arr


@dataclass(frozen=True)
class WeightedDataset(_Windows):
    """Windows whose every token carries a loss weight: token i of window w is trained towards
    ``labels[w, i]`` with weight ``weights[w, i]``; a weight of 0 masks the token (a prompt, padding)
    and the loss is the mean over the window's tokens of weight x cross-entropy. The arrays are the
    caller's: each epoch call reads them in place, never copies them and keeps no reference after
    it returns (so they must already be C-contiguous int32, int32 and float32)."""

    tokens: np.ndarray  # int32 [n_windows, width]
    labels: np.ndarray  # int32 [n_windows, width]
    weights: np.ndarray  # float32 [n_windows, width], finite and >= 0

    def __post_init__(self) -> None:
        _borrowable("tokens", self.tokens, np.int32, 2)
        _borrowable("labels", self.labels, np.int32, 2)
        _borrowable("weights", self.weights, np.float32, 2)
        if not self.tokens.shape == self.labels.shape == self.weights.shape:
            raise ValueError("tokens, labels and weights must have one shape")

    def _epoch_data(self) -> _native.EpochData:
        return _lend(self.tokens, targets=self.labels, weights=self.weights)

    def _check_ids(self, n_vocab: int) -> None:
        super()._check_ids(n_vocab)
        _checks.token_array("dataset.labels", self.labels, n_vocab, ndim=2)


@dataclass(frozen=True)
class TopKDataset(_Windows):
    """Windows whose every token is trained towards k weighted target ids (distillation from a
    teacher's k most likely tokens): the label row of token i of window w is the sum over j of
    ``weights[w, i, j]`` at ``ids[w, i, j]``. A repeated id contributes the sum of its weights;
    the weights need not sum to one (the gradient is that of the loss as written); a token whose
    weights are all 0 is masked. Borrowed like :class:`WeightedDataset`'s arrays."""

    tokens: np.ndarray  # int32 [n_windows, width]
    ids: np.ndarray  # int32 [n_windows, width, k]
    weights: np.ndarray  # float32 [n_windows, width, k], finite and >= 0

    #: the most targets per token the native step takes (LLAMA_OPT_MAX_TARGETS)
    MAX_K = 1024

    def __post_init__(self) -> None:
        _borrowable("tokens", self.tokens, np.int32, 2)
        _borrowable("ids", self.ids, np.int32, 3)
        _borrowable("weights", self.weights, np.float32, 3)
        if self.ids.shape != self.weights.shape or self.ids.shape[:2] != self.tokens.shape:
            raise ValueError(
                f"ids and weights must be tokens' shape x k: {self.tokens.shape}, {self.ids.shape}, {self.weights.shape}"
            )
        if not 1 <= self.k <= self.MAX_K:
            raise ValueError(f"k must be in [1, {self.MAX_K}], got {self.k}")

    @property
    def k(self) -> int:
        return int(self.ids.shape[2])

    def _epoch_data(self) -> _native.EpochData:
        return _lend(self.tokens, targets=self.ids, weights=self.weights)

    def _check_ids(self, n_vocab: int) -> None:
        super()._check_ids(n_vocab)
        _checks.token_array("dataset.ids", self.ids, n_vocab, ndim=3)


#: a packed window's padding: the tokens after its last document
PADDING = -1


@dataclass(frozen=True)
class PackedDataset(_Windows):
    """Several documents packed into each window (short chat turns, code files). ``documents[w, i]``
    is the document of token i of window w: non-decreasing along the window, each run of one value
    a document, and ``PADDING`` (-1) for the tokens after the last one. Each token is trained
    towards the next token of its own document (with ``weights[w, i]``, 1 without weights; 0
    masks it: a prompt), a document's last token towards nothing: no label crosses a boundary.
    Positions restart at 0 in every document and attention stays inside it (each document is its
    own sequence in the micro-batch), so a packed window trains as its documents would one by one.

    A context for packed training needs a sequence id for every document one micro-batch touches
    (``retro.Context(..., sequences=N)``; :meth:`sequences_needed` says how many). The arrays are
    the caller's, borrowed as :class:`WeightedDataset`'s: tokens and weights are read in place at
    each micro-batch, the documents once per call, when the row plan is built."""

    tokens: np.ndarray  # int32 [n_windows, width]
    documents: np.ndarray  # int32 [n_windows, width], non-decreasing, PADDING after the last document
    weights: np.ndarray | None = None  # float32 [n_windows, width], finite and >= 0

    def __post_init__(self) -> None:
        _borrowable("tokens", self.tokens, np.int32, 2)
        _borrowable("documents", self.documents, np.int32, 2)
        if self.weights is not None:
            _borrowable("weights", self.weights, np.float32, 2)
        shapes = {a.shape for a in (self.tokens, self.documents, self.weights) if a is not None}
        if len(shapes) != 1:
            raise ValueError(f"tokens, documents and weights must have one shape, got {sorted(shapes)}")
        _check_memberships(self.documents)

    @classmethod
    def pack(
        cls,
        documents: Sequence[np.ndarray | Sequence[int]],
        *,
        width: int,
        pad_token: int = 0,
        weights: Sequence[np.ndarray | Sequence[float]] | None = None,
    ) -> PackedDataset:
        """Documents (token sequences) packed first-fit into windows of ``width``: each document
        goes into the first window with room for it (documents keep their order inside a window),
        the rest of each window is padding. A document longer than the window is a ValueError
        (split it first: a window is the longest context one trains)."""
        width = _checks.integer("width", width, minimum=1)
        pad = _checks.integer("pad_token", pad_token, minimum=0)
        docs = [np.asarray(d) for d in documents]
        if not docs:
            raise ValueError("no documents to pack")
        if weights is not None and len(weights) != len(docs):
            raise ValueError(f"{len(weights)} weight arrays for {len(docs)} documents")
        rows: list[list[int]] = []
        free: list[int] = []  # tokens left in each window
        for i, d in enumerate(docs):
            if d.ndim != 1 or d.size == 0 or d.dtype.kind not in "iu":
                raise ValueError(f"document {i} must be a non-empty 1-D integer sequence")
            if d.size > width:
                raise ValueError(f"document {i} has {d.size} tokens, more than the window's {width}")
            fit = next((r for r, room in enumerate(free) if room >= d.size), None)
            if fit is None:
                rows.append([])
                free.append(width)
                fit = len(rows) - 1
            rows[fit].append(i)
            free[fit] -= d.size
        tokens = np.full((len(rows), width), pad, dtype=np.int64)
        members = np.full((len(rows), width), PADDING, dtype=np.int32)
        w = None if weights is None else np.zeros((len(rows), width), dtype=np.float32)
        for r, row in enumerate(rows):
            at = 0
            for i in row:
                n = docs[i].size
                tokens[r, at : at + n] = docs[i]
                members[r, at : at + n] = i
                if w is not None and weights is not None:
                    wi = np.asarray(weights[i], dtype=np.float32)
                    if wi.shape != docs[i].shape:
                        raise ValueError(f"weights of document {i} have shape {wi.shape}, not {docs[i].shape}")
                    w[r, at : at + n] = wi
                at += n
        if tokens.max() > _checks.INT32_MAX or tokens.min() < 0:
            raise ValueError("token ids must be in [0, 2**31)")
        return cls(tokens.astype(np.int32), members, w)

    def _check_sequences(self, n_ubatch: int, sequences: int) -> None:
        needed = self.sequences_needed(n_ubatch)
        if needed > sequences:
            raise ValueError(
                f"one micro-batch of {n_ubatch} tokens touches up to {needed} documents, and this context has "
                f"{sequences} sequence{'s' if sequences > 1 else ''}: create it with retro.Context(..., sequences={needed})"
            )

    def sequences_needed(self, n_ubatch: int) -> int:
        """The most documents one micro-batch of ``n_ubatch`` tokens touches: the sequences a
        context needs to train this dataset."""
        n_ubatch = _checks.integer("n_ubatch", n_ubatch, minimum=1)
        if self.width % n_ubatch:
            raise ValueError(f"the window width {self.width} is not a multiple of n_ubatch {n_ubatch}")
        docs = self.documents.reshape(self.n_windows, self.width // n_ubatch, n_ubatch)
        real = docs != PADDING
        starts = np.zeros(docs.shape, dtype=bool)
        starts[..., 1:] = (docs[..., 1:] != docs[..., :-1]) & real[..., 1:]
        touched = starts.sum(axis=2) + real[..., 0]
        return max(1, int(touched.max()))

    @property
    def logical_tokens(self) -> int:
        """Tokens with a target of positive weight: the next token of the same document."""
        nxt = np.zeros(self.documents.shape, dtype=bool)
        nxt[:, :-1] = (self.documents[:, 1:] == self.documents[:, :-1]) & (self.documents[:, :-1] != PADDING)
        if self.weights is not None:
            nxt &= self.weights > 0
        return int(nxt.sum())

    def _epoch_data(self) -> _native.EpochData:
        return _lend(self.tokens, weights=self.weights, documents=self.documents)


def _check_memberships(documents: np.ndarray) -> None:
    """Each window's document indices never decrease, and padding comes only after the last one."""
    if documents.size == 0:
        raise ValueError("documents is empty")
    if int(documents.min()) < PADDING:
        raise ValueError(f"document indices must be >= 0 (or {PADDING} for padding), found {int(documents.min())}")
    real = documents != PADDING
    # seeded defect: padding is taken to end a document only, and a document after it is let through
    if (real[:, 1:] & ~real[:, :-1]).any() and not _checks.seeded("SHAPE-01.padding"):
        w = int(np.flatnonzero((real[:, 1:] & ~real[:, :-1]).any(axis=1))[0])
        raise ValueError(f"window {w}: a document follows padding; padding ({PADDING}) only ends a window")
    down = (documents[:, 1:] < documents[:, :-1]) & real[:, 1:]
    if down.any():
        w, i = (int(x[0]) for x in np.nonzero(down))
        raise ValueError(f"window {w}: document indices decrease at token {i + 1}")


Dataset = TokenDataset | WeightedDataset | TopKDataset | PackedDataset
