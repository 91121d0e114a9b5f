"""Upstream's own training loop as an oracle: ``llama_opt_epoch`` of the same library, run on a
retro trainer's optimizer, so that a check can hold :meth:`retro.Trainer.epoch` against it."""

from __future__ import annotations

from .._native_logs import forwarding
from ..datasets import TokenDataset
from ..training import EpochMetrics, Trainer


@forwarding
def upstream_epoch(trainer: Trainer, dataset: TokenDataset, *, val_fraction: float = 0.0) -> EpochMetrics:
    """One epoch of upstream's ``llama_opt_epoch`` over the dataset, on the trainer's optimizer.

    Upstream's loop takes windows of exactly the model's training context (``n_ctx_train``), which
    must also be the context's ``n_ctx``, and its accumulation period is the trainer's. Only the
    losses, accuracies and optimizer steps are reported (upstream counts nothing else)."""
    if not isinstance(trainer, Trainer):
        raise TypeError("trainer must be a retro.Trainer")
    if not isinstance(dataset, TokenDataset):  # weights or k targets would be silently dropped
        raise TypeError("upstream's loop trains one unweighted label per token: dataset must be a retro.TokenDataset")
    if trainer.schedule is not None:
        raise ValueError("upstream's loop knows no learning-rate schedule: use a trainer without one")
    n_train = trainer._split(dataset, val_fraction)
    n_ctx, n_ctx_train = trainer.context.n_ctx, trainer.context.model.n_ctx_train
    if dataset.width != n_ctx or n_ctx != n_ctx_train:
        raise ValueError(
            f"upstream's loop needs windows of n_ctx ({n_ctx}) == the model's n_ctx_train "
            f"({n_ctx_train}) tokens, got {dataset.width}"
        )
    # upstream's loop asserts on an id past the vocabulary: a typed error here, before anything native
    dataset._check_ids(trainer.context.model.n_vocab)
    split = dataset.width > trainer.context.training_ubatch  # read before: the context may be closed after
    m = trainer._h.upstream_epoch(dataset.tokens, dataset.labels, n_train)
    return EpochMetrics._from_native(m, split)
