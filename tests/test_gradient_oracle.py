"""The oracle of the training math (retro.testing.reference: the tiny llama in float64 numpy, read
from the GGUF file by the gguf package, differentiated by autograd) held to account, so that the
conformance checks that trust it (BASE-01, HOST-08: conformance/cases/test_base.py) can:
its gradient agrees with central finite differences of its own loss along random directions, per
weight, and its loss is the one the binding reports for the same window, for token, weighted and
top-k targets on both heads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import retro
import retro._checks
from retro.testing import TinyLlamaSpec, reference, write_tiny_llama

SPEC = TinyLlamaSpec(seed=0)
#: autograd's gradient along a direction against the central difference, relative to the
#: gradient's norm (measured below 1e-8: the difference's own truncation and rounding)
DIRECTIONAL_REL = 1e-6
#: the binding's float32 loss against numpy's float64 one (measured at most 2e-7)
LOSS_REL = 1e-5


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("oracle") / "tiny.gguf"
    write_tiny_llama(path, SPEC)
    return path


@pytest.mark.parametrize("kind", ["token", "weighted", "top-k"])
def test_the_gradient_agrees_with_central_differences(model: Path, kind: str) -> None:
    weights, heads = reference.read_weights(model), reference.read_heads(model)
    rng = np.random.default_rng(3)
    targets = reference.random_targets(kind, 1, SPEC.n_ctx, SPEC.n_vocab, rng)
    tokens, rows = targets.tokens[0], targets.rows(0, SPEC.n_vocab)
    grads = reference.gradient(weights, tokens, rows, **heads)
    assert grads.keys() == weights.keys()
    for name in ("blk.0.attn_q.weight", "blk.1.attn_k.weight", "blk.0.ffn_gate.weight", "output_norm.weight"):
        direction = rng.standard_normal(weights[name].shape)
        direction /= np.linalg.norm(direction)
        numeric = reference.directional_derivative(weights, name, direction, tokens, rows, **heads)
        error = abs(float((grads[name] * direction).sum()) - numeric) / float(np.linalg.norm(grads[name]))
        assert error <= DIRECTIONAL_REL, f"{name}: {error:.2e} of the gradient's norm"


@pytest.mark.parametrize("head", ["dense", "fused"])
@pytest.mark.parametrize("kind", ["token", "weighted", "top-k"])
def test_the_loss_is_the_one_the_binding_reports(model: Path, kind: str, head: str) -> None:
    weights, heads = reference.read_weights(model), reference.read_heads(model)
    targets = reference.random_targets(kind, 1, SPEC.n_ctx, SPEC.n_vocab, np.random.default_rng(5))
    with (
        retro.Model.load(model, devices=[], trainable=True) as m,
        retro.Context(m, n_ctx=SPEC.n_ctx, n_batch=SPEC.n_ctx, n_ubatch=SPEC.n_ctx, n_threads=1) as ctx,
        retro.Trainer(ctx, optimizer=retro.SGD(lr=1e-3), head=head) as trainer,
    ):
        metrics = trainer.epoch(targets.dataset())
    want = reference.loss(weights, targets.tokens[0], targets.rows(0, SPEC.n_vocab), **heads)
    assert metrics.train_loss == pytest.approx(want, rel=LOSS_REL)


#: BASE-01's CPU limit in micro-batches (the F16 KV cache): conformance/cases/test_base.py
MICRO_BATCH_REL = 2e-3


def test_a_grouped_query_model_trains_in_micro_batches_with_numpys_gradient(tmp_path: Path) -> None:
    """Fewer KV heads than query heads, trained in micro-batches shorter than the window: the
    gradient of Q is an outer product of the F16 K read back from the KV cache, broadcast over
    the query heads (vendor/patches/0059); each weight's accumulated gradient is numpy's, with K
    and V held constant as the KV cache holds them."""
    spec = TinyLlamaSpec(seed=2, n_head=4, n_head_kv=2)
    path = write_tiny_llama(tmp_path / "gqa.gguf", spec)
    weights, heads = reference.read_weights(path), reference.read_heads(path)
    targets = reference.random_targets("token", 1, spec.n_ctx, spec.n_vocab, np.random.default_rng(7))
    with (
        retro.Model.load(path, devices=[], trainable=True) as m,
        retro.Context(m, n_ctx=spec.n_ctx, n_batch=spec.n_ctx, n_ubatch=spec.n_ctx // 4, n_threads=1) as ctx,
        retro.Trainer(ctx, optimizer=retro.SGD(lr=1e-3), accumulation=4) as trainer,
    ):
        trainer.epoch(targets.dataset())  # one period of 4 micro-batches: the window's gradient
        got = {n: trainer.gradient_accumulator(n) for n in weights}
    want = reference.gradient(weights, targets.tokens[0], targets.rows(0, spec.n_vocab), **heads, cached_kv=True)
    compared = 0
    for name, g in want.items():
        if got[name] is None or not np.any(g):  # the input layer, and K and V through the cache
            continue
        compared += 1
        assert np.linalg.norm(got[name] - g) / np.linalg.norm(g) <= MICRO_BATCH_REL, name
    assert compared >= 7 * spec.n_layer, compared


@pytest.mark.parametrize("kind", ["token", "weighted", "top-k"])
def test_the_heads_gradient_in_closed_form_is_autograds(model: Path, kind: str) -> None:
    """reference.head_gradient, which BASE-01 holds a step to where the whole gradient costs
    minutes (a real vocabulary and width), is the whole gradient's head, from float32 weights."""
    weights, heads = reference.read_weights(model), reference.read_heads(model)
    targets = reference.random_targets(kind, 1, SPEC.n_ctx, SPEC.n_vocab, np.random.default_rng(11))
    rows = targets.rows(0, SPEC.n_vocab)
    whole = reference.gradient(weights, targets.tokens[0], rows, **heads)
    as_read_back = {n: w.astype(np.float32) for n, w in weights.items()}
    head = reference.head_gradient(as_read_back, targets.tokens[0], rows, **heads)
    assert head.keys() == set(reference.HEAD)
    for name, g in head.items():
        assert np.linalg.norm(g - whole[name]) / np.linalg.norm(whole[name]) <= 1e-12, name


def _head_gradient_error(path: Path, spec: TinyLlamaSpec, head: str, defect: bool) -> float:
    """One SGD step of a window in two micro-batches: output.weight's accumulated gradient against
    numpy's, relative, over the rows of the classes no target names (the softmax's alone)."""
    from retro._native import hooks

    weights, heads = reference.read_weights(path), reference.read_heads(path)
    targets = reference.random_targets("weighted", 1, spec.n_ctx, spec.n_vocab, np.random.default_rng(13))
    hooks.set_defect("BASE-01.class-blocks", defect)
    try:
        with (
            retro.Model.load(path, devices=[], trainable=True) as m,
            retro.Context(m, n_ctx=spec.n_ctx, n_batch=spec.n_ctx, n_ubatch=spec.n_ctx // 2, n_threads=1) as ctx,
            retro.Trainer(ctx, optimizer=retro.SGD(lr=1e-3), accumulation=2, head=head) as trainer,
        ):
            trainer.epoch(targets.dataset())
            got = trainer.gradient_accumulator("output.weight")
    finally:
        hooks.set_defect("BASE-01.class-blocks", False)
    want = reference.head_gradient(weights, targets.tokens[0], targets.rows(0, spec.n_vocab), **heads)["output.weight"]
    unnamed = np.setdiff1d(np.arange(spec.n_vocab), targets.ids[0])
    return float(np.linalg.norm(got[unnamed] - want[unnamed]) / np.linalg.norm(want[unnamed]))


@pytest.mark.skipif(not retro._checks.test_build(), reason="a release build has no seeded-defect switch")
@pytest.mark.parametrize("head", ["dense", "fused"])
def test_the_class_block_defect_shows_only_past_one_block_of_classes(tmp_path: Path, head: str) -> None:
    """The seeded defect BASE-01.class-blocks (the CPU's row softmax in blocks of 16,384 classes,
    never rescaled) is what the realistic profile exists to catch: at the tiny profile's 512
    classes it changes nothing BASE-01's numpy check could see, at a real tokenizer's 32,000 it
    is far past the check's limit, on both heads."""
    small = TinyLlamaSpec(seed=4)
    # narrow, its weights as wide as the realistic profile's logits are spread (std about 0.9)
    large = TinyLlamaSpec(seed=4, vocabulary="llama-spm", n_vocab=32000, n_ctx=64, init_std=0.1)
    small_path = write_tiny_llama(tmp_path / "small.gguf", small)
    large_path = write_tiny_llama(tmp_path / "large.gguf", large)
    assert _head_gradient_error(small_path, small, head, True) == _head_gradient_error(small_path, small, head, False)
    intact = _head_gradient_error(large_path, large, head, False)
    assert intact <= MICRO_BATCH_REL
    assert _head_gradient_error(large_path, large, head, True) > 10 * MICRO_BATCH_REL, intact
