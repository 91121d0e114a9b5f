"""The packed-topology cache against the trainer without it: a stateful property test drives two
trainers in lockstep, one with the cache off, one with it on (ungated: the test door), through epochs, cancels at
any micro-batch, failures at the sites both reach, checkpoints, restores into new trainers and
decodes between them, and holds every parameter bitwise equal after every step (the CPU), with
the same typed errors and the same optimizer cursor. The failure sites the cache skips on a hit
(graph build, graph metadata, allocation) are not drawn: there the two runs would fail at
different micro-batches by design."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import retro
import retro.fault_injection as fi
from conftest import dataset, stateful_settings

PER_EPOCH = 4  # one window of 256 tokens in micro-batches of 64
#: the sites a step reaches whether it runs the entry's graphs or builds its own
BOTH_REACH = ["batch_init", "memory_init", "output_reserve"]


class Twin:
    def __init__(self, model_path, cache, accumulation: int, adamw: bool) -> None:
        self.cache, self.accumulation, self.adamw = cache, accumulation, adamw
        self.model = retro.Model.load(model_path, devices=[], trainable=True)
        self.ctx = retro.Context(self.model, n_ctx=256, n_batch=256, n_ubatch=64)
        self.checkpoint: retro.Checkpoint | None = None
        self.new_trainer()

    def new_trainer(self) -> None:
        optimizer = retro.AdamW(lr=1e-3) if self.adamw else retro.SGD(lr=0.01)
        with fi.ungated_topology_cache() if self.cache else contextlib.nullcontext():
            self.tr = retro.Trainer(
                self.ctx, optimizer=optimizer, accumulation=self.accumulation, topology_cache=bool(self.cache)
            )

    def close(self) -> None:
        self.tr.close()
        self.ctx.close()
        self.model.close()


class CacheEquivalence(RuleBasedStateMachine):
    model_path = None  # set by the test

    @initialize(accumulation=st.sampled_from([1, 2]), adamw=st.booleans())
    def open(self, accumulation: int, adamw: bool) -> None:
        self.twins = [Twin(self.model_path, c, accumulation, adamw) for c in (False, "forced")]
        self.data = dataset(1)
        self.poisoned = False

    def both(self, call):
        """The call on each trainer: its result, or the type of the typed error it raised."""
        out = []
        for t in self.twins:
            try:
                out.append(call(t))
            except retro.RetroError as e:
                out.append(type(e))
        assert out[0] == out[1] or not isinstance(out[0], type), out
        return out

    @precondition(lambda self: not self.poisoned)
    @rule(k=st.integers(1, PER_EPOCH + 1))
    def epoch(self, k: int) -> None:
        def run(t):
            m = t.tr.epoch(self.data, progress=lambda p: p.done < k)
            return m.train_micro_batches, m.train_loss

        self.both(run)

    @precondition(lambda self: not self.poisoned)
    @rule(site=st.sampled_from([*BOTH_REACH, "compute"]), hit=st.integers(1, PER_EPOCH))
    def fail(self, site: str, hit: int) -> None:
        def run(t):
            fi.reset()
            fi.arm(site, hit)
            try:
                return t.tr.epoch(self.data).epoch_complete
            finally:
                fi.reset()

        errors = self.both(run)
        self.poisoned = errors[0] is retro.ComputeError

    @rule()
    def decode(self) -> None:
        def run(t):
            logits = t.ctx.decode(self.data.tokens[0, :8])
            t.ctx.reset()
            return logits.tobytes()

        self.both(run)

    @rule()
    def checkpoint(self) -> None:
        def run(t):
            t.checkpoint = t.tr.checkpoint()
            return t.checkpoint.iteration

        self.both(run)

    @precondition(lambda self: all(t.checkpoint is not None for t in self.twins))
    @rule()
    def restore_into_a_new_trainer(self) -> None:
        def run(t):
            t.tr.close()
            t.new_trainer()
            t.tr.restore(t.checkpoint)
            return t.tr.iteration

        self.both(run)
        self.poisoned = False

    @invariant()
    def the_cache_changes_nothing_observable(self) -> None:
        if not hasattr(self, "twins"):
            return
        off, on = self.twins
        assert (off.tr.iteration, off.tr.poisoned) == (on.tr.iteration, on.tr.poisoned)
        if not off.tr.poisoned:
            assert off.tr.period_position == on.tr.period_position
        a, b = off.model.parameters(), on.model.parameters()
        for name in a:
            assert np.array_equal(a[name].view(np.uint32), b[name].view(np.uint32)), name
        assert not off.tr.topology_cache.enabled and on.tr.topology_cache.enabled

    def teardown(self) -> None:
        fi.reset()
        for t in getattr(self, "twins", []):
            t.close()


def test_the_cache_on_trains_bitwise_as_the_cache_off_under_any_sequence_of_calls(model_path):
    CacheEquivalence.model_path = model_path
    run_state_machine_as_test(
        CacheEquivalence,
        settings=stateful_settings(15, 10),
    )


def test_the_cache_runs_kept_graphs_and_rebuilds_after_each_event(model_path):
    """Counters of one scripted run: the first step misses (no entry), the rest of the epoch hits,
    a decode invalidates, the next epoch misses once, and a trainer without the cache counts
    nothing."""
    with (
        retro.Model.load(model_path, devices=[], trainable=True) as m,
        retro.Context(m, n_ctx=256, n_batch=256, n_ubatch=64) as c,
        fi.ungated_topology_cache(),
        retro.Trainer(c, topology_cache=True) as tr,
    ):
        tr.epoch(dataset(2))
        s = tr.topology_cache
        assert (s.misses, s.hits, s.misses_by["empty"], s.has_entry) == (1, 7, 1, True), s
        c.decode(dataset(1).tokens[0, :8])
        s = tr.topology_cache
        assert (s.invalidations, s.invalidations_by["decode"], s.has_entry, s.last_reason) == (1, 1, False, "decode")
        c.reset()
        tr.epoch(dataset(1))
        assert tr.topology_cache.misses == 2
    with (
        retro.Model.load(model_path, devices=[], trainable=True) as m,
        retro.Context(m, n_ctx=256, n_batch=256, n_ubatch=64) as c,
        retro.Trainer(c) as tr,
    ):
        tr.epoch(dataset(1))
        s = tr.topology_cache
        assert (s.enabled, s.hits, s.misses, s.invalidations) == (False, 0, 0, 0)


@pytest.mark.parametrize("mode", [1, "on", "forced", None, 0.5])
def test_a_bad_topology_cache_mode_is_refused_before_anything_native(model_path, mode):
    with (
        retro.Model.load(model_path, devices=[], trainable=True) as m,
        retro.Context(m, n_ctx=256, n_batch=256, n_ubatch=64) as c,
    ):
        with pytest.raises(ValueError, match="topology_cache"):
            retro.Trainer(c, topology_cache=mode)
        with retro.Trainer(c) as tr:  # nothing was left behind
            assert not tr.topology_cache.enabled


def test_upstreams_loop_on_a_cached_trainer_drops_the_entry_and_trains_as_without_it(model_path):
    """llama_opt_epoch builds and frees graphs of its own: on a trainer with the cache on it ran
    them through the cache's scheduler clone and aborted on an input without a buffer. Now it drops
    the entry (a layout invalidation) and every parameter ends as with the cache off."""
    from retro.testing import upstream_epoch

    params = []
    for cache in (False, "forced"):
        with (
            retro.Model.load(model_path, devices=[], trainable=True) as m,
            retro.Context(m, n_ctx=256, n_batch=256, n_ubatch=64) as c,
            fi.ungated_topology_cache() if cache else contextlib.nullcontext(),
            retro.Trainer(c, optimizer=retro.SGD(lr=0.01), topology_cache=bool(cache)) as tr,
        ):
            tr.epoch(dataset(1, seed=1))
            upstream_epoch(tr, dataset(1, seed=2))
            tr.epoch(dataset(1, seed=3))
            if cache:
                s = tr.topology_cache
                assert (s.invalidations_by["layout"], s.misses_by["empty"], s.has_entry) == (1, 2, True), s
            params.append({name: np.array(a) for name, a in m.parameters().items()})
    assert params[0].keys() == params[1].keys()
    for name in params[0]:
        np.testing.assert_array_equal(params[1][name], params[0][name], err_msg=name)
