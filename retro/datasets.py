"""Datasets a trainer consumes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import _checks


@dataclass(frozen=True)
class TokenDataset:
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

    @property
    def n_windows(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1])

    def __len__(self) -> int:
        return self.n_windows
