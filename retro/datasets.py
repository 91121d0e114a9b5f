"""Datasets a trainer consumes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import _checks


class _Windows:
    """What every dataset says of its windows: tokens are int32 [n_windows, width]."""

    tokens: np.ndarray

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
        if self.tokens.shape != self.labels.shape or self.tokens.ndim != 2:
            raise ValueError("tokens and labels must be 2-D arrays of one shape")


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


Dataset = TokenDataset | WeightedDataset | TopKDataset
