"""An oracle of the training math that shares nothing with ggml: the tiny llama of
:func:`write_tiny_llama` evaluated in float64 numpy from the GGUF file (read by the ``gguf``
package), its loss for token, weighted and top-k targets as the datasets define it, the exact
gradient of that loss by reverse-mode differentiation of the numpy code (the ``autograd``
package), and central finite differences along a direction (which hold the gradient itself to
account). A check compares the gradient a training step applied with these, tensor by tensor."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import autograd  # type: ignore[import-untyped]
import autograd.numpy as anp  # type: ignore[import-untyped]
import gguf
import numpy as np
import numpy.typing as npt
from autograd.tracer import getval  # type: ignore[import-untyped]

Array = npt.NDArray[np.float64]

#: what write_tiny_llama writes (models.py): RMS norm epsilon and RoPE base
RMS_EPS, ROPE_BASE = 1e-5, 10000.0


def read_weights(path: Path) -> dict[str, Array]:
    """Every tensor of the file in float64, shaped as numpy reads a row-major matrix (out, in)."""
    out: dict[str, Array] = {}
    for t in gguf.GGUFReader(path).tensors:
        out[t.name] = np.array(t.data, dtype=np.float64).reshape([int(n) for n in reversed(t.shape)])
    return out


# The forward pass is written in autograd's numpy (anp, the same functions traced) and never
# writes into an array, so that its gradient is exact: no step size, no float32.


def read_heads(path: Path) -> dict[str, int]:
    """The attention heads of the file's llama (the keyword arguments of logits, loss, gradient)."""
    fields = gguf.GGUFReader(path).fields
    return {
        "n_head": int(fields["llama.attention.head_count"].contents()),
        "n_head_kv": int(fields["llama.attention.head_count_kv"].contents()),
    }


def _rms(x: Any, gain: Any) -> Any:
    return x / anp.sqrt((x * x).mean(-1, keepdims=True) + RMS_EPS) * gain


def _rope(x: Any, positions: Array) -> Any:
    """llama's rotary embedding (the "normal" kind: adjacent pairs rotate), x: (tokens, heads, dim)."""
    dim = x.shape[-1]
    angle = positions[:, None] * ROPE_BASE ** (-np.arange(0, dim, 2) / dim)[None, :]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    return anp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1).reshape(x.shape)


def logits(w: dict[str, Any], tokens: npt.ArrayLike, *, n_head: int, n_head_kv: int, cached_kv: bool = False) -> Any:
    """The causal forward pass of one window: logits (tokens, vocab). With `cached_kv`, K and V
    are constants of the gradient, as when llama.cpp trains a window in micro-batches shorter
    than the context: each micro-batch writes its K and V into the KV cache and reads them back
    from there, and no gradient flows through the cache (the values are the same)."""
    x = _trunk(w, w["token_embd.weight"][np.asarray(tokens)], n_head=n_head, n_head_kv=n_head_kv, cached_kv=cached_kv)
    return _rms(x, w["output_norm.weight"]) @ w["output.weight"].T


def _trunk(w: dict[str, Any], x: Any, *, n_head: int, n_head_kv: int, cached_kv: bool) -> Any:
    """The residual stream after the last layer (tokens, embd), from the embedded tokens x: what
    the head reads."""
    n, embd = x.shape
    dim = embd // n_head
    positions = np.arange(n, dtype=np.float64)
    future = np.triu(np.full((n, n), -np.inf), 1)
    layers = sum(1 for name in w if name.endswith(".attn_norm.weight"))
    for i in range(layers):
        h = _rms(x, w[f"blk.{i}.attn_norm.weight"])
        q = _rope((h @ w[f"blk.{i}.attn_q.weight"].T).reshape(n, n_head, dim), positions)
        k = _rope((h @ w[f"blk.{i}.attn_k.weight"].T).reshape(n, n_head_kv, dim), positions)
        v = (h @ w[f"blk.{i}.attn_v.weight"].T).reshape(n, n_head_kv, dim)
        if cached_kv:
            k, v = getval(k), getval(v)
        group = n_head // n_head_kv
        k, v = anp.repeat(k, group, axis=1), anp.repeat(v, group, axis=1)
        scores = anp.einsum("thd,shd->hts", q, k) / np.sqrt(dim) + future
        scores = anp.exp(scores - scores.max(-1, keepdims=True))
        scores = scores / scores.sum(-1, keepdims=True)
        x = x + anp.einsum("hts,shd->thd", scores, v).reshape(n, embd) @ w[f"blk.{i}.attn_output.weight"].T
        h = _rms(x, w[f"blk.{i}.ffn_norm.weight"])
        gate, up = h @ w[f"blk.{i}.ffn_gate.weight"].T, h @ w[f"blk.{i}.ffn_up.weight"].T
        x = x + (gate / (1.0 + anp.exp(-gate)) * up) @ w[f"blk.{i}.ffn_down.weight"].T
    return x


def _loss(
    w: dict[str, Any], tokens: npt.ArrayLike, targets: Array, n_head: int, n_head_kv: int, cached_kv: bool = False
) -> Any:
    z = logits(w, tokens, n_head=n_head, n_head_kv=n_head_kv, cached_kv=cached_kv)
    z = z - z.max(-1, keepdims=True)
    log_p = z - anp.log(anp.exp(z).sum(-1, keepdims=True))
    return -(targets * log_p).sum() / len(targets)


def loss(w: dict[str, Array], tokens: npt.ArrayLike, targets: Array, *, n_head: int, n_head_kv: int) -> float:
    """The mean over the window's tokens of the cross-entropy against each token's target row
    (tokens, vocab): a one-hot label times its weight, or a top-k row of weights (which need not
    sum to one; an all-zero row is a masked token)."""
    return float(_loss(w, tokens, targets, n_head, n_head_kv))


def gradient(
    w: dict[str, Array], tokens: npt.ArrayLike, targets: Array, *, n_head: int, n_head_kv: int, cached_kv: bool = False
) -> dict[str, Array]:
    """The gradient of :func:`loss` with respect to every tensor of w, exact in float64; with
    `cached_kv`, of a window trained in equal micro-batches through the KV cache (see logits)."""
    grads: dict[str, Array] = autograd.grad(_loss)(w, tokens, targets, n_head, n_head_kv, cached_kv)
    return grads


#: the weights head_gradient differentiates: the head's own, which every class row of the
#: cross-entropy reaches
HEAD = ("output.weight", "output_norm.weight")


def head_gradient(
    w: dict[str, Array], tokens: npt.ArrayLike, targets: Array, *, n_head: int, n_head_kv: int
) -> dict[str, Array]:
    """The gradient of :func:`loss` with respect to the head's weights only (HEAD), in closed form
    from the forward pass (float64): where a whole gradient costs minutes (a real vocabulary and
    width), the rows every class reaches, the cross-entropy's own, cost a forward pass. The same
    for a window trained whole or in micro-batches (the KV cache changes no forward value). The
    weights may be float32, as read back: numpy computes with each in float64 where it is used."""
    embedded = np.asarray(w["token_embd.weight"][np.asarray(tokens)], dtype=np.float64)
    x = np.asarray(_trunk(w, embedded, n_head=n_head, n_head_kv=n_head_kv, cached_kv=False))
    gain, out = w["output_norm.weight"], w["output.weight"]
    scale = 1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + RMS_EPS)
    normed = x * scale * gain
    z = normed @ out.T
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    # d loss / d z of -sum(rows * log_softmax(z)) / tokens, for rows of any sum
    dz = (p * targets.sum(-1, keepdims=True) - targets) / len(targets)
    return {"output.weight": dz.T @ normed, "output_norm.weight": ((dz @ out) * x * scale).sum(0)}


def target_rows(n_vocab: int, ids: npt.ArrayLike, weights: npt.ArrayLike) -> Array:
    """Target rows (tokens, vocab) from ids and weights of shape (tokens,) or (tokens, k); a
    repeated id adds its weights."""
    ids_a, weights_a = np.asarray(ids), np.asarray(weights, dtype=np.float64)
    if ids_a.ndim == 1:
        ids_a, weights_a = ids_a[:, None], weights_a[:, None]
    rows = np.zeros((ids_a.shape[0], n_vocab))
    np.add.at(rows, (np.arange(ids_a.shape[0])[:, None], ids_a), weights_a)
    return rows


def directional_derivative(
    w: dict[str, Array],
    name: str,
    direction: Array,
    tokens: npt.ArrayLike,
    targets: Array,
    *,
    n_head: int,
    n_head_kv: int,
    step: float = 1e-4,
) -> float:
    """d loss / d t of w[name] + t * direction at t = 0, by central differences in float64."""
    ahead, behind = dict(w), dict(w)
    ahead[name] = w[name] + step * direction
    behind[name] = w[name] - step * direction
    heads = {"n_head": n_head, "n_head_kv": n_head_kv}
    return (loss(ahead, tokens, targets, **heads) - loss(behind, tokens, targets, **heads)) / (2 * step)


@dataclass(frozen=True)
class Targets:
    """Random targets of one kind for windows of tokens: as the binding's dataset, and as the
    target rows numpy's loss takes."""

    kind: str  # "token", "weighted" or "top-k"
    tokens: npt.NDArray[np.int32]  # (windows, width)
    ids: npt.NDArray[np.int32]  # (windows, width), or (windows, width, k) for top-k
    weights: npt.NDArray[np.float32] | None  # the shape of ids; None for token targets

    def dataset(self, windows: slice = slice(None)) -> Any:
        """The windows as a TokenDataset, WeightedDataset or TopKDataset."""
        import retro

        tokens, ids = np.ascontiguousarray(self.tokens[windows]), np.ascontiguousarray(self.ids[windows])
        if self.weights is None:
            return retro.TokenDataset(tokens, ids)
        weights = np.ascontiguousarray(self.weights[windows])
        return (retro.WeightedDataset if self.kind == "weighted" else retro.TopKDataset)(tokens, ids, weights)

    def rows(self, window: int, n_vocab: int) -> Array:
        """Numpy's target rows (width, vocab) of one window."""
        weights = np.ones(self.ids.shape[1]) if self.weights is None else self.weights[window]
        return target_rows(n_vocab, self.ids[window], weights)


def random_targets(kind: str, n_windows: int, width: int, n_vocab: int, rng: np.random.Generator) -> Targets:
    """Token targets; weighted ones (weights 0, 0.5, 1 and 2); or top-k ones with k = 4 whose
    first two ids repeat at every position, rows summing to 1, to less (every third token) and
    masked (every seventh)."""
    tokens = rng.integers(0, n_vocab, size=(n_windows, width), dtype=np.int32)
    if kind == "token":
        return Targets(kind, tokens, rng.integers(0, n_vocab, size=(n_windows, width), dtype=np.int32), None)
    if kind == "weighted":
        ids = rng.integers(0, n_vocab, size=(n_windows, width), dtype=np.int32)
        weights = rng.choice(np.array([0.0, 0.5, 1.0, 2.0], np.float32), size=(n_windows, width)).astype(np.float32)
        return Targets(kind, tokens, ids, weights)
    if kind != "top-k":
        raise ValueError(f"unknown target kind {kind!r}")
    k = 4
    ids = rng.integers(0, n_vocab, size=(n_windows, width, k), dtype=np.int32)
    ids[..., 1] = ids[..., 0]  # a repeated id adds its weights
    weights = rng.dirichlet(np.ones(k), size=(n_windows, width)).astype(np.float32)
    weights[:, ::3] *= 0.5
    weights[:, ::7] = 0.0
    return Targets(kind, tokens, ids, weights)
