"""Cancellation (seed 000, "Cancellation"): the caller's progress callback returning False stops
the loop after that micro-batch. Exercised at every micro-batch of an epoch (HARNESS-03)."""

from __future__ import annotations

import pytest

import fault_injection as fi
import retro
from conformance import support

WINDOWS_TRAIN, WINDOWS_EVAL, UBATCH = 2, 1, 64
PER_WINDOW = 256 // UBATCH


def _stop_at(k: int, seen: list[retro.Progress], *, train: bool = True):
    def progress(p: retro.Progress) -> bool:
        seen.append(p)
        return not (p.train == train and p.done == k)

    return progress


@pytest.mark.clause("CANCEL-02", "CANCEL-05", "CANCEL-06")
def test_cancel_at_every_micro_batch_runs_exactly_that_many(backend, model_path, seed):
    """Cancelling at train micro-batch k, for every k of the epoch: exactly k computes ran, the
    evaluation tail was skipped (no eval callback, no eval metrics), and the metrics count the k
    micro-batches, their optimizer steps and tokens, with epoch_complete = False. Cancelling at
    evaluation micro-batch j: the training and exactly j evaluation micro-batches ran."""
    n_train, n_eval = WINDOWS_TRAIN * PER_WINDOW, WINDOWS_EVAL * PER_WINDOW
    with support.load(backend, model_path) as model, support.context(model, n_ubatch=UBATCH) as ctx:
        ds = support.windows(WINDOWS_TRAIN + WINDOWS_EVAL, 256, model.n_vocab, seed + 10)
        frac = WINDOWS_EVAL / (WINDOWS_TRAIN + WINDOWS_EVAL)
        with retro.Trainer(ctx, optimizer=retro.SGD(lr=0.01), accumulation=1) as tr:
            for k in range(1, n_train + 1):
                seen: list[retro.Progress] = []
                fi.reset()
                m = tr.epoch(ds, val_fraction=frac, progress=_stop_at(k, seen))
                assert fi.hits("compute") == k, f"cancel at {k}: {fi.hits('compute')} computes ran"
                assert [p.done for p in seen] == list(range(1, k + 1)) and all(p.train for p in seen), \
                    f"cancel at {k}: callbacks {seen}"
                assert m.eval_micro_batches == 0 and m.eval_loss is None and m.eval_accuracy is None
                assert (m.train_micro_batches, m.optimizer_steps) == (k, k), f"cancel at {k}: {m}"
                assert m.logical_tokens == m.physical_tokens == k * UBATCH
                assert m.epoch_complete is False
            for j in range(1, n_eval + 1):
                fi.reset()
                m = tr.epoch(ds, val_fraction=frac, progress=_stop_at(j, [], train=False))
                assert fi.hits("compute") == n_train + j, f"cancel at eval {j}: {fi.hits('compute')} computes ran"
                assert (m.train_micro_batches, m.eval_micro_batches, m.optimizer_steps) == (n_train, j, n_train)
                assert m.logical_tokens == m.physical_tokens == (n_train + j) * UBATCH
                assert m.eval_loss is not None and m.epoch_complete is (j == n_eval)


@pytest.mark.clause("CANCEL-03")
def test_the_finished_micro_batch_stays_applied(backend, model_path, seed):
    """Parameters after a cancel at micro-batch k equal those of an uncancelled run over the same
    k micro-batches (one window per micro-batch, so the prefix is a dataset of its own)."""
    with support.load(backend, model_path, trainable=False) as probe:
        ds = support.windows(4, 256, probe.n_vocab, seed + 11)
    sgd = retro.SGD(lr=0.05)
    for k in range(1, 4):
        with support.load(backend, model_path) as model, support.context(model) as ctx:
            with retro.Trainer(ctx, optimizer=sgd) as tr:
                tr.epoch(ds, progress=_stop_at(k, []))  # the counts are CANCEL-02/06's; here, the parameters
            cancelled = model.parameters()
        with support.load(backend, model_path) as model, support.context(model) as ctx:
            with retro.Trainer(ctx, optimizer=sgd) as tr:
                assert tr.epoch(support.subset(ds, slice(0, k))).epoch_complete
            reference = model.parameters()
        support.assert_params_equal(cancelled, reference, backend, f"cancelled at {k} vs the first {k} micro-batches")


@pytest.mark.clause("CANCEL-04")
def test_an_incomplete_period_never_reaches_a_later_call(backend, model_path, seed):
    """Accumulation 2, cancelled after the first micro-batch of the second period: that
    micro-batch's gradient is discarded. A later call then equals a run that never saw it."""
    with support.load(backend, model_path, trainable=False) as probe:
        ds = support.windows(5, 256, probe.n_vocab, seed + 12)
    sgd = retro.SGD(lr=0.05)
    first, discarded, later = support.subset(ds, slice(0, 2)), support.subset(ds, slice(0, 3)), support.subset(ds, slice(3, 5))
    with support.load(backend, model_path) as model, support.context(model) as ctx:
        with retro.Trainer(ctx, optimizer=sgd, accumulation=2) as tr:
            tr.epoch(discarded, progress=_stop_at(3, []))
            position_after_cancel = tr.period_position
            tr.epoch(later)
        cancelled = model.parameters()
    with support.load(backend, model_path) as model, support.context(model) as ctx:
        with retro.Trainer(ctx, optimizer=sgd, accumulation=2) as tr:
            tr.epoch(first)
            tr.epoch(later)
        reference = model.parameters()
    support.assert_params_equal(cancelled, reference, backend, "after a discarded period vs never seeing it")
    assert position_after_cancel == 0, "a partial accumulation period survived the cancel"


@pytest.mark.clause("CANCEL-01")
def test_an_upstream_epoch_callback_is_called_and_false_requests_one_stop(backend, model_path, seed):
    """A C-level callback with upstream ggml's ggml_opt_epoch_callback signature is called after
    every micro-batch with its arguments; a progress callback returning False makes exactly one
    llama_opt_request_stop, and a run that is not cancelled makes none."""
    calls: list[tuple[bool, int, int, bool, bool]] = []

    @retro.EpochCallback
    def c_callback(train, opt_ctx, dataset, result, ibatch, ibatch_max, t_start_us):
        calls.append((bool(train), int(ibatch), int(ibatch_max), bool(opt_ctx), bool(result)))

    n_train, n_eval = WINDOWS_TRAIN * PER_WINDOW, WINDOWS_EVAL * PER_WINDOW
    with support.load(backend, model_path) as model, support.context(model, n_ubatch=UBATCH) as ctx:
        ds = support.windows(WINDOWS_TRAIN + WINDOWS_EVAL, 256, model.n_vocab, seed + 13)
        frac = WINDOWS_EVAL / (WINDOWS_TRAIN + WINDOWS_EVAL)
        with retro.Trainer(ctx, optimizer=retro.SGD(lr=0.01)) as tr:
            fi.reset()
            tr.epoch(ds, val_fraction=frac, progress=lambda p: True, epoch_callback=c_callback)
            assert calls == [(True, i, n_train, True, True) for i in range(1, n_train + 1)] + \
                [(False, j, n_eval, True, True) for j in range(1, n_eval + 1)]
            assert fi.hits("stop_request") == 0
            for k in (1, 3):
                calls.clear()
                fi.reset()
                tr.epoch(ds, val_fraction=frac, progress=_stop_at(k, []), epoch_callback=c_callback)
                assert [c[1] for c in calls] == list(range(1, k + 1))
                assert fi.hits("stop_request") == 1, f"cancel at {k}: {fi.hits('stop_request')} stop requests"


@pytest.mark.clause("CANCEL-07")
def test_the_limiter_drops_its_debt_on_the_way_out(backend, model_path, seed):
    """With duty cycle < 1 the limiter sleeps before each next compute; a cancel (or the end of
    the call) drops the debt instead of sleeping it."""
    with support.load(backend, model_path) as model, support.context(model, n_ubatch=UBATCH) as ctx:
        ds = support.windows(WINDOWS_TRAIN, 256, model.n_vocab, seed + 14)
        n_train = WINDOWS_TRAIN * PER_WINDOW
        for duty, k in ((0.05, 1), (0.5, 3), (0.5, n_train)):
            with retro.Trainer(ctx, optimizer=retro.SGD(lr=0.01), duty_cycle=duty) as tr:
                fi.reset()
                m = tr.epoch(ds, progress=_stop_at(k, []))
                assert m.train_micro_batches == k
                assert fi.hits("limiter_sleep") == k - 1, f"duty {duty}, stop at {k}: {fi.hits('limiter_sleep')} sleeps"
                assert (m.throttle_s > 0) == (k > 1)


@pytest.mark.clause("CANCEL-08")
def test_the_callback_scope_is_restored_on_every_exit(backend, model_path, seed):
    """An epoch call nested in another's progress callback ends by return, cancel, native error or
    callback exception: the outer call's callbacks still reach the outer progress, and later calls
    without a progress callback reach none."""

    class Boom(Exception):
        pass

    with support.load(backend, model_path) as m_outer, support.context(m_outer, n_ubatch=UBATCH) as c_outer, \
            support.load(backend, model_path) as m_inner, support.context(m_inner, n_ubatch=UBATCH) as c_inner, \
            retro.Trainer(c_outer, optimizer=retro.SGD(lr=0.01)) as outer, \
            retro.Trainer(c_inner, optimizer=retro.SGD(lr=0.01)) as inner:
        ds = support.windows(1, 256, m_outer.n_vocab, seed + 15)
        expected_inner = {"return": [1, 2, 3, 4], "cancel": [1], "native error": [1], "exception": [1]}
        for exit_kind, want in expected_inner.items():
            outer_calls: list[int] = []
            inner_calls: list[int] = []

            def inner_progress(p: retro.Progress) -> bool:
                inner_calls.append(p.done)
                if exit_kind == "exception":
                    raise Boom()
                return exit_kind != "cancel"

            def outer_progress(p: retro.Progress) -> bool:
                outer_calls.append(p.done)
                if p.done == 1:
                    if exit_kind == "native error":
                        fi.arm("graph_build", 2)  # the inner call's second micro-batch
                    try:
                        inner.epoch(ds, progress=inner_progress)
                    except (Boom, retro.GraphBuildError):
                        pass
                return True

            outer.epoch(ds, progress=outer_progress)
            fi.reset()
            assert outer_calls == [1, 2, 3, 4], f"{exit_kind}: the outer progress saw {outer_calls}"
            assert inner_calls == want, f"{exit_kind}: the inner progress saw {inner_calls}"
            outer_calls.clear()
            inner_calls.clear()
            inner.epoch(ds)
            outer.epoch(ds)
            assert outer_calls == inner_calls == [], f"{exit_kind}: a call without progress reached {outer_calls or inner_calls}"
