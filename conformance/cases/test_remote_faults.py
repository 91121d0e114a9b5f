"""Real faults of a remote device (the RPC backend): the server the model lives on is killed at
every micro-batch of an epoch, stopped, or never started. Each must surface as a typed error within
the link's deadline, poison the trainer, and never abort or hang the process (fork patches
0017/0018); a restarted server recovers from a checkpoint. Elsewhere these faults do not exist:
"not supported"."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import retro
import retro.rpc
from retro.conformance import backends, support
from retro.conformance.evidence import Bound, against_oracle, bound, expect, on_path
from retro.conformance.plugin import not_supported
from retro.conformance.shapes import Shape

DEADLINE_S = 3.0  # of each send and receive on the links these checks make
SLACK_S = 5.0  # a failed call may take the deadline plus this

#: a training resumed from a checkpoint on a restarted server against the same on a server that
#: never went down: the same kernels and numerics (a GPU's too, under --numerics gpu-like), so only
#: the restart could differ (and must not)
RESUMED = Bound("FAIL-08 resumed parameters NMSE", 0.0)  # both servers' kernels repeat (backends.REPEATABLE)


def _remote_only(backend: backends.Backend) -> None:
    if backend.name != "rpc":
        not_supported("killing the device is a fault of a remote backend only")


def _on(server: retro.rpc.Server) -> backends.Backend:
    """The backend of a server of this check's own (not the run's)."""
    devices = retro.rpc.connect(server.endpoint, deadline_s=DEADLINE_S)
    return backends.Backend("rpc", True, devices=tuple(d.__dict__ for d in devices))


@pytest.fixture(autouse=True)
def _default_deadline():
    yield
    retro.rpc.set_deadline(retro.rpc.DEFAULT_DEADLINE_S)


def _lose_server(tr: retro.Trainer, ds: retro.TokenDataset, server: retro.rpc.Server, k: int, how: str):
    """Train with the server lost after k micro-batches (k = 0: before the call): a ComputeError
    naming the lost link within the deadline (FAIL-01); what happened, and the progress reports."""
    seen: list[int] = []

    def progress(p: retro.Progress) -> None:
        seen.append(p.done)
        if p.done == k:
            server.kill() if how == "kill" else server.stop()

    if k == 0:
        server.kill() if how == "kill" else server.stop()
    t0 = time.monotonic()
    with bound("FAIL-01"), pytest.raises(retro.TrainingError) as err:
        tr.epoch(ds, progress=progress)
    took = time.monotonic() - t0
    what = f"server {how}ed after micro-batch {k}"
    expect("FAIL-01", type(err.value) is retro.ComputeError, f"{what}: {type(err.value).__name__}, not ComputeError")
    expect("FAIL-01", "link" in str(err.value), f"{what}: no diagnostic of the lost link")
    expect("FAIL-01", took < DEADLINE_S + SLACK_S, f"{what}: the call took {took:.1f} s")
    return what, seen


@pytest.mark.clause("FAIL-01", "FAIL-02", "FAIL-07")
def test_a_server_lost_at_any_micro_batch_fails_that_step(backend, model_path, shape, seed):
    """Killed before micro-batch k+1 for every k of a 4-micro-batch epoch, and stopped (SIGSTOP)
    once: a ComputeError naming the lost link within the deadline, no progress report for the
    failed step, a poisoned trainer that refuses every later call. A server that never ran is a
    BackendError at connect; one that stalls within the link's default deadline fails nothing."""
    _remote_only(backend)
    with support.load(backend, model_path, trainable=False) as probe:
        ds = support.windows(4, shape.window, probe.n_vocab, seed + 40)
    for how, ks in (("kill", range(4)), ("stop", [1])):
        for k in ks:
            with retro.rpc.Server(numerics=backends.rpc_numerics()) as server:
                remote = _on(server)
                with support.load(remote, model_path) as model, support.context(model, shape) as ctx:
                    with retro.Trainer(ctx, optimizer=retro.AdamW(lr=1e-3)) as tr:
                        what, seen = _lose_server(tr, ds, server, k, how)
                        expect("FAIL-02", seen == list(range(1, k + 1)), f"{what}: progress reports {seen}")
                        expect("FAIL-07", tr.poisoned, f"{what}: the trainer is not poisoned")
                        for call in (lambda: tr.epoch(ds), tr.checkpoint):
                            with bound("FAIL-07"), pytest.raises(retro.PoisonedTrainerError):
                                call()
    with bound("FAIL-01"), pytest.raises(retro.BackendError):
        retro.rpc.connect(f"{retro.rpc.LOOPBACK}:{retro.rpc.free_port()}", deadline_s=DEADLINE_S)
    _stalled_within_the_deadline(model_path, shape, ds)


#: how long the stalled server answers nothing: longer than any step of these checks takes, well
#: within the link's default deadline
STALL_S = 2.0


def _stalled_within_the_deadline(model_path, shape: Shape, ds: retro.TokenDataset) -> None:
    """Only a failure is recorded: a server that answers nothing for STALL_S after the first
    micro-batch (SIGSTOP, then SIGCONT), on a link with the default deadline, delays the epoch and
    fails nothing: it completes, the trainer is not poisoned, and the parameters are those of an
    epoch that never stalled."""
    with retro.rpc.Server(numerics=backends.rpc_numerics()) as server:
        devices = retro.rpc.connect(server.endpoint)  # the default deadline, as a user's link has
        remote = backends.Backend("rpc", True, devices=tuple(d.__dict__ for d in devices))
        runs = []
        for stall in (False, True):

            def progress(p: retro.Progress) -> None:
                if stall and p.done == 1:
                    server.stop()
                    threading.Timer(STALL_S, server.resume).start()

            with support.load(remote, model_path) as model, support.context(model, shape) as ctx:
                with retro.Trainer(ctx, optimizer=retro.SGD(lr=1e-2)) as tr:
                    t0 = time.monotonic()
                    try:
                        m = tr.epoch(ds, progress=progress)
                    except retro.RetroError as e:
                        expect("FAIL-07", False, f"stalled {STALL_S} s: {type(e).__name__}: {str(e)[:300]}")
                        return
                    took = time.monotonic() - t0
                    expect("FAIL-07", m.epoch_complete and not tr.poisoned, f"stall {stall}: {m}")
                    runs.append((model.parameters(), took))
        expect("FAIL-07", runs[1][1] >= STALL_S, f"the epoch took {runs[1][1]:.1f} s: the server never stalled")
        with bound("FAIL-07"):
            support.assert_params_equal(runs[1][0], runs[0][0], support.CPU, "stalled vs never stalled")


@pytest.mark.clause("FAIL-08")
def test_a_restarted_server_recovers_from_a_checkpoint(backend, model_path, shape, seed):
    """Train, checkpoint, lose the server mid-epoch; on a restarted server a new model and trainer
    restore the checkpoint (parameters, moments, cursor) and train on as a server that never went
    down does from it."""
    _remote_only(backend)
    with support.load(backend, model_path, trainable=False) as probe:
        first = support.windows(2, shape.window, probe.n_vocab, seed + 41)
        then = support.windows(3, shape.window, probe.n_vocab, seed + 42)
    adamw = retro.AdamW(lr=2e-3)
    with retro.rpc.Server(numerics=backends.rpc_numerics()) as server:
        with support.load(_on(server), model_path) as model, support.context(model, shape) as ctx:
            with retro.Trainer(ctx, optimizer=adamw) as tr:
                tr.epoch(first)
                ckpt = tr.checkpoint()
                _lose_server(tr, then, server, 2, "kill")
        server.restart()
        with support.load(_on(server), model_path) as model, support.context(model, shape) as ctx:
            with retro.Trainer(ctx, optimizer=adamw) as tr:
                tr.restore(ckpt)
                expect("FAIL-08", tr.iteration == ckpt.iteration, f"cursor {tr.iteration} vs {ckpt.iteration}")
                with bound("FAIL-08"):
                    support.assert_params_equal(model.parameters(), ckpt.parameters, backend, "restored parameters")
                for name, (m, v) in ckpt.moments.items():
                    got = tr.moments(name)
                    expect("FAIL-08", got is not None, f"{name}: no moments after restore")
                    assert got is not None
                    with bound("FAIL-08"):
                        np.testing.assert_array_equal(got[0], m, err_msg=f"{name} first moment")
                        np.testing.assert_array_equal(got[1], v, err_msg=f"{name} second moment")
                tr.epoch(then)
                resumed = model.parameters()
    with retro.rpc.Server(numerics=backends.rpc_numerics()) as never_down:
        with support.load(_on(never_down), model_path) as model, support.context(model, shape) as ctx:
            with retro.Trainer(ctx, optimizer=adamw) as tr:
                tr.restore(ckpt)
                tr.epoch(then)
                oracle = model.parameters()
    for name in sorted(oracle):
        against_oracle("FAIL-08", f"{name} resumed from the checkpoint", resumed[name], oracle[name], RESUMED)


MiB = 2**20


@pytest.mark.clause("FAIL-01")
@pytest.mark.parametrize("when", ["preparation", "step"])
def test_a_real_allocation_failure_on_the_remote_device_is_typed_and_survived(backend, model_path, shape, seed, when):
    """The server's memory is capped (RLIMIT_AS, as ``ulimit -v``) so that a real allocation
    fails on the remote device: with room for half the optimizer state, that of a restore
    (preparation); with room for the state but not for the compute buffer, the epoch's first step.
    Each is an AllocationError carrying the allocator's diagnostic (FAIL-01). The check also holds
    the trainer to what FAIL-05 asks of injected failures (not poisoned, nothing stepped, and once
    the memory is back it trains as a fresh trainer on an uncapped server does from the same start:
    the same kernels, so that a server computing like a GPU is held to its own numerics, not the
    CPU's); it does not
    cite FAIL-05, whose seeded defect lives where these failures do not reach (a failure at the
    period's first micro-batch has no period position to forget)."""
    _remote_only(backend)
    with support.load(backend, model_path, trainable=False) as probe:
        ds = support.windows(2, shape.window, probe.n_vocab, seed + 43)
    adamw = retro.AdamW(lr=2e-3)
    with retro.rpc.Server(numerics=backends.rpc_numerics()) as uncapped:
        with support.load(_on(uncapped), model_path) as model, support.context(model, shape) as ctx:
            with retro.Trainer(ctx, optimizer=adamw) as tr:
                start = tr.checkpoint()
                if when == "preparation":
                    tr.restore(start)
                tr.epoch(ds)
                oracle = model.parameters()
    with retro.rpc.Server(numerics=backends.rpc_numerics()) as server:
        remote = _on(server)
        with support.load(remote, model_path) as model, support.context(model, shape) as ctx:
            with retro.Trainer(ctx, optimizer=adamw) as tr:
                plan = tr.preflight(ds)
                on_server = [b for b in plan.buffers if b.buffer_type.startswith("RPC")]
                state = sum(b.needed - b.held for b in on_server if b.purpose == "optimizer state")
                compute = sum(b.needed - b.held for b in on_server if b.purpose == "compute")
                assert state > 0 and compute > 2 * MiB, f"the plan needs the state and compute on the server: {plan}"
                iteration = tr.iteration
                # preparation: half the state fits; step: the state fits, the compute buffer does
                # not. Either way the server keeps room for its own small allocations (commands,
                # replies), which failing would end it: a lost link, not a device out of memory
                # a cap below what the server maps now is refused: the cap set next means what it says
                refused = support.raised(lambda: server.limit_memory(-1))
                assert isinstance(refused, ValueError), f"a negative extra for the cap: {refused!r}"
                server.limit_memory(state // 2 if when == "preparation" else state + MiB)
                seen: list[int] = []
                with bound("FAIL-01"), pytest.raises(retro.TrainingError) as err:
                    tr.restore(start) if when == "preparation" else tr.epoch(ds, progress=support.recording(seen))
                expect("FAIL-01", type(err.value) is retro.AllocationError, f"{when}: {type(err.value).__name__}")
                diagnostic = "accumulators and moments" if when == "preparation" else "failed to allocate RPC"
                expect("FAIL-01", diagnostic in str(err.value), f"{when}: no allocator diagnostic in {err.value}")
                assert not tr.poisoned, f"{when}: an allocation failure poisoned the trainer"
                assert tr.iteration == iteration and not seen, f"{when}: the failed call stepped"
                server.limit_memory(None)
                if when == "preparation":
                    tr.restore(start)
                tr.epoch(ds)
                after = model.parameters()
    support.assert_params_equal(after, oracle, backend, f"{when}: trained after the failure")
    on_path(f"when={when}")
