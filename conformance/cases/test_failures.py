"""Failures (seed 000, "Failures"), forced at every site by the fault hooks (HARNESS-02):
before-compute failures abandon the step and leave the trainer usable; a backend compute failure
poisons it."""

from __future__ import annotations

import numpy as np
import pytest

import fault_injection as fi
import retro
from conformance import support

# site -> (its FAIL-04 sub-clause, the error class, a line the native library logs for it)
BEFORE_COMPUTE = {
    "batch_init": ("FAIL-04a", retro.BatchInitError, "failed to initialize batch"),
    "memory_init": ("FAIL-04b", retro.MemoryInitError, "could not initialize the memory"),
    "output_reserve": ("FAIL-04c", retro.OutputReserveError, "could not reserve space"),
    "graph_build": ("FAIL-04d", retro.GraphBuildError, "failed to build the training graph"),
    "alloc": ("FAIL-04e", retro.AllocationError, "failed to allocate the training graph"),
}
SITES = {**{s: v[1:] for s, v in BEFORE_COMPUTE.items()}, "compute": (retro.ComputeError, "backend compute failed")}


def _trainer(ctx: retro.Context, accumulation: int = 1) -> retro.Trainer:
    return retro.Trainer(ctx, optimizer=retro.SGD(lr=0.05), accumulation=accumulation)


@pytest.mark.clause("FAIL-01")
def test_each_failure_is_its_own_class_with_the_native_diagnostic(backend, model_path, seed):
    with support.load(backend, model_path, trainable=False) as probe:
        ds = support.windows(1, 256, probe.n_vocab, seed + 20)
    for site, (cls, diagnostic) in SITES.items():
        with support.load(backend, model_path) as model, support.context(model, n_ubatch=64) as ctx, _trainer(ctx) as tr:
            fi.reset()
            fi.arm(site, 2)
            with pytest.raises(retro.RetroError) as err:
                tr.epoch(ds)
            assert type(err.value) is cls, f"{site}: raised {type(err.value).__name__}, expected {cls.__name__}"
            assert diagnostic in str(err.value), f"{site}: no native diagnostic in {str(err.value)!r}"


@pytest.mark.clause("FAIL-02", "FAIL-03")
@pytest.mark.parametrize("site", ["alloc", "compute"])
def test_a_failed_step_publishes_nothing_and_the_cursor_stays(backend, model_path, seed, site):
    """Failing micro-batch k: the progress callback saw only 1..k-1, and the optimizer iteration
    is the one the last completed step left (accumulation 1: one step per micro-batch)."""
    with support.load(backend, model_path, trainable=False) as probe:
        ds = support.windows(2, 256, probe.n_vocab, seed + 21)
    for k in (1, 3, 8):
        with support.load(backend, model_path) as model, support.context(model, n_ubatch=64) as ctx, _trainer(ctx) as tr:
            seen: list[int] = []
            fi.reset()
            fi.arm(site, k)
            with pytest.raises(retro.TrainingError):
                tr.epoch(ds, progress=lambda p: seen.append(p.done))
            assert seen == list(range(1, k)), f"{site} at {k}: callbacks for {seen}"
            assert tr.iteration == k, f"{site} at {k}: cursor {tr.iteration}, last completed step leaves {k}"


def _check_state_dropped(backend, model_path, seed, site):
    """Failing the second micro-batch of an accumulation period of 2 (the first one has left a
    gradient and 64 positions in the KV cache): the accumulators are zero, the period restarts,
    the sequence state is empty, and the trainer's next call completes."""
    with support.load(backend, model_path, trainable=False) as probe:
        ds = support.windows(1, 256, probe.n_vocab, seed + 22)
    with support.load(backend, model_path) as model, support.context(model, n_ubatch=64) as ctx, _trainer(ctx, 2) as tr:
        fi.arm(site, 2)
        with pytest.raises(retro.BeforeComputeError):
            tr.epoch(ds)
        assert fi.failures(site) == 1
        assert tr.period_position == 0, "the partial period survived"
        assert ctx.sequence_length == 0, f"{ctx.sequence_length} positions left in the KV cache"
        accs = {n: tr.gradient_accumulator(n) for n in model.tensor_names()}
        live = [n for n, a in accs.items() if a is not None]
        assert live, "no accumulator exists after a backward pass"
        nonzero = [n for n in live if np.any(accs[n] != 0)]
        assert not nonzero, f"partial gradients kept in {nonzero[:3]}"
        assert tr.epoch(ds).epoch_complete and not tr.poisoned


def _state_dropped_check(site: str):
    clause = BEFORE_COMPUTE[site][0]

    @pytest.mark.clause("FAIL-04", clause)
    def check(backend, model_path, seed):
        _check_state_dropped(backend, model_path, seed, site)

    check.__name__ = check.__qualname__ = f"test_{site}_failure_drops_the_step_state"
    check.__doc__ = f"{clause}: {_check_state_dropped.__doc__}"
    return check


# one check per site, each citing its own FAIL-04 sub-clause (and so run against its own defect)
for _site in BEFORE_COMPUTE:
    globals()[f"test_{_site}_failure_drops_the_step_state"] = _state_dropped_check(_site)


@pytest.mark.clause("FAIL-05")
@pytest.mark.parametrize("site", list(BEFORE_COMPUTE))
def test_after_a_before_compute_failure_the_next_call_equals_a_fresh_run(backend, model_path, seed, site):
    with support.load(backend, model_path, trainable=False) as probe:
        failing = support.windows(1, 256, probe.n_vocab, seed + 23)
        later = support.windows(1, 256, probe.n_vocab, seed + 24)
    with support.load(backend, model_path) as model, support.context(model, n_ubatch=64) as ctx, _trainer(ctx, 2) as tr:
        fi.arm(site, 2)  # the first micro-batch's gradient is pending when the second one fails
        with pytest.raises(retro.BeforeComputeError):
            tr.epoch(failing)
        fi.reset()
        assert tr.epoch(later).epoch_complete
        after_failure = model.parameters()
    with support.load(backend, model_path) as model, support.context(model, n_ubatch=64) as ctx, _trainer(ctx, 2) as tr:
        tr.epoch(later)
        fresh = model.parameters()
    support.assert_params_equal(after_failure, fresh, backend, f"{site} failure then a call vs a fresh run")


@pytest.mark.clause("FAIL-07")
def test_a_compute_failure_poisons_the_trainer(backend, model_path, seed):
    """Every later call raises PoisonedTrainerError without computing anything."""
    with support.load(backend, model_path, trainable=False) as probe:
        ds = support.windows(1, 256, probe.n_vocab, seed + 25)
    with support.load(backend, model_path) as model, support.context(model, n_ubatch=64) as ctx, _trainer(ctx) as tr:
        fi.arm("compute", 2)
        with pytest.raises(retro.ComputeError):
            tr.epoch(ds)
        assert tr.poisoned, "the compute failure was not recorded"
        computes = fi.hits("compute")
        for _ in range(2):
            with pytest.raises(retro.PoisonedTrainerError):
                tr.epoch(ds)
        assert fi.hits("compute") == computes, "a poisoned trainer reached the backend"


@pytest.mark.clause("FAIL-06")
@pytest.mark.parametrize("site", list(BEFORE_COMPUTE))
def test_steps_completed_before_a_failure_stay_applied(backend, model_path, seed, site):
    """A before-compute failure at micro-batch k (one window each, accumulation 1): the
    parameters equal those of a run that completed the first k-1 micro-batches. (After a backend
    compute failure the parameters may be partly written: FAIL-07, not this clause.)"""
    with support.load(backend, model_path, trainable=False) as probe:
        ds = support.windows(4, 256, probe.n_vocab, seed + 26)
    k = 3
    with support.load(backend, model_path) as model, support.context(model) as ctx, _trainer(ctx) as tr:
        fi.arm(site, k)
        with pytest.raises(retro.TrainingError):
            tr.epoch(ds)
        failed = model.parameters()
    with support.load(backend, model_path) as model, support.context(model) as ctx, _trainer(ctx) as tr:
        fi.reset()
        tr.epoch(support.subset(ds, slice(0, k - 1)))
        completed = model.parameters()
    support.assert_params_equal(failed, completed, backend, f"{site} failure at {k} vs the {k - 1} steps before it")


@pytest.mark.clause("FAIL-08")
def test_recovery_restores_a_checkpoint_and_training_continues_identically(backend, model_path, seed, tmp_path):
    """A compute failure poisons the trainer; a new trainer restoring a checkpoint (through a
    file) has the checkpoint's parameters, AdamW moments and cursor, and trains on exactly as the
    run that never failed."""
    with support.load(backend, model_path, trainable=False) as probe:
        first = support.windows(2, 256, probe.n_vocab, seed + 27)
        then = support.windows(2, 256, probe.n_vocab, seed + 28)
    adamw = retro.AdamW(lr=2e-3)
    with support.load(backend, model_path) as model, support.context(model) as ctx:
        with retro.Trainer(ctx, optimizer=adamw) as tr:
            tr.epoch(first)
            saved = tr.checkpoint().save(tmp_path / "ckpt.npz")
            tr.epoch(then)
            never_failed = model.parameters()
    with support.load(backend, model_path) as model, support.context(model) as ctx:
        with retro.Trainer(ctx, optimizer=adamw) as tr:
            tr.epoch(first)
            fi.arm("compute", 1)
            with pytest.raises(retro.ComputeError):
                tr.epoch(then)
            assert tr.poisoned
        ckpt = retro.Checkpoint.load(saved)
        with retro.Trainer(ctx, optimizer=adamw) as fresh:
            fresh.restore(ckpt)
            assert fresh.iteration == ckpt.iteration == 3
            support.assert_params_equal(model.parameters(), ckpt.parameters, backend, "restored parameters")
            for name, (m, v) in ckpt.moments.items():
                got = fresh.moments(name)
                assert got is not None, f"{name}: no moments after restore"
                support.assert_params_equal({"m": got[0], "v": got[1]}, {"m": m, "v": v}, backend, f"{name} moments")
            fresh.epoch(then)
            support.assert_params_equal(model.parameters(), never_failed, backend, "resumed vs never failed")
