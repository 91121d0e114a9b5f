"""Training through the native loop: learning, metrics, accumulation, progress and cancellation,
and validation of every argument before anything native changes."""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import retro
from conftest import dataset


def test_adamw_learns_a_repeating_sequence(ctx):
    pattern = np.tile(np.arange(32), 40)[: 4 * 256 + 1]
    ds = retro.TokenDataset.from_tokens(pattern, width=256)
    with retro.Trainer(ctx, optimizer=retro.AdamW(lr=3e-3)) as tr:
        first = tr.epoch(ds)
        for _ in range(6):
            last = tr.epoch(ds)
    assert last.train_loss < first.train_loss - 1.0, (first.train_loss, last.train_loss)
    assert last.train_accuracy > first.train_accuracy


def test_metrics_count_what_ran(ctx):
    ds = dataset(4)
    with retro.Trainer(ctx, optimizer=retro.SGD(lr=0.01), accumulation=2) as tr:
        m = tr.epoch(ds, val_fraction=0.25)
    # 3 train windows x 4 micro-batches of 64, 1 eval window
    assert (m.train_micro_batches, m.eval_micro_batches) == (12, 4)
    assert m.optimizer_steps == 6
    assert m.logical_tokens == m.physical_tokens == 16 * 64
    assert m.epoch_complete and m.eval_loss is not None and math.isfinite(m.eval_loss)
    assert 0.0 <= m.train_accuracy <= 1.0 and m.elapsed_s > 0


def test_training_in_micro_batches_shorter_than_the_window_is_said_once(ctx, model):
    """llama.cpp's micro-batch gradient (the earlier micro-batches' keys and values as constants)
    is told once per trainer, as a warning a caller can filter, and in every epoch's metrics; a
    window trained whole is not."""
    with retro.Trainer(ctx, optimizer=retro.SGD(lr=0.01)) as tr:
        with pytest.warns(retro.MicroBatchGradientWarning, match="micro-batches of 64") as told:
            first = tr.epoch(dataset(1))
            second = tr.epoch(dataset(1))
        assert len([w for w in told if w.category is retro.MicroBatchGradientWarning]) == 1
        assert first.split_windows and second.split_windows
    with retro.Context(model, n_ctx=256, n_batch=256, n_ubatch=256) as whole:
        with retro.Trainer(whole, optimizer=retro.SGD(lr=0.01)) as tr:
            with warnings.catch_warnings():
                warnings.simplefilter("error", retro.MicroBatchGradientWarning)
                assert not tr.epoch(dataset(1)).split_windows


def test_a_partial_period_carries_into_the_next_call(ctx):
    ds = dataset(1)  # 4 micro-batches
    with retro.Trainer(ctx, optimizer=retro.SGD(lr=0.01), accumulation=3) as tr:
        assert tr.epoch(ds).optimizer_steps == 1
        assert tr.period_position == 1
        assert tr.epoch(ds).optimizer_steps == 1
        assert tr.period_position == 2


def test_progress_is_called_after_every_micro_batch(ctx):
    seen = []
    with retro.Trainer(ctx) as tr:
        tr.epoch(dataset(2), val_fraction=0.5, progress=lambda p: seen.append(p))
    assert seen == [retro.Progress(True, k, 4) for k in range(1, 5)] + [
        retro.Progress(False, k, 4) for k in range(1, 5)
    ]


def test_a_callback_exception_cancels_and_propagates(ctx):
    class Boom(Exception):
        pass

    def progress(p):
        if p.done == 3:
            raise Boom("from the callback")

    with retro.Trainer(ctx, optimizer=retro.SGD(lr=0.01)) as tr:
        with pytest.raises(Boom):
            tr.epoch(dataset(1), progress=progress)
        assert tr.iteration == 4  # three steps applied, none after
        assert tr.epoch(dataset(1)).epoch_complete


def test_a_non_bool_progress_result_is_a_type_error(ctx):
    with retro.Trainer(ctx) as tr, pytest.raises(TypeError, match="bool or None"):
        tr.epoch(dataset(1), progress=lambda p: 1)


def test_one_trainer_per_context(ctx, model_path):
    tr = retro.Trainer(ctx)
    with pytest.raises(retro.InvalidStateError):
        retro.Trainer(ctx)
    tr.close()
    with pytest.raises(retro.InvalidStateError):
        tr.epoch(dataset(1))
    retro.Trainer(ctx).close()
    with retro.Model.load(model_path, devices=[]) as ro, retro.Context(ro) as c2:
        with pytest.raises(ValueError, match="trainable=True"):
            retro.Trainer(c2)


# the context is shared across examples on purpose: a rejected trainer must leave it untouched
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lr=st.one_of(st.floats(max_value=0.0), st.just(math.nan), st.just(math.inf), st.booleans(), st.text(max_size=2)),
    which=st.sampled_from(["adamw", "sgd"]),
)
def test_bad_learning_rates_are_rejected(ctx, lr, which):
    opt = retro.AdamW(lr=lr) if which == "adamw" else retro.SGD(lr=lr)
    with pytest.raises((ValueError, TypeError)):
        retro.Trainer(ctx, optimizer=opt)
    assert not ctx._h.has_trainer


@pytest.mark.parametrize(
    "opt",
    [
        retro.AdamW(beta1=1.5),
        retro.AdamW(beta2=-0.1),
        retro.AdamW(eps=-1.0),
        retro.AdamW(weight_decay=2.0),
        retro.SGD(weight_decay=-0.5),
    ],
)
def test_bad_optimizer_settings_are_rejected(ctx, opt):
    with pytest.raises(ValueError):
        retro.Trainer(ctx, optimizer=opt)


@pytest.mark.parametrize(
    "acc, exc", [(0, ValueError), (-1, ValueError), (2**31, OverflowError), (True, TypeError), (1.0, TypeError)]
)
def test_bad_accumulation_is_rejected(ctx, acc, exc):
    with pytest.raises(exc):
        retro.Trainer(ctx, accumulation=acc)


def test_token_dataset_windows_and_labels():
    ds = retro.TokenDataset.from_tokens(np.arange(10), width=4, stride=3)
    assert ds.tokens.tolist() == [[0, 1, 2, 3], [3, 4, 5, 6]]
    assert ds.labels.tolist() == [[1, 2, 3, 4], [4, 5, 6, 7]]
    with pytest.raises(ValueError):
        retro.TokenDataset.from_tokens(np.arange(4), width=4)
    with pytest.raises(TypeError):
        retro.TokenDataset.from_tokens(np.zeros(10), width=4)
    with pytest.raises(OverflowError):
        retro.TokenDataset.from_tokens(np.array([2**40] * 10), width=4)


def test_sgd_step_moves_weights_by_lr_times_gradient(ctx):
    """One SGD step from fresh accumulators: the update equals -lr times the gradient, which is
    the same for two learning rates up to the factor (no hidden accumulation)."""
    ds = dataset(1, seed=7)
    deltas = []
    for lr in (0.01, 0.02):
        with (
            retro.Model.load(ctx.model.path, devices=[], trainable=True) as m,
            retro.Context(m, n_ctx=256, n_ubatch=256) as c,
        ):
            w0 = m.tensor("output.weight")
            with retro.Trainer(c, optimizer=retro.SGD(lr=lr)) as tr:
                tr.epoch(ds)
            deltas.append(m.tensor("output.weight") - w0)
    np.testing.assert_allclose(deltas[1], 2 * deltas[0], rtol=1e-3, atol=1e-7)


def test_duty_cycle_and_epoch_callback_are_validated(ctx):
    for bad in (0.0, -0.5, 1.5, math.nan):
        with pytest.raises(ValueError):
            retro.Trainer(ctx, duty_cycle=bad)
    with retro.Trainer(ctx, duty_cycle=0.5) as tr:
        with pytest.raises(TypeError, match="EpochCallback"):
            tr.epoch(dataset(1), epoch_callback=lambda *a: None)
        m = tr.epoch(dataset(1))
        assert m.throttle_s > 0 and m.epoch_complete


def test_checkpoints_round_trip_and_are_taken_at_a_boundary(ctx, tmp_path):
    with retro.Trainer(ctx, accumulation=3) as tr:
        tr.epoch(dataset(1))  # 4 micro-batches: one step, one into the next period
        with pytest.raises(retro.InvalidStateError, match="boundary"):
            tr.checkpoint()
    with retro.Trainer(ctx, accumulation=2) as tr:
        tr.epoch(dataset(1))
        ckpt = tr.checkpoint()
    assert ckpt.iteration == 3 and "output.weight" in ckpt.moments and "token_embd.weight" not in ckpt.moments
    loaded = retro.Checkpoint.load(ckpt.save(tmp_path / "c.npz"))
    assert loaded.iteration == ckpt.iteration and loaded.meta == ckpt.meta
    assert all(np.array_equal(loaded.parameters[n], a) for n, a in ckpt.parameters.items())
    assert all(np.array_equal(loaded.moments[n][1], mv[1]) for n, mv in ckpt.moments.items())


def test_a_mismatched_checkpoint_is_rejected_before_anything_is_written(ctx):
    with retro.Trainer(ctx) as tr:
        tr.epoch(dataset(1))
        good = tr.checkpoint()
        before = ctx.model.tensor("output.weight")
        bad_shape = dict(good.parameters, **{"output.weight": np.zeros((3, 3), np.float32)})
        bad_type = dict(good.parameters, **{"output.weight": good.parameters["output.weight"].astype(np.float64)})
        missing = {n: a for n, a in good.parameters.items() if n != "output.weight"}
        for params in (bad_shape, bad_type, missing):
            with pytest.raises(ValueError):
                tr.restore(retro.Checkpoint(params, good.moments, good.iteration))
        with pytest.raises(OverflowError):
            tr.restore(retro.Checkpoint(good.parameters, good.moments, 2**63))
        assert np.array_equal(ctx.model.tensor("output.weight"), before)


def test_a_schedule_sets_the_rate_of_each_step(model_path):
    """Steps taken under a schedule equal the same steps each taken by a trainer whose fixed rate
    is the one the schedule gave that step."""
    rates = [0.05, 0.01, 0.2]
    data = dataset(3)

    def train(windows: slice, **kw) -> dict[str, np.ndarray]:
        with retro.Model.load(model_path, devices=[], trainable=True) as m, retro.Context(m, n_ubatch=256) as c:
            with retro.Trainer(c, **kw) as tr:
                assert tr.epoch(retro.TokenDataset(data.tokens[windows], data.labels[windows])).optimizer_steps
            return m.parameters()

    asked: list[tuple[int, int]] = []

    def schedule(step: int, horizon: int) -> float:
        asked.append((step, horizon))
        return rates[step]

    scheduled = train(slice(0, 3), optimizer=retro.SGD(lr=1.0), schedule=schedule, horizon=3)
    assert asked == [(0, 3), (1, 3), (2, 3)]
    with retro.Model.load(model_path, devices=[], trainable=True) as m, retro.Context(m, n_ubatch=256) as c:
        for k, rate in enumerate(rates):
            with retro.Trainer(c, optimizer=retro.SGD(lr=rate)) as tr:
                tr.epoch(retro.TokenDataset(data.tokens[k : k + 1], data.labels[k : k + 1]))
        fixed = m.parameters()
    for name in fixed:
        assert np.array_equal(scheduled[name], fixed[name]), name


@pytest.mark.parametrize("n_ubatch", [32, 256])
def test_a_deep_model_trains_in_micro_batches_smaller_than_the_window(tmp_path, n_ubatch):
    """A 12-layer model, with micro-batches through the KV cache (32 of a 256-token window) and
    without (the whole window): the backward and optimizer graphs fit the graph budget (fork patch
    0040; the KV-cache path aborted in ggml's backward expansion), and the loss goes down."""
    from retro.testing import TinyLlamaSpec, write_tiny_llama

    path = write_tiny_llama(tmp_path / "deep.gguf", TinyLlamaSpec(n_layer=12))
    with (
        retro.Model.load(path, devices=[], trainable=True) as m,
        retro.Context(m, n_ctx=256, n_batch=256, n_ubatch=n_ubatch) as c,
        retro.Trainer(c, optimizer=retro.AdamW(lr=1e-3)) as tr,
    ):
        ds = dataset(2)
        first = tr.epoch(ds).train_loss
        assert tr.epoch(ds).train_loss < first


LAST_REFERENCE = """
import gc, sys, retro, retro._handle
with retro.Model.load(sys.argv[1], devices=[], trainable=True) as m:
    ctx = retro.Context(m, n_ctx=256, n_threads=1)
    tr = retro.Trainer(ctx, optimizer=retro.SGD(lr=0.1))
    vars(ctx).clear()  # as the cycle collector may clear a context before its trainer goes
    gc.collect()
    tr.close()  # the trainer held the native context last
    retro._handle._open.discard(ctx)  # a context cleared by hand is not closed again at exit
    print("closed")
"""


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed")
def test_a_trainer_holding_its_context_last_frees_it_after_its_own_call(model_path):
    """A garbage cycle may clear a context's reference to its native handle before its trainer
    goes: the trainer then holds the native context last, and closing the trainer frees it only
    once the trainer's own guarded call on it has ended. Under valgrind, no invalid access from
    retro's libraries (the guard once unlocked the freed context's mutex)."""
    run = subprocess.run(
        ["valgrind", "--leak-check=no", "-q", sys.executable, "-c", LAST_REFERENCE, str(model_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0 and run.stdout.strip() == "closed", run.stderr[-3000:]
    # valgrind's reports, one per blank report line; the loader's own (ld.so reading past a string
    # it owns) name none of retro's libraries
    reports = re.split(r"^==\d+== ?$", run.stderr, flags=re.M)
    ours = [r for r in reports if "Invalid" in r and re.search(r"_native|libllama|libggml", r)]
    assert not ours, ours[0][-3000:]
