"""Weighted and top-k datasets: their arrays are the caller's and validated before anything native
changes; unit weights train exactly as plain next-token windows; zero weights mask."""

from __future__ import annotations

import numpy as np
import pytest

import retro
from conftest import dataset


def _weighted(n_windows: int = 2, seed: int = 0, weight: float = 1.0) -> retro.WeightedDataset:
    base = dataset(n_windows, seed=seed)
    return retro.WeightedDataset(base.tokens, base.labels, np.full(base.tokens.shape, weight, dtype=np.float32))


def _train(model: retro.Model, ds, lr: float = 0.1) -> tuple[dict[str, np.ndarray], retro.EpochMetrics]:
    with (
        retro.Context(model, n_ctx=256, n_batch=256, n_ubatch=64) as c,
        retro.Trainer(c, optimizer=retro.SGD(lr=lr)) as tr,
    ):
        m = tr.epoch(ds)
    return model.parameters(), m


@pytest.fixture
def fresh(model_path):
    def load() -> retro.Model:
        return retro.Model.load(model_path, devices=[], trainable=True)

    return load


def test_unit_weights_train_exactly_as_next_token_windows(fresh):
    base = dataset(2)
    with fresh() as m:
        plain, _ = _train(m, base)
    with fresh() as m:
        weighted, metrics = _train(m, _weighted())
    with fresh() as m:
        ids, weights = base.labels[:, :, None].copy(), np.ones((*base.labels.shape, 1), dtype=np.float32)
        top1, _ = _train(m, retro.TopKDataset(base.tokens, ids, weights))
    for name in plain:
        assert np.array_equal(plain[name], weighted[name]), name
        assert np.array_equal(plain[name], top1[name]), name
    assert metrics.logical_tokens == metrics.physical_tokens == 2 * 256


def test_zero_weights_mask_their_tokens(fresh):
    with fresh() as m:
        before = m.parameters()
        after, metrics = _train(m, _weighted(weight=0.0))
    assert all(np.array_equal(before[n], after[n]) for n in before), "a fully masked dataset moved a weight"
    assert (metrics.logical_tokens, metrics.physical_tokens) == (0, 2 * 256)

    # a masked token's label is never read: changing it changes nothing
    ds = _weighted()
    ds.weights[:, ::2] = 0.0
    relabelled = retro.WeightedDataset(ds.tokens, ds.labels.copy(), ds.weights)
    relabelled.labels[:, ::2] = (relabelled.labels[:, ::2] + 1) % 512
    with fresh() as m:
        a, metrics = _train(m, ds)
    with fresh() as m:
        b, _ = _train(m, relabelled)
    assert all(np.array_equal(a[n], b[n]) for n in a)
    assert metrics.logical_tokens == 256


def test_arrays_must_be_borrowable_as_they_are():
    base = dataset(1)
    w = np.ones(base.tokens.shape, dtype=np.float32)
    with pytest.raises(TypeError, match="labels must be int32"):
        retro.WeightedDataset(base.tokens, base.labels.astype(np.int64), w)
    with pytest.raises(TypeError, match="weights must be float32"):
        retro.WeightedDataset(base.tokens, base.labels, w.astype(np.float64))
    with pytest.raises(TypeError, match="numpy array"):
        retro.WeightedDataset(base.tokens, base.labels.tolist(), w)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="C-contiguous"):
        retro.WeightedDataset(base.tokens, np.asfortranarray(np.vstack([base.labels, base.labels]))[:1], w)
    with pytest.raises(ValueError, match="one shape"):
        retro.WeightedDataset(base.tokens, base.labels, w[:, :128].copy())
    with pytest.raises(ValueError, match="k must be in"):
        retro.TopKDataset(base.tokens, np.zeros((1, 256, 0), np.int32), np.zeros((1, 256, 0), np.float32))
    with pytest.raises(ValueError, match="tokens' shape x k"):
        retro.TopKDataset(base.tokens, np.zeros((1, 256, 2), np.int32), np.zeros((1, 256, 3), np.float32))


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_bad_weights_are_refused_before_anything_changes(model, ctx, bad):
    ds = _weighted()
    ds.weights[1, 7] = bad
    before = model.parameters()
    with retro.Trainer(ctx, optimizer=retro.SGD(lr=0.1)) as tr:
        start = tr.iteration
        with pytest.raises(ValueError, match="weights must be finite and >= 0"):
            tr.epoch(ds)
        assert tr.iteration == start
    assert all(np.array_equal(before[n], v) for n, v in model.parameters().items())


def test_target_ids_out_of_range_are_refused(ctx):
    base = dataset(1)
    ids = np.zeros((1, 256, 3), np.int32)
    ids[0, 5, 2] = 512
    with retro.Trainer(ctx, optimizer=retro.SGD(lr=0.1)) as tr:
        with pytest.raises(ValueError, match=r"dataset.ids holds ids outside \[0, 512\)"):
            tr.epoch(retro.TopKDataset(base.tokens, ids, np.ones(ids.shape, np.float32)))


def test_a_callback_writing_a_bad_id_mid_call_gets_a_typed_error_not_a_crash(model, ctx):
    """The arrays are read in place, so a callback may write into them during the call; the native
    step checks what it reads and refuses the micro-batch before it changes anything."""
    ds = _weighted()
    before = None

    def corrupt(p: retro.Progress) -> None:
        nonlocal before
        if p.done == 1:
            ds.labels[0, 100] = 10_000  # in the second micro-batch
            before = model.parameters()

    with retro.Trainer(ctx, optimizer=retro.SGD(lr=0.1)) as tr:
        start = tr.iteration
        with pytest.raises(retro.InvalidStateError, match="rejected as invalid"):
            tr.epoch(ds, progress=corrupt)
        assert not tr.poisoned
        assert tr.iteration == start + 1
    assert before is not None
    assert all(np.array_equal(before[n], v) for n, v in model.parameters().items())


def test_the_target_arrays_exist_from_the_first_step(ctx):
    from retro.testing import target_arrays

    assert target_arrays(ctx) == (0, 0)
    with retro.Trainer(ctx, optimizer=retro.SGD(lr=0.1)) as tr:
        tr.epoch(_weighted(1))
    address, capacity = target_arrays(ctx)
    # the dense head's k indices and k weights per token (k 1, 64-token micro-batches), no
    # vocabulary-wide rows: those are made on the device
    assert address != 0 and capacity == 2 * 64
    with pytest.raises(TypeError, match=r"retro\.Context"):
        target_arrays(tr)  # type: ignore[arg-type]


def test_upstreams_loop_refuses_weighted_targets(model_path):
    from retro.testing import upstream_epoch

    with retro.Model.load(model_path, devices=[], trainable=True) as m, retro.Context(m, n_ctx=256, n_ubatch=256) as c:
        with retro.Trainer(c, optimizer=retro.SGD(lr=0.1)) as tr:
            with pytest.raises(TypeError, match="one unweighted label per token"):
                upstream_epoch(tr, _weighted(1))


def test_upstreams_loop_refuses_an_id_past_the_vocabulary_before_anything_native(model_path):
    """llama_opt_epoch asserts on a label id >= n_vocab: the oracle's entry point refuses it typed."""
    from retro.testing import upstream_epoch

    bad = dataset(1)
    labels = bad.labels.copy()
    labels[0, 5] = 512  # the tiny model's vocabulary is 512
    with (
        retro.Model.load(model_path, devices=[], trainable=True) as m,
        retro.Context(m, n_ctx=256, n_batch=256, n_ubatch=64) as c,
        retro.Trainer(c, optimizer=retro.SGD(lr=0.1)) as tr,
    ):
        before = tr.iteration
        with pytest.raises(ValueError, match=r"dataset\.labels"):
            upstream_epoch(tr, retro.TokenDataset(bad.tokens, labels))
        assert tr.iteration == before and upstream_epoch(tr, bad).optimizer_steps == 256 // 64
