"""Scoring by teacher forcing: the log-probability a model gives each next token of given
sequences, and a teacher's top-k turned into the targets of a :class:`retro.TopKDataset`
(distillation). Every sequence is decoded from an empty context, one decode per n_batch tokens;
the softmax and the top-k run in numpy over the logits llama.cpp returns."""

from __future__ import annotations

import numpy as np

from . import _checks
from .context import Context
from .datasets import PADDING, PackedDataset, TokenDataset, TopKDataset, WeightedDataset


def _logits(context: Context, tokens: np.ndarray) -> np.ndarray:
    """Logits of every position of one sequence, decoded from an empty context, float32 [n, vocab]."""
    if tokens.size > context.n_ctx:
        raise ValueError(f"a sequence of {tokens.size} tokens exceeds n_ctx={context.n_ctx}")
    context.reset()
    step = context.n_batch
    out = [context.decode(tokens[i : i + step]) for i in range(0, tokens.size, step)]
    context.reset()
    return out[0] if len(out) == 1 else np.concatenate(out)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    out: np.ndarray = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return out


def _context_of(context: object) -> Context:
    if not isinstance(context, Context):
        raise TypeError("context must be a retro.Context")
    if context.closed:
        raise ValueError("the context is closed")
    return context


def log_probs(context: Context, sequence: np.ndarray | list[int]) -> np.ndarray:
    """log p(sequence[i + 1] | sequence[: i + 1]) for every i: float64 [len(sequence) - 1]."""
    ctx = _context_of(context)
    ids = _checks.token_array("sequence", sequence, ctx.model.n_vocab, ndim=1)
    if ids.size < 2:
        raise ValueError("a sequence of at least 2 tokens has a next token to score")
    lp = _log_softmax(_logits(ctx, ids[:-1]))  # the last token predicts nothing that is scored
    scores: np.ndarray = lp[np.arange(ids.size - 1), ids[1:]]
    return scores


def packed_log_probs(context: Context, dataset: PackedDataset) -> np.ndarray:
    """The log-probability of each packed token's target (the next token of its own document),
    each document scored alone from position 0, as training sees it: float64 [n_windows, width],
    NaN where a token has no target (a document's last token, padding)."""
    ctx = _context_of(context)
    if not isinstance(dataset, PackedDataset):
        raise TypeError("dataset must be a retro.PackedDataset")
    dataset._check_ids(ctx.model.n_vocab)
    out = np.full(dataset.tokens.shape, np.nan)
    for w in range(dataset.n_windows):
        docs = dataset.documents[w]
        bounds = np.flatnonzero(np.r_[True, docs[1:] != docs[:-1]])
        for start, end in zip(bounds, [*bounds[1:], dataset.width]):
            if docs[start] == PADDING or end - start < 2:
                continue
            out[w, start : end - 1] = log_probs(ctx, dataset.tokens[w, start:end])
    return out


def top_k(
    context: Context,
    dataset: TokenDataset | WeightedDataset,
    k: int,
    *,
    temperature: float = 1.0,
    normalize: bool = False,
) -> TopKDataset:
    """A teacher's k most likely next tokens at every position of the dataset's windows, with their
    probabilities (at ``temperature``) as weights: the targets a student distils from. With
    ``normalize`` the k weights of a position sum to one. Each window is decoded from an empty
    context; ids are ordered by probability, most likely first."""
    ctx = _context_of(context)
    if not isinstance(dataset, (TokenDataset, WeightedDataset)):
        raise TypeError("dataset must be a retro.TokenDataset or WeightedDataset")
    k = _checks.integer("k", k, minimum=1, maximum=min(TopKDataset.MAX_K, ctx.model.n_vocab))
    t = _checks.real("temperature", temperature, low=0.0, high=100.0, low_open=True)
    dataset._check_ids(ctx.model.n_vocab)
    ids = np.empty((*dataset.tokens.shape, k), dtype=np.int32)
    weights = np.empty((*dataset.tokens.shape, k), dtype=np.float32)
    for w in range(dataset.n_windows):
        lp = _log_softmax(_logits(ctx, dataset.tokens[w]) / t)
        best = np.argpartition(-lp, k - 1, axis=1)[:, :k]
        p = np.exp(np.take_along_axis(lp, best, axis=1))
        order = np.argsort(-p, axis=1, kind="stable")
        ids[w] = np.take_along_axis(best, order, axis=1)
        p = np.take_along_axis(p, order, axis=1)
        weights[w] = p / p.sum(axis=1, keepdims=True) if normalize else p
    return TopKDataset(np.ascontiguousarray(dataset.tokens), ids, weights)
