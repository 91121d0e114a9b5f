"""Cancellation (seed 000, "Cancellation"): the caller's progress callback returning False stops
the loop after that micro-batch. Exercised at every micro-batch of an epoch (HARNESS-03), with SGD
and AdamW, accumulation 1 and > 1."""

from __future__ import annotations

import ctypes
import itertools
import time

import pytest

import retro
import retro.fault_injection as fi
from retro.conformance import support
from retro.conformance.evidence import bound, expect, on_path

# windows of the profile, trained in its micro-batches (shape.parts of them per window)
WINDOWS_TRAIN, WINDOWS_EVAL = 2, 1
OPTIMIZERS: dict[str, retro.SGD | retro.AdamW] = {"sgd": retro.SGD(lr=0.01), "adamw": retro.AdamW(lr=1e-3)}


def _stop_at(k: int, seen: list[retro.Progress], *, train: bool = True):
    def progress(p: retro.Progress) -> bool:
        seen.append(p)
        return not (p.train == train and p.done == k)

    return progress


class _Interrupted(Exception):
    """What a progress callback raises to end a call, as Ctrl-C raises KeyboardInterrupt in one."""


def _raise_at(k: int, seen: list[retro.Progress], *, train: bool = True):
    def progress(p: retro.Progress) -> bool:
        seen.append(p)
        if p.train == train and p.done == k:
            raise _Interrupted(f"at micro-batch {k}")
        return True

    return progress


#: upstream ggml's ggml_opt_epoch_callback as a C caller declares it from ggml-opt.h, not retro's
#: own declaration: void (*)(bool train, ggml_opt_context_t, ggml_opt_dataset_t, ggml_opt_result_t,
#: int64_t ibatch, int64_t ibatch_max, int64_t t_start_us)
UPSTREAM_EPOCH_CALLBACK = ctypes.CFUNCTYPE(
    None,
    ctypes.c_bool,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_int64,
    ctypes.c_int64,
    ctypes.c_int64,
)


@pytest.mark.clause("CANCEL-02", "CANCEL-05", "CANCEL-06", "HARNESS-03")
@pytest.mark.parametrize("optimizer, accumulation", [("sgd", 1), ("adamw", 3)])
def test_cancel_at_every_micro_batch_runs_exactly_that_many(backend, model_path, seed, shape, optimizer, accumulation):
    """Cancelling at train micro-batch k, for every k of the epoch: exactly k computes ran (counted
    at the fork's compute site), the evaluation tail was skipped (no eval callback, no eval
    metrics), and the metrics count the k micro-batches, their optimizer steps and tokens, with
    epoch_complete = False. Cancelling at evaluation micro-batch j: the training and exactly j
    evaluation micro-batches ran. The points swept are every micro-batch that an uncancelled epoch
    reports through its progress callback (HARNESS-03)."""
    n_train, n_eval = WINDOWS_TRAIN * shape.parts, WINDOWS_EVAL * shape.parts
    with support.load(backend, model_path) as model, support.context(model, shape, n_ubatch=shape.micro_batch) as ctx:
        ds = support.windows(WINDOWS_TRAIN + WINDOWS_EVAL, shape.window, model.n_vocab, seed + 10)
        frac = WINDOWS_EVAL / (WINDOWS_TRAIN + WINDOWS_EVAL)
        whole: list[retro.Progress] = []  # the micro-batches an uncancelled epoch reports
        with retro.Trainer(ctx, optimizer=OPTIMIZERS[optimizer], accumulation=accumulation) as tr:
            tr.epoch(ds, val_fraction=frac, progress=support.recording(whole))
        with retro.Trainer(ctx, optimizer=OPTIMIZERS[optimizer], accumulation=accumulation) as tr:
            swept: list[tuple[bool, int]] = []
            for k in support.every_micro_batch(n_train):
                swept.append((True, k))
                seen: list[retro.Progress] = []
                fi.reset()
                m = tr.epoch(ds, val_fraction=frac, progress=_stop_at(k, seen))
                expect("CANCEL-02", fi.hits("compute") == k, f"cancel at {k}: {fi.hits('compute')} computes ran")
                expect("CANCEL-05", all(p.train for p in seen), f"cancel at {k}: an eval callback ran: {seen}")
                expect(
                    "CANCEL-05",
                    m.eval_micro_batches == 0 and m.eval_loss is None and m.eval_accuracy is None,
                    f"cancel at {k}: evaluation metrics {m}",
                )
                expect(
                    "CANCEL-06",
                    (m.train_micro_batches, m.optimizer_steps) == (k, k // accumulation),
                    f"cancel at {k}: {m.train_micro_batches} micro-batches, {m.optimizer_steps} steps reported",
                )
                expect(
                    "CANCEL-06",
                    m.logical_tokens == m.physical_tokens == k * shape.micro_batch,
                    f"cancel at {k}: {m.logical_tokens}/{m.physical_tokens} tokens reported",
                )
                expect("CANCEL-06", m.epoch_complete is False, f"cancel at {k}: epoch_complete")
            for j in support.every_micro_batch(n_eval):
                swept.append((False, j))
                fi.reset()
                m = tr.epoch(ds, val_fraction=frac, progress=_stop_at(j, [], train=False))
                expect(
                    "CANCEL-02", fi.hits("compute") == n_train + j, f"cancel at eval {j}: {fi.hits('compute')} computes"
                )
                expect(
                    "CANCEL-06",
                    (m.train_micro_batches, m.eval_micro_batches) == (n_train, j),
                    f"cancel at eval {j}: {m.train_micro_batches}/{m.eval_micro_batches} reported",
                )
                expect(
                    "CANCEL-06",
                    m.logical_tokens == m.physical_tokens == (n_train + j) * shape.micro_batch,
                    f"cancel at eval {j}: tokens {m.logical_tokens}",
                )
                expect(
                    "CANCEL-06",
                    m.eval_loss is not None and m.epoch_complete is (j == n_eval),
                    f"cancel at eval {j}: {m}",
                )
            expect(
                "HARNESS-03",
                swept == [(p.train, p.done) for p in whole],
                f"cancelled at {swept}, but an uncancelled epoch reported {[(p.train, p.done) for p in whole]}",
            )
    on_path(f"optimizer={optimizer}", f"accumulation={accumulation}")


@pytest.mark.clause("CANCEL-03")
@pytest.mark.parametrize("optimizer, accumulation", [("sgd", 1), ("adamw", 2)])
def test_the_finished_micro_batch_stays_applied(backend, model_path, seed, shape, optimizer, accumulation):
    """Parameters after a cancel at micro-batch k, where k closes an accumulation period, equal
    those of an uncancelled run over the same k micro-batches (one window per micro-batch)."""
    with support.load(backend, model_path, trainable=False) as probe:
        ds = support.windows(4, shape.window, probe.n_vocab, seed + 11)
    opt = OPTIMIZERS[optimizer]
    for k in range(accumulation, 4, accumulation):
        with support.load(backend, model_path) as model, support.context(model, shape) as ctx:
            with retro.Trainer(ctx, optimizer=opt, accumulation=accumulation) as tr:
                tr.epoch(ds, progress=_stop_at(k, []))  # the counts are CANCEL-02/06's; here, the parameters
            cancelled = model.parameters()
        with support.load(backend, model_path) as model, support.context(model, shape) as ctx:
            with retro.Trainer(ctx, optimizer=opt, accumulation=accumulation) as tr:
                tr.epoch(support.subset(ds, slice(0, k)))
            reference = model.parameters()
        with bound("CANCEL-03"):
            support.assert_params_equal(
                cancelled, reference, backend, f"cancelled at {k} vs the first {k} micro-batches"
            )
    on_path(f"optimizer={optimizer}", f"accumulation={accumulation}")


@pytest.mark.clause("CANCEL-04")
@pytest.mark.parametrize("cancelled_by", ["false", "exception"])
@pytest.mark.parametrize("cancelled_in", ["train", "eval"])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_an_incomplete_period_never_reaches_a_later_call(
    backend, model_path, seed, shape, optimizer, cancelled_in, cancelled_by
):
    """Accumulation 2, the first micro-batch of the second period trained, then cancelled, by the
    progress callback returning False or raising (as Ctrl-C does): right after it (train), or in
    the evaluation tail that follows it, the period still pending (eval). That micro-batch's
    gradient is discarded: a later call equals a run that never saw it, and the accumulators read
    back are zero right after the cancel."""
    with support.load(backend, model_path, trainable=False) as probe:
        ds = support.windows(6, shape.window, probe.n_vocab, seed + 12)
    opt = OPTIMIZERS[optimizer]
    first, later = support.subset(ds, slice(0, 2)), support.subset(ds, slice(3, 5))
    stopping = _stop_at if cancelled_by == "false" else _raise_at
    if cancelled_in == "train":
        discarded, frac, stop = support.subset(ds, slice(0, 3)), 0.0, stopping(3, [])
    else:  # windows 0-2 train, windows 5 and 4 evaluate: cancelled after the first of them
        discarded = support.subset(ds, [0, 1, 2, 5, 4])
        frac, stop = 0.4, stopping(1, [], train=False)
    with support.load(backend, model_path) as model, support.context(model, shape) as ctx:
        with retro.Trainer(ctx, optimizer=opt, accumulation=2) as tr:
            if cancelled_by == "false":
                m = tr.epoch(discarded, val_fraction=frac, progress=stop)
            else:
                with bound("CANCEL-04"), pytest.raises(_Interrupted):
                    tr.epoch(discarded, val_fraction=frac, progress=stop)
                m = None
            if cancelled_in == "eval" and m is not None:
                expect(
                    "CANCEL-04",
                    (m.train_micro_batches, m.eval_micro_batches, m.epoch_complete) == (3, 1, False),
                    f"not cancelled in the evaluation tail: {m}",
                )
            expect(
                "CANCEL-04",
                tr.period_position == 0,
                f"{tr.period_position} micro-batches of a period survived the cancel",
            )
            acc = tr.gradient_accumulator("output.weight")
            expect("CANCEL-04", acc is not None and not acc.any(), "a partial gradient survived the cancel")
            tr.epoch(later)
        cancelled = model.parameters()
    with support.load(backend, model_path) as model, support.context(model, shape) as ctx:
        with retro.Trainer(ctx, optimizer=opt, accumulation=2) as tr:
            tr.epoch(first)
            tr.epoch(later)
        reference = model.parameters()
    with bound("CANCEL-04"):
        support.assert_params_equal(cancelled, reference, backend, "after a discarded period vs never seeing it")
    on_path(f"cancelled_by={cancelled_by}", f"cancelled_in={cancelled_in}", f"optimizer={optimizer}")


@pytest.mark.clause("CANCEL-01")
def test_an_upstream_epoch_callback_is_called_and_false_requests_one_stop(backend, model_path, seed, shape):
    """A C-level callback with upstream ggml's ggml_opt_epoch_callback signature is called after
    every micro-batch with its arguments, beside the progress callback (a NULL one, as C passes for
    none, is no callback); a progress callback
    returning False makes exactly one llama_opt_request_stop (counted by llama.cpp itself), and a
    run that is not cancelled makes none."""
    calls: list[tuple[bool, int, int, bool, bool]] = []

    @UPSTREAM_EPOCH_CALLBACK
    def c_callback(train, opt_ctx, dataset, result, ibatch, ibatch_max, t_start_us):
        calls.append((bool(train), int(ibatch), int(ibatch_max), bool(opt_ctx), bool(result)))

    n_train, n_eval = WINDOWS_TRAIN * shape.parts, WINDOWS_EVAL * shape.parts
    with support.load(backend, model_path) as model, support.context(model, shape, n_ubatch=shape.micro_batch) as ctx:
        ds = support.windows(WINDOWS_TRAIN + WINDOWS_EVAL, shape.window, model.n_vocab, seed + 13)
        frac = WINDOWS_EVAL / (WINDOWS_TRAIN + WINDOWS_EVAL)
        with retro.Trainer(ctx, optimizer=retro.SGD(lr=0.01)) as tr:
            progress_calls: list[int] = []

            def progress(p: retro.Progress) -> bool:
                progress_calls.append(p.done)
                return True

            refused = support.raised(
                lambda: tr.epoch(ds, val_fraction=frac, progress=progress, epoch_callback=c_callback)
            )
            expect("CANCEL-01", refused is None, f"a callback of upstream's void signature was refused: {refused!r}")
            expect(
                "CANCEL-01",
                calls
                == [(True, i, n_train, True, True) for i in range(1, n_train + 1)]
                + [(False, j, n_eval, True, True) for j in range(1, n_eval + 1)],
                f"C callback calls {calls}",
            )
            expect("CANCEL-01", len(progress_calls) == n_train + n_eval, f"progress ran {len(progress_calls)} times")
            expect("CANCEL-01", tr.stop_requests == 0, f"{tr.stop_requests} stop requests without a cancel")
            # a NULL function pointer, what C code passes for "no callback", is no callback
            tr.epoch(ds, val_fraction=frac, epoch_callback=UPSTREAM_EPOCH_CALLBACK())
            for k in (1, 3):
                calls.clear()
                before = tr.stop_requests
                tr.epoch(ds, val_fraction=frac, progress=_stop_at(k, []), epoch_callback=c_callback)
                expect("CANCEL-01", [c[1] for c in calls] == list(range(1, k + 1)), f"cancel at {k}: C calls {calls}")
                expect(
                    "CANCEL-01",
                    tr.stop_requests - before == 1,
                    f"cancel at {k}: {tr.stop_requests - before} stop requests reached llama.cpp",
                )


@pytest.mark.clause("CANCEL-07")
def test_the_limiter_drops_its_debt_on_the_way_out(backend, model_path, seed, shape):
    """With duty cycle d < 1 the limiter owes compute * (1 - d) / d of sleep after each micro-batch
    and pays it before the next compute; a cancel drops the debt instead of sleeping it. Measured
    by the wall clock, not by the binding's own accounting. The unit is the fastest micro-batch of
    an unthrottled epoch: load only ever slows a micro-batch down, so that minimum is what a
    compute costs at most, so each bound sits between the right behaviour and the wrong one by a
    factor a loaded machine (the checks run side by side) does not bridge."""

    def run(tr: retro.Trainer, ds: retro.TokenDataset, stop_at: int) -> tuple[list[float], float, int]:
        """Callback times (the call's start first), the time from the cancel to the return, and
        the micro-batches trained."""
        times = [time.monotonic()]

        def progress(p: retro.Progress) -> bool:
            times.append(time.monotonic())
            return p.done < stop_at

        m = tr.epoch(ds, progress=progress)
        return times, time.monotonic() - times[-1], m.train_micro_batches

    with support.load(backend, model_path) as model, support.context(model, shape, n_ubatch=shape.micro_batch) as ctx:
        ds = support.windows(WINDOWS_TRAIN, shape.window, model.n_vocab, seed + 14)
        with retro.Trainer(ctx, optimizer=retro.SGD(lr=0.01)) as tr:
            run(tr, support.subset(ds, slice(0, 1)), 1)  # warm: optimizer state and graphs exist
            times, _, _ = run(tr, ds, 1 << 30)
        unit = min(b - a for a, b in itertools.pairwise(times[1:]))  # after the call's setup
        for duty, k in ((0.02, 1), (0.02, 2), (0.1, 3)):
            with retro.Trainer(ctx, optimizer=retro.SGD(lr=0.01), duty_cycle=duty) as tr:
                run(tr, support.subset(ds, slice(0, 1)), 1)
                times, way_out, trained = run(tr, ds, k)
            expect("CANCEL-07", trained == k, f"stopped after {trained}, not {k}")
            # at the cancel the limiter owes at least the debt of one fastest micro-batch
            owed = unit * (1 - duty) / duty
            if duty == 0.02:
                # a debt is paid before the next compute, never right after its own: the first
                # micro-batch's callback follows its compute at once (about 1 unit, against 49 owed)
                first = times[1] - times[0]
                expect(
                    "CANCEL-07",
                    first < 0.5 * owed,
                    f"{first * 1e3:.1f} ms from the call to the first callback, where a micro-batch takes "
                    f"{unit * 1e3:.1f} ms and owes {owed * 1e3:.1f} ms after it: its debt was slept before the callback",
                )
            if k == 2:
                # between callbacks 1 and 2: micro-batch 1's debt (paid before the next compute),
                # then micro-batch 2's compute: about 50 units, 1 or a few if the debt was not paid
                before = times[2] - times[1]
                expect(
                    "CANCEL-07",
                    before > 0.2 * owed,
                    f"duty {duty}: {before * 1e3:.1f} ms between two callbacks, where a micro-batch takes "
                    f"{unit * 1e3:.1f} ms and its debt is {owed * 1e3:.1f} ms: the debt was not paid",
                )
            expect(
                "CANCEL-07",
                way_out < 0.5 * owed,
                f"duty {duty}, stop at {k}: {way_out * 1e3:.1f} ms from the cancel to the return, "
                f"with at least {owed * 1e3:.1f} ms of debt owed",
            )


@pytest.mark.clause("CANCEL-08")
def test_the_callback_scope_is_restored_on_every_exit(backend, model_path, seed, shape):
    """An epoch call nested in another's progress callback ends by return, cancel, native error or
    callback exception: the outer call's callbacks still reach the outer progress, and later calls
    without a progress callback reach none."""

    class Boom(Exception):
        pass

    with (
        support.load(backend, model_path) as m_outer,
        support.context(m_outer, shape, n_ubatch=shape.micro_batch) as c_outer,
        support.load(backend, model_path) as m_inner,
        support.context(m_inner, shape, n_ubatch=shape.micro_batch) as c_inner,
        retro.Trainer(c_outer, optimizer=retro.SGD(lr=0.01)) as outer,
        retro.Trainer(c_inner, optimizer=retro.SGD(lr=0.01)) as inner,
    ):
        ds = support.windows(1, shape.window, m_outer.n_vocab, seed + 15)
        every = list(range(1, shape.parts + 1))  # the window's micro-batches, each reported
        expected_inner = {"return": every, "cancel": [1], "native error": [1], "exception": [1]}
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
            expect("CANCEL-08", outer_calls == every, f"{exit_kind}: the outer progress saw {outer_calls}")
            expect("CANCEL-08", inner_calls == want, f"{exit_kind}: the inner progress saw {inner_calls}")
            outer_calls.clear()
            inner_calls.clear()
            inner.epoch(ds)
            outer.epoch(ds)
            expect(
                "CANCEL-08",
                outer_calls == inner_calls == [],
                f"{exit_kind}: a call without progress reached {outer_calls or inner_calls}",
            )


@pytest.mark.clause("HARNESS-04")
def test_a_callback_exception_at_every_invocation_cancels_and_is_re_raised(backend, model_path, seed, shape):
    """The progress callback raises at each of its invocations (train and evaluation), and the
    learning-rate schedule (ggml's optimizer-parameter callback) at each of its: every time the
    call stops before any further compute, re-raises that exception unchanged, keeps the steps
    completed before it, and the trainer's next call completes."""

    class Boom(Exception):
        pass

    n_train = WINDOWS_TRAIN * shape.parts
    with support.load(backend, model_path) as model, support.context(model, shape, n_ubatch=shape.micro_batch) as ctx:
        ds = support.windows(WINDOWS_TRAIN + 1, shape.window, model.n_vocab, seed + 16)
        frac = 1 / (WINDOWS_TRAIN + 1)
        invocations = n_train + shape.parts
        with retro.Trainer(ctx, optimizer=retro.SGD(lr=0.01)) as tr:
            for k in range(1, invocations + 1):
                calls = 0

                def progress(p: retro.Progress) -> bool:
                    nonlocal calls
                    calls += 1
                    if calls == k:
                        raise Boom(k)
                    return True

                fi.reset()
                with bound("HARNESS-04"), pytest.raises(Boom):
                    tr.epoch(ds, val_fraction=frac, progress=progress)
                expect("HARNESS-04", fi.hits("compute") == k, f"progress raised at {k}: {fi.hits('compute')} computes")
            expect("HARNESS-04", tr.epoch(ds).epoch_complete, "the trainer did not recover")
        steps = n_train // 2
        for k in range(1, steps + 1):
            asked: list[int] = []

            def schedule(step: int, horizon: int) -> float:
                asked.append(step)
                if len(asked) == k:
                    raise Boom(k)
                return 0.01 * (1 - step / horizon)

            with retro.Trainer(
                ctx, optimizer=retro.SGD(lr=0.01), accumulation=2, schedule=schedule, horizon=steps
            ) as tr:
                fi.reset()
                with bound("HARNESS-04"), pytest.raises(Boom):
                    tr.epoch(ds)
                expect(
                    "HARNESS-04",
                    (tr.iteration, fi.hits("compute")) == (k, 2 * k - 1),
                    f"schedule raised at step {k - 1}: iteration {tr.iteration}, {fi.hits('compute')} computes",
                )
                expect("HARNESS-04", tr.period_position == 0, "the period of the refused step survived")
        # a callback that returns what it may not fails as one that raised: a TypeError at once
        with retro.Trainer(
            ctx, optimizer=retro.SGD(lr=0.01), schedule=support.hostile(lambda s, h: "0.01"), horizon=steps
        ) as tr:
            fi.reset()
            with bound("HARNESS-04"), pytest.raises(TypeError, match="schedule must return a number"):
                tr.epoch(ds)
            # asked for the first step's rate before its one micro-batch computes
            got = (tr.iteration, fi.hits("compute"))
            expect("HARNESS-04", got == (1, 0), f"a schedule of text: iteration and computes {got}")
        with retro.Trainer(ctx, optimizer=retro.SGD(lr=0.01)) as tr:
            fi.reset()
            with bound("HARNESS-04"), pytest.raises(TypeError, match="must return a bool or None"):
                tr.epoch(ds, progress=support.hostile(lambda p: "yes"))
            expect("HARNESS-04", fi.hits("compute") == 1, f"a progress of text: {fi.hits('compute')} computes")
            expect("HARNESS-04", tr.epoch(ds, progress=lambda p: None).epoch_complete, "a progress returning None")


@pytest.mark.clause("CANCEL-08")
def test_two_trainers_on_two_threads_reach_only_their_own_progress(backend, model_path, seed, shape):
    """Two trainers train at once on two threads (the GIL is released while they compute); each
    progress callback sees exactly its own call's micro-batches, and a cancel on one thread stops
    that call alone. The first micro-batches run in lockstep, so that both calls are certainly
    inside their epochs together rather than one finishing before the other has begun."""
    import threading

    n_windows = 4
    n_train = n_windows * shape.parts
    with (
        support.load(backend, model_path) as m_a,
        support.context(m_a, shape, n_ubatch=shape.micro_batch, n_threads=1) as c_a,
        support.load(backend, model_path) as m_b,
        support.context(m_b, shape, n_ubatch=shape.micro_batch, n_threads=1) as c_b,
    ):
        ds = support.windows(n_windows, shape.window, m_a.n_vocab, seed + 17)
        start = threading.Barrier(2)
        seen: dict[str, list[tuple[int, int]]] = {"a": [], "b": []}
        metrics: dict[str, retro.EpochMetrics] = {}
        errors: list[BaseException] = []
        cancel_at = {"a": n_train, "b": 5}
        # both threads meet after each of their first micro-batches: a callback that reached the
        # other thread's progress still counts as a party, and a meeting that never happens breaks
        # its barrier, which raises in the callback and fails the epoch
        lockstep = [threading.Barrier(2, timeout=120) for _ in range(3)]

        def run(name: str, ctx: retro.Context) -> None:
            me = threading.get_ident()

            def progress(p: retro.Progress) -> bool:
                seen[name].append((p.done, threading.get_ident() == me))
                if p.done <= len(lockstep):
                    lockstep[p.done - 1].wait()
                return p.done != cancel_at[name]

            try:
                with retro.Trainer(ctx, optimizer=retro.SGD(lr=0.01)) as tr:
                    start.wait()
                    metrics[name] = tr.epoch(ds, progress=progress)
            except BaseException as err:  # noqa: BLE001 - reported below, on the checking thread
                errors.append(err)

        threads = [threading.Thread(target=run, args=("a", c_a)), threading.Thread(target=run, args=("b", c_b))]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=300)
        expect("CANCEL-08", not errors, f"a training thread raised {errors[:1]}")
        for name in ("a", "b"):
            want = [(k, True) for k in range(1, cancel_at[name] + 1)]
            expect("CANCEL-08", seen[name] == want, f"thread {name}'s progress saw {seen[name]}")
            expect(
                "CANCEL-08",
                name in metrics and metrics[name].train_micro_batches == cancel_at[name],
                f"thread {name} ran {metrics[name].train_micro_batches if name in metrics else None} micro-batches",
            )
