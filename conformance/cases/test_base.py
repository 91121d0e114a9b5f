"""Baseline clauses every contract presupposes: BASE-01 (each optimizer step applies exactly its
own accumulation period), BASE-02 (determinism), BASE-03 (read-back and save/reload)."""

from __future__ import annotations

import numpy as np
import pytest

import retro
from conformance import support


def _train(backend, path, ds, *, optimizer, accumulation, calls=1, split=None):
    """Parameters after training a fresh load on ds, in one call or split into calls at `split`."""
    with support.load(backend, path) as model, support.context(model) as ctx:
        with retro.Trainer(ctx, optimizer=optimizer, accumulation=accumulation) as tr:
            parts = [ds] if split is None else [support.subset(ds, slice(0, split)), support.subset(ds, slice(split, None))]
            steps = sum(tr.epoch(p).optimizer_steps for p in parts for _ in range(calls))
        return model.parameters(), steps


@pytest.mark.clause("BASE-01")
@pytest.mark.parametrize("accumulation", [1, 2])
def test_each_step_applies_only_its_own_period(backend, model_path, seed, accumulation):
    """SGD steps taken in one call equal the same steps each taken by a fresh optimizer (whose
    accumulators are certainly zero) from the parameters the previous step left, and equal the
    same steps split over two calls."""
    periods = 3
    sgd = retro.SGD(lr=0.05)
    with support.load(backend, model_path, trainable=False) as probe:
        ds = support.windows(periods * accumulation, 256, probe.n_vocab, seed)

    in_one_call, steps = _train(backend, model_path, ds, optimizer=sgd, accumulation=accumulation)
    assert steps == periods

    # reference: period by period, each with a new trainer on the parameters the last one left
    with support.load(backend, model_path) as model, support.context(model) as ctx:
        before = model.parameters()
        for p in range(periods):
            with retro.Trainer(ctx, optimizer=sgd, accumulation=accumulation) as tr:
                m = tr.epoch(support.subset(ds, slice(p * accumulation, (p + 1) * accumulation)))
                assert m.optimizer_steps == 1
        reference = model.parameters()
    assert support.changed(before, reference), "training changed no parameter"
    support.assert_params_equal(in_one_call, reference, backend,
                                f"{periods} SGD steps in one call vs one fresh optimizer per step")

    split, _ = _train(backend, model_path, ds, optimizer=sgd, accumulation=accumulation, split=accumulation)
    support.assert_params_equal(split, in_one_call, backend, "steps split over two calls vs one call")


@pytest.mark.clause("BASE-02")
def test_same_state_data_and_options_give_same_parameters(backend, model_path, seed):
    """Two runs from the same file, data and options end with the same parameters and losses."""
    with support.load(backend, model_path, trainable=False) as probe:
        ds = support.windows(4, 256, probe.n_vocab, seed + 1)
    runs = []
    for _ in range(2):
        with support.load(backend, model_path) as model, support.context(model) as ctx:
            with retro.Trainer(ctx, optimizer=retro.AdamW(lr=1e-3), accumulation=2) as tr:
                losses = [tr.epoch(ds, val_fraction=0.25).train_loss for _ in range(2)]
            runs.append((model.parameters(), losses))
    (p1, l1), (p2, l2) = runs
    support.assert_params_equal(p2, p1, backend, "second run vs first run")
    if backend.name == "cpu":
        assert l1 == l2, f"losses differ between equal runs: {l1} vs {l2}"
    else:
        np.testing.assert_allclose(l2, l1, rtol=support.GPU_RTOL)


@pytest.mark.clause("BASE-03")
def test_parameters_read_back_equal_the_saved_model(backend, model_path, seed, tmp_path):
    """After training, the parameters read through the binding equal the tensors of the saved GGUF
    (read by the gguf package, not the binding), and reloading that file reads back the same."""
    with support.load(backend, model_path) as model, support.context(model) as ctx:
        ds = support.windows(2, 256, model.n_vocab, seed + 2)
        with retro.Trainer(ctx, optimizer=retro.AdamW(lr=1e-3)) as tr:
            tr.epoch(ds)
        read_back = model.parameters()
        saved = model.save(tmp_path / "trained.gguf")
    support.assert_params_equal(read_back, support.file_tensors(saved), backend, "binding read-back vs the saved file")
    with support.load(backend, saved) as reloaded:
        support.assert_params_equal(reloaded.parameters(), read_back, backend, "reloaded vs before saving")


@pytest.mark.clause("BASE-03")
def test_optimizer_state_read_back_matches_the_step_taken(backend, model_path, seed):
    """After one AdamW step from zero moments, the moments and parameters read back satisfy the
    AdamW update exactly as ggml computes it: m = (1-b1) g, v = (1-b2) g^2,
    w1 = w0 - lr * (m / (1 - b1)) / (sqrt(v / (1 - b2)) + eps)."""
    opt = retro.AdamW(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)
    with support.load(backend, model_path) as model, support.context(model) as ctx:
        ds = support.windows(1, 256, model.n_vocab, seed + 3)
        w0 = model.parameters()
        with retro.Trainer(ctx, optimizer=opt) as tr:
            assert tr.moments("output.weight") is None, "moments exist before the first step"
            assert tr.epoch(ds).optimizer_steps == 1
            assert tr.iteration == 2
            w1 = model.parameters()
            trained = {n: tr.moments(n) for n in w0}
    # w0 read back must be the file's tensors (read by the gguf package), or the relation proves nothing
    support.assert_params_equal(w0, support.file_tensors(model_path), backend, "read-back vs the model file")
    trained = {n: mv for n, mv in trained.items() if mv is not None}
    assert "token_embd.weight" not in trained  # never trained by the pinned llama.cpp
    assert {"output.weight", "blk.0.attn_k.weight", "blk.1.ffn_down.weight"} <= trained.keys()
    for name, (m, v) in trained.items():
        assert m.shape == w0[name].shape and v.shape == w0[name].shape, f"{name}: moment shapes"
        g = m / (1 - opt.beta1)
        np.testing.assert_allclose(v, (1 - opt.beta2) * g * g, rtol=1e-4, atol=1e-30, err_msg=f"{name}: v vs m")
        step = opt.lr * (m / (1 - opt.beta1)) / (np.sqrt(v / (1 - opt.beta2)) + opt.eps)
        np.testing.assert_allclose(w1[name], w0[name] - step, rtol=0, atol=1e-6, err_msg=f"{name}: w1 vs w0 - step")
        assert np.any(m != 0), f"{name}: all-zero first moment after a step"
