"""Scoring by teacher forcing (retro.scoring): the log-probabilities decode gives are the ones
training's loss is made of, and a teacher's top-k trains a student (distillation end to end)."""

from __future__ import annotations

import numpy as np
import pytest

import retro
from retro.testing import TinyLlamaSpec, write_tiny_llama

WIDTH = 256


def _context(model: retro.Model, n_ubatch: int = WIDTH, sequences: int = 1) -> retro.Context:
    return retro.Context(model, n_ctx=256, n_batch=256, n_ubatch=n_ubatch, n_threads=1, sequences=sequences)


def test_log_probs_are_what_the_training_loss_is_made_of(model):
    """One window's training loss (reported from the step's forward pass) is the mean of -log p of
    its labels, as decode scores the same sequence."""
    stream = np.random.default_rng(0).integers(0, model.n_vocab, size=WIDTH + 1).astype(np.int32)
    ds = retro.TokenDataset.from_tokens(stream, width=WIDTH)
    with _context(model) as ctx:
        lp = retro.scoring.log_probs(ctx, stream)
        with retro.Trainer(ctx, optimizer=retro.SGD(lr=1e-3)) as tr:
            loss = tr.epoch(ds).train_loss
    assert lp.shape == (WIDTH,)
    assert loss == pytest.approx(-lp.mean(), rel=1e-5)


def test_packed_log_probs_score_each_document_alone(model):
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, model.n_vocab, size=n).astype(np.int32) for n in (30, 1, 80, 45)]
    ds = retro.PackedDataset.pack(docs, width=WIDTH)
    with _context(model, sequences=4) as ctx:
        lp = retro.scoring.packed_log_probs(ctx, ds)
        assert np.array_equal(
            ~np.isnan(lp[0]), np.r_[[True] * 29, False, False, [True] * 79, False, [True] * 44, False, [False] * 100]
        )
        assert lp[0, :29] == pytest.approx(retro.scoring.log_probs(ctx, docs[0]))
        with retro.Trainer(ctx, optimizer=retro.SGD(lr=1e-3)) as tr:
            loss = tr.epoch(ds).train_loss
    assert loss == pytest.approx(-np.nansum(lp) / WIDTH, rel=1e-5)


def test_top_k_orders_ids_by_probability(model):
    stream = np.random.default_rng(2).integers(0, model.n_vocab, size=2 * WIDTH + 1)
    ds = retro.TokenDataset.from_tokens(stream, width=WIDTH)
    with _context(model) as ctx:
        raw = retro.scoring.top_k(ctx, ds, 8)
        norm = retro.scoring.top_k(ctx, ds, 8, normalize=True)
        with pytest.raises(ValueError, match="k must be"):
            retro.scoring.top_k(ctx, ds, 0)
        with pytest.raises(ValueError, match="temperature"):
            retro.scoring.top_k(ctx, ds, 4, temperature=0.0)
        full = np.exp(retro.scoring.log_probs(ctx, np.r_[ds.tokens[0], ds.labels[0, -1]]))
    assert raw.ids.shape == (2, WIDTH, 8) and raw.tokens is ds.tokens
    assert (np.diff(raw.weights, axis=2) <= 0).all() and (raw.weights.sum(axis=2) <= 1 + 1e-6).all()
    assert norm.weights.sum(axis=2) == pytest.approx(1.0, rel=1e-5)
    # the teacher's probability of each window's actual next token, where it is in the top k
    hit = raw.ids[0] == ds.labels[0][:, None]
    assert np.allclose(raw.weights[0][hit], full[hit.any(axis=1)], rtol=1e-5)


def test_a_student_distils_a_teachers_top_k(tmp_path, model_path):
    """The distillation example of docs/api.md: a teacher scores windows, a student trains on its top 8;
    the student's loss against the teacher's targets falls, and its own top 1 agrees with the
    teacher's more often than before."""
    teacher_path = write_tiny_llama(tmp_path / "teacher.gguf", TinyLlamaSpec(seed=11))
    stream = np.random.default_rng(3).integers(0, 512, size=8 * WIDTH + 1)
    windows = retro.TokenDataset.from_tokens(stream, width=WIDTH)
    with retro.Model.load(teacher_path, devices=[]) as teacher, _context(teacher) as tctx:
        targets = retro.scoring.top_k(tctx, windows, 8, normalize=True)

    def agreement(student: retro.Model) -> float:
        with _context(student) as sctx:
            probe = retro.scoring.top_k(sctx, windows, 1)
        return float((probe.ids[..., 0] == targets.ids[..., 0]).mean())

    with retro.Model.load(model_path, devices=[], trainable=True) as student:
        before = agreement(student)
        with _context(student) as ctx, retro.Trainer(ctx, optimizer=retro.AdamW(lr=3e-3)) as tr:
            losses = [tr.epoch(targets).train_loss for _ in range(4)]
        after = agreement(student)
    assert losses[-1] < losses[0], losses
    assert after > before, (before, after)
