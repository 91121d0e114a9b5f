"""An oracle of the training math that shares nothing with ggml: the tiny llama of
:func:`write_tiny_llama` evaluated in float64 numpy from the GGUF file (read by the ``gguf``
package), its loss for token, weighted and top-k targets as the datasets define it, and central
finite differences of that loss along a direction. A check compares the gradient a training step
applied with these directional derivatives, tensor by tensor."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import numpy.typing as npt

Array = npt.NDArray[np.float64]

#: what write_tiny_llama writes (models.py): RMS norm epsilon and RoPE base
RMS_EPS, ROPE_BASE = 1e-5, 10000.0


def read_weights(path: Path) -> dict[str, Array]:
    """Every tensor of the file in float64, shaped as numpy reads a row-major matrix (out, in)."""
    out: dict[str, Array] = {}
    for t in gguf.GGUFReader(path).tensors:
        out[t.name] = np.array(t.data, dtype=np.float64).reshape([int(n) for n in reversed(t.shape)])
    return out


def _rms(x: Array, gain: Array) -> Array:
    out: Array = x / np.sqrt((x * x).mean(-1, keepdims=True) + RMS_EPS) * gain
    return out


def _rope(x: Array, positions: Array) -> Array:
    """llama's rotary embedding (the "normal" kind: adjacent pairs rotate), x: (tokens, heads, dim)."""
    dim = x.shape[-1]
    angle = positions[:, None] * ROPE_BASE ** (-np.arange(0, dim, 2) / dim)[None, :]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


def logits(w: dict[str, Array], tokens: npt.ArrayLike, *, n_head: int, n_head_kv: int) -> Array:
    """The causal forward pass of one window: logits (tokens, vocab)."""
    x = w["token_embd.weight"][np.asarray(tokens)]
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
        group = n_head // n_head_kv
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(dim) + future
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", scores, v).reshape(n, embd) @ w[f"blk.{i}.attn_output.weight"].T
        h = _rms(x, w[f"blk.{i}.ffn_norm.weight"])
        gate, up = h @ w[f"blk.{i}.ffn_gate.weight"].T, h @ w[f"blk.{i}.ffn_up.weight"].T
        x = x + (gate / (1.0 + np.exp(-gate)) * up) @ w[f"blk.{i}.ffn_down.weight"].T
    result: Array = _rms(x, w["output_norm.weight"]) @ w["output.weight"].T
    return result


def loss(w: dict[str, Array], tokens: npt.ArrayLike, targets: Array, *, n_head: int, n_head_kv: int) -> float:
    """The mean over the window's tokens of the cross-entropy against each token's target row
    (tokens, vocab): a one-hot label times its weight, or a top-k row of weights (which need not
    sum to one; an all-zero row is a masked token)."""
    z = logits(w, tokens, n_head=n_head, n_head_kv=n_head_kv)
    z = z - z.max(-1, keepdims=True)
    log_p = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return float(-(targets * log_p).sum() / len(log_p))


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
