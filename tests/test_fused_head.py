"""The fused cross-entropy head (Trainer(head="fused")): it trains every dataset kind as the dense
head does (the same loss and accuracy, every weight's update within a tight NMSE), builds no dense
label rows, and a backend that cannot run it fails the step with a typed error naming the op and
the backend, before anything is allocated."""

from __future__ import annotations

import re

import numpy as np
import pytest

import retro
import retro.fault_injection as fi
from conftest import dataset
from retro.conformance.evidence import nmse
from retro.testing import live_allocations, target_arrays

WIDTH = 256
#: the fused head against the dense one: the same loss, summed in another order (measured on the
#: CPU: loss within 2e-7 relative, updates within NMSE 1e-10)
LOSS_REL = 1e-5
UPDATE_NMSE = 1e-7


def _top_k(n_windows: int, k: int = 4, seed: int = 3) -> retro.TopKDataset:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 512, size=(n_windows, WIDTH), dtype=np.int32)
    ids = rng.integers(0, 512, size=(n_windows, WIDTH, k), dtype=np.int32)
    ids[..., 1] = ids[..., 0]  # a repeated id at every position
    weights = rng.choice(np.array([0.0, 0.25, 0.5, 1.0], np.float32), size=ids.shape).astype(np.float32)
    return retro.TopKDataset(tokens, ids, weights)


def _weighted(n_windows: int, seed: int = 4) -> retro.WeightedDataset:
    base = dataset(n_windows, seed=seed)
    weights = np.random.default_rng(seed).choice(np.array([0.0, 0.5, 1.0, 2.0], np.float32), size=base.tokens.shape)
    return retro.WeightedDataset(base.tokens, base.labels, weights.astype(np.float32))


def _packed() -> retro.PackedDataset:
    rng = np.random.default_rng(5)
    docs = [rng.integers(0, 512, size=n, dtype=np.int32) for n in (90, 60, 70, 120, 30)]
    return retro.PackedDataset.pack(docs, width=WIDTH)


DATASETS = {
    "tokens": lambda: dataset(2, seed=6),
    "weighted": lambda: _weighted(2),
    "top-k": lambda: _top_k(2),
    "packed": _packed,
}


def _train(model_path, ds, head: str, optimizer=None, accumulation: int = 1):
    with (
        retro.Model.load(model_path, devices=[], trainable=True) as m,
        retro.Context(m, n_ctx=256, n_batch=256, n_ubatch=128, n_threads=1, sequences=8) as c,
        retro.Trainer(c, optimizer=optimizer or retro.SGD(lr=0.25), accumulation=accumulation, head=head) as tr,
    ):
        metrics = tr.epoch(ds)
        return m.parameters(), metrics, target_arrays(c).capacity


@pytest.mark.parametrize("kind", DATASETS)
def test_the_fused_head_trains_every_dataset_as_the_dense_head(model_path, kind):
    with retro.Model.load(model_path, devices=[], trainable=False) as m:
        start = m.parameters()
    ds = DATASETS[kind]()
    dense, m_dense, dense_targets = _train(model_path, ds, "dense")
    fused, m_fused, fused_targets = _train(model_path, ds, "fused")
    assert abs(m_fused.train_loss - m_dense.train_loss) <= LOSS_REL * abs(m_dense.train_loss)
    assert m_fused.train_accuracy == m_dense.train_accuracy  # the best id is the dense row's argmax
    worst = max(nmse(fused[n] - start[n], dense[n] - start[n]) for n in start if np.any(dense[n] != start[n]))
    assert worst <= UPDATE_NMSE, worst
    # neither head fills vocab x tokens floats on the host: k indices and k weights per token, and
    # the fused head its best id
    k = ds.k if isinstance(ds, retro.TopKDataset) else 1
    assert dense_targets == 2 * k * 128 and fused_targets == (2 * k + 1) * 128


def test_the_fused_head_agrees_with_accumulation_and_adamw(model_path):
    ds = _top_k(2)
    runs = [_train(model_path, ds, head, retro.AdamW(lr=1e-3), accumulation=2) for head in retro.training.HEADS]
    (dense, m_dense, *_), (fused, m_fused, *_) = runs
    assert m_dense.optimizer_steps == m_fused.optimizer_steps
    assert abs(m_fused.train_loss - m_dense.train_loss) <= LOSS_REL * abs(m_dense.train_loss)
    # AdamW normalizes the update: compare the weights themselves
    assert max(nmse(fused[n], dense[n]) for n in dense) <= UPDATE_NMSE


def test_an_unknown_head_is_a_value_error_before_any_trainer_exists(ctx):
    with pytest.raises(ValueError, match="head must be one of dense, fused"):
        retro.Trainer(ctx, head="sparse")
    with retro.Trainer(ctx, head="fused") as tr:  # no trainer was left behind by the refusal
        assert tr.head == "fused"


def test_an_unsupported_fused_head_fails_before_anything_is_allocated(model_path):
    """The fault site answers no for the backend: the first step fails with the typed error,
    which names the op and the backend, and nothing was allocated for it (ggml's own counts of
    live contexts and buffers are those before the call); the trainer then trains normally."""
    with (
        retro.Model.load(model_path, devices=[], trainable=True) as m,
        retro.Context(m, n_ctx=256, n_batch=256, n_ubatch=64, n_threads=1) as c,
        retro.Trainer(c, optimizer=retro.SGD(lr=0.1), head="fused") as tr,
    ):
        before = live_allocations()
        fi.arm("fused_head", 1)
        with pytest.raises(retro.UnsupportedHeadError) as err:
            tr.epoch(_top_k(1))
        assert isinstance(err.value, retro.BeforeComputeError)
        assert re.search(r"the fused cross-entropy head needs [A-Z_]+ on CPU", str(err.value)), str(err.value)
        assert live_allocations() == before
        assert tr.iteration == 1 and tr.period_position == 0
        fi.reset()
        assert tr.epoch(_top_k(1)).epoch_complete


def _numpy_loss(ctx: retro.Context, ds: retro.TopKDataset) -> float:
    """numpy's weighted cross-entropy of the context's logits for the dataset's one window."""
    ctx.reset()
    z = ctx.decode(ds.tokens[0]).astype(np.float64)
    ctx.reset()
    z -= z.max(axis=1, keepdims=True)
    log_p = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    picked = np.take_along_axis(log_p, ds.ids[0].astype(np.int64), axis=1)
    return float(-(ds.weights[0].astype(np.float64) * picked).sum(axis=1).mean())


@pytest.mark.parametrize("head", retro.training.HEADS)
def test_each_heads_gradient_matches_central_finite_differences(model_path, head):
    """The gradient one SGD step applied (the update over the rate) against central differences of
    numpy's loss over the model's decoded logits, along the step's own direction and along a
    random one (measured: relative 4e-4 on both heads; the fused head's gradient was orders of
    magnitude off before fork patch 0031)."""
    ds, eta, eps = _one_window(), 1e-3, 1e-2
    with (
        retro.Model.load(model_path, devices=[], trainable=True) as m,
        retro.Context(m, n_ctx=256, n_batch=256, n_ubatch=256, n_threads=1) as c,
        retro.Trainer(c, optimizer=retro.SGD(lr=eta), head=head) as tr,
    ):
        start = tr.checkpoint()
        theta = {n: a.astype(np.float64) for n, a in start.parameters.items()}
        tr.epoch(ds)
        grad = {n: (theta[n] - a) / eta for n, a in m.parameters().items()}
        norm = float(np.sqrt(sum(float((g * g).sum()) for g in grad.values())))
        rng = np.random.default_rng(8)
        random = {n: rng.standard_normal(g.shape) * (g != 0) for n, g in grad.items()}  # trained weights only
        scale = float(np.sqrt(sum(float((r * r).sum()) for r in random.values())))
        for direction in ({n: g / norm for n, g in grad.items()}, {n: r / scale for n, r in random.items()}):
            losses = []
            for sign in (1.0, -1.0):
                moved = {n: (theta[n] + sign * eps * direction[n]).astype(np.float32) for n in theta}
                tr.restore(retro.Checkpoint(moved, {}, start.iteration, start.meta))
                losses.append(_numpy_loss(c, ds))
            central = (losses[0] - losses[1]) / (2 * eps)
            analytic = sum(float((grad[n] * direction[n]).sum()) for n in grad)
            assert abs(central - analytic) <= 1e-2 * norm, (head, central, analytic, norm)


def _one_window() -> retro.TopKDataset:
    return _top_k(1, seed=9)


def test_upstreams_loop_refuses_a_fused_trainer_and_a_trainer_keeps_its_head(model_path):
    """Upstream's llama_opt_epoch (the oracle) fills dense labels: on a fused trainer it is refused
    with a typed error before anything runs, and the trainer then trains on; ggml-opt lays its
    loss accumulator out for the first graph, so a trainer keeps the head it was built with."""
    from retro.testing import upstream_epoch

    ds = dataset(1, seed=10)
    with (
        retro.Model.load(model_path, devices=[], trainable=True) as m,
        retro.Context(m, n_ctx=256, n_batch=256, n_ubatch=64, n_threads=1) as c,
        retro.Trainer(c, optimizer=retro.SGD(lr=0.1), head="fused") as tr,
    ):
        before = m.parameters()
        with pytest.raises(retro.InvalidStateError, match="dense head only"):
            upstream_epoch(tr, ds)
        assert all(np.array_equal(before[n], a) for n, a in m.parameters().items())
        assert tr.epoch(ds).epoch_complete and target_arrays(c).capacity == 3 * 64
        with pytest.raises(retro.InvalidStateError, match="keeps the loss head"):
            tr._h.set_head(False)
        assert tr.epoch(ds).epoch_complete
