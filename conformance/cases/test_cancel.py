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
