"""Packed datasets: several documents per window, each its own sequence. A packed window trains as
its documents would one by one, its loss is numpy's over each document decoded alone, and bad
input is a typed error before anything native changes."""

from __future__ import annotations

import numpy as np
import pytest

import retro
from retro.datasets import PADDING

WIDTH = 256


def _docs(lengths: list[int], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 512, size=n, dtype=np.int32) for n in lengths]


@pytest.fixture
def fresh(model_path):
    def load() -> retro.Model:
        return retro.Model.load(model_path, devices=[], trainable=True)

    return load


def _context(model: retro.Model, n_ubatch: int = WIDTH, sequences: int = 8) -> retro.Context:
    return retro.Context(model, n_ctx=256, n_batch=256, n_ubatch=n_ubatch, n_threads=1, sequences=sequences)


def test_pack_lays_documents_out_first_fit_with_padding_after_the_last():
    ds = retro.PackedDataset.pack(_docs([100, 100, 100, 10]), width=WIDTH, pad_token=7)
    assert ds.n_windows == 2
    assert ds.documents[0].tolist() == [0] * 100 + [1] * 100 + [3] * 10 + [PADDING] * 46
    assert ds.documents[1].tolist() == [2] * 100 + [PADDING] * 156
    assert (ds.tokens[1, 100:] == 7).all()
    # a document's last token has no target: 4 documents, 310 tokens
    assert ds.logical_tokens == 310 - 4
    assert ds.sequences_needed(64) == 2 and ds.sequences_needed(256) == 3


def test_a_packed_window_trains_as_its_documents_one_by_one(fresh):
    """One SGD step on a window of three documents equals three windows of one document each,
    accumulated into one step: the packed gradient is the sum of the documents' (the accumulated
    one their mean, hence 3x the rate). Not bitwise: float32 sums run in another order."""
    docs = _docs([90, 60, 70], seed=1)
    packed = retro.PackedDataset.pack(docs, width=WIDTH)
    alone = retro.PackedDataset(
        np.ascontiguousarray(np.stack([np.pad(d, (0, WIDTH - d.size)) for d in docs]).astype(np.int32)),
        np.ascontiguousarray(
            np.stack([np.r_[np.zeros(d.size), np.full(WIDTH - d.size, PADDING)] for d in docs]).astype(np.int32)
        ),
    )
    with fresh() as m:
        start = m.parameters()
        with _context(m) as c, retro.Trainer(c, optimizer=retro.SGD(lr=0.5)) as tr:
            tr.epoch(packed)
        after_packed = m.parameters()
    with fresh() as m:
        with _context(m) as c, retro.Trainer(c, optimizer=retro.SGD(lr=1.5), accumulation=3) as tr:
            metrics = tr.epoch(alone)
        after_alone = m.parameters()
    assert metrics.optimizer_steps == 1
    for name in start:
        step_packed, step_alone = after_packed[name] - start[name], after_alone[name] - start[name]
        scale = float(np.abs(step_alone).max()) or 1.0
        assert float(np.abs(step_packed - step_alone).max()) <= 1e-4 * scale, name


@pytest.mark.parametrize("n_ubatch", [64, WIDTH])
def test_the_packed_loss_is_numpys_over_each_document_decoded_alone(fresh, model_path, n_ubatch):
    docs = _docs([40, 17, 90, 1, 33, 50], seed=2)
    ds = retro.PackedDataset.pack(docs, width=WIDTH)
    total = 0.0
    with retro.Model.load(model_path, devices=[]) as m, retro.Context(m, n_ctx=256, n_threads=1) as c:
        for d in docs:
            if d.size < 2:
                continue
            c.reset()
            logits = c.decode(d).astype(np.float64)
            shifted = logits - logits.max(axis=1, keepdims=True)
            log_p = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
            total += float(-log_p[np.arange(d.size - 1), d[1:]].sum())
    with fresh() as m, _context(m, n_ubatch=n_ubatch) as c:
        with retro.Trainer(c, optimizer=retro.SGD(lr=1e-3)) as tr:
            plan = tr.plan(ds)
            metrics = tr.epoch(ds)
    assert metrics.physical_tokens == plan.physical_tokens == WIDTH
    assert metrics.logical_tokens == ds.logical_tokens == sum(d.size - 1 for d in docs)
    # ggml's loss: the mean over micro-batches of each one's sum over its n_ubatch rows / n_ubatch
    assert metrics.train_loss == pytest.approx(total / WIDTH, rel=1e-5)


def _decreasing(d: np.ndarray) -> np.ndarray:
    d[0, 150] = 0
    return d


def _gap(d: np.ndarray) -> np.ndarray:
    d[0, 150] = PADDING
    return d


def _below_padding(d: np.ndarray) -> np.ndarray:
    d[0, -1] = -2
    return d


@pytest.mark.parametrize(
    ("name", "change", "error", "match"),
    [
        ("documents", _decreasing, ValueError, "decrease"),
        ("documents", _gap, ValueError, "follows padding"),
        ("documents", _below_padding, ValueError, ">= 0"),
        ("documents", lambda d: d.astype(np.int64), TypeError, "int32"),
        ("documents", lambda d: np.repeat(d, 2, axis=1)[:, ::2], ValueError, "C-contiguous"),
        ("weights", lambda w: w[:, :128].copy(), ValueError, "one shape"),
        ("tokens", lambda t: t.tolist(), TypeError, "numpy array"),
    ],
)
def test_bad_packed_arrays_are_refused(name, change, error, match):
    ds = retro.PackedDataset.pack(_docs([100, 100, 30]), width=WIDTH)
    arrays = {
        "tokens": ds.tokens.copy(),
        "documents": ds.documents.copy(),
        "weights": np.ones(ds.tokens.shape, np.float32),
    }
    arrays[name] = change(arrays[name])
    with pytest.raises(error, match=match):
        retro.PackedDataset(**arrays)


def test_pack_refuses_a_document_longer_than_the_window_and_empty_input():
    with pytest.raises(ValueError, match="more than the window"):
        retro.PackedDataset.pack(_docs([10, 300]), width=WIDTH)
    with pytest.raises(ValueError, match="no documents"):
        retro.PackedDataset.pack([], width=WIDTH)
    with pytest.raises(ValueError, match="non-empty"):
        retro.PackedDataset.pack([np.array([], np.int32)], width=WIDTH)


@pytest.mark.parametrize("case", ["nan weight", "negative weight", "id out of range", "too few sequences"])
def test_the_trainer_refuses_bad_packed_data_before_anything_native_changes(fresh, case):
    ds = retro.PackedDataset.pack(_docs([20] * 12), width=WIDTH)
    weights = np.ones(ds.tokens.shape, np.float32)
    sequences = 16
    if case == "nan weight":
        weights[0, 5] = np.nan
    elif case == "negative weight":
        weights[0, 5] = -1.0
    elif case == "id out of range":
        ds.tokens[0, 3] = 512
    else:
        sequences = 2
    bad = retro.PackedDataset(ds.tokens, ds.documents, weights)
    with fresh() as m:
        before = m.parameters()
        with _context(m, n_ubatch=64, sequences=sequences) as c, retro.Trainer(c) as tr:
            with pytest.raises((ValueError, OverflowError), match=r"sequences=|finite|outside"):
                tr.epoch(bad)
            assert tr.iteration == 1 and tr.period_position == 0
            assert c.sequence_length == 0
        after = m.parameters()
    assert all(np.array_equal(before[n], after[n]) for n in before)


def test_a_context_refuses_more_sequences_than_llama_cpp_has(model):
    with pytest.raises(OverflowError, match="sequences"):
        retro.Context(model, n_ctx=256, sequences=257)
    with pytest.raises(ValueError, match="sequences"):
        retro.Context(model, n_ctx=256, sequences=0)


def test_plain_windows_keep_their_plan(ctx):
    with retro.Trainer(ctx) as tr:
        stream = np.random.default_rng(3).integers(0, 512, size=2 * WIDTH + 1)
        plan = tr.plan(retro.TokenDataset.from_tokens(stream, width=WIDTH), val_fraction=0.5)
    assert plan.steps.tolist() == [
        [w, w * WIDTH + o, 64, 64, int(w == 0)] for w in range(2) for o in range(0, WIDTH, 64)
    ]
    assert plan.seq.size == plan.pos.size == 0
