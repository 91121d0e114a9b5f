"""Failures (seed 000, "Failures"), forced at every site by the fault hooks (HARNESS-02):
before-compute failures abandon the step and leave the trainer usable; a backend compute failure
poisons it."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

import retro
import retro.fault_injection as fi
from retro.conformance import support
from retro.conformance.evidence import bound, expect, on_path, raises_bound, succeeds
from retro.conformance.shapes import Shape
from retro.testing import live_allocations, micro_batch

# site -> (its FAIL-04 sub-clause, the error class, the line the native library logs there)
BEFORE_COMPUTE = {
    "fused_head": ("FAIL-04f", retro.UnsupportedHeadError, "the fused cross-entropy head needs"),
    "batch_init": ("FAIL-04a", retro.BatchInitError, "failed to initialize batch"),
    "memory_init": ("FAIL-04b", retro.MemoryInitError, "could not initialize the memory"),
    "output_reserve": ("FAIL-04c", retro.OutputReserveError, "could not reserve space"),
    "memory_apply": ("FAIL-04b", retro.MemoryInitError, "failed to update the memory context"),
    "graph_build": ("FAIL-04d", retro.GraphBuildError, "failed to build the training graph"),
    "graph_meta": ("FAIL-04d", retro.GraphBuildError, "failed to allocate the graph metadata"),
    "alloc": ("FAIL-04e", retro.AllocationError, "failed to allocate the training graph"),
}
# site -> (the error class, the line logged there): the optimizer's state, allocated once per
# trainer (its first step, or a restore) and so before any step of its own
PREPARATION = {"opt_state": (retro.AllocationError, "failed to allocate the optimizer's gradient accumulators")}
SITES = {
    **{s: v[1:] for s, v in BEFORE_COMPUTE.items()},
    **PREPARATION,
    "compute": (retro.ComputeError, "backend compute failed"),
}
assert set(SITES) == set(fi.SITES), "a fault site of the fork has no failure check"


def _optimizer(name: str) -> retro.SGD | retro.AdamW:
    return retro.SGD(lr=0.05) if name == "sgd" else retro.AdamW(lr=2e-3)


#: the loss head a failure at a site needs: the fused head's support question is asked only of a
#: fused step (every other site fails the same on either head)
HEAD = {"fused_head": "fused"}


def _trainer(ctx: retro.Context, accumulation: int = 1, optimizer: str = "sgd", site: str = "") -> retro.Trainer:
    return retro.Trainer(ctx, optimizer=_optimizer(optimizer), accumulation=accumulation, head=HEAD.get(site, "dense"))


@pytest.mark.clause("FAIL-01")
def test_each_failure_is_its_own_class_with_the_native_diagnostic(backend, model_path, seed, shape):
    """Every site failed in a step (its second micro-batch; the optimizer's state, at the first
    step that allocates it), and in preparation: the optimizer's state of a restore. Each raises
    its own class carrying the line the native library logged there."""
    with support.load(backend, model_path, trainable=False) as probe:
        ds = support.windows(1, shape.window, probe.n_vocab, seed + 20)

    def raises_its_own(site: str, call) -> None:
        cls, diagnostic = SITES[site]
        with pytest.raises(retro.RetroError) as err:
            call()
        expect("FAIL-01", type(err.value) is cls, f"{site}: raised {type(err.value).__name__}, expected {cls.__name__}")
        expect("FAIL-01", diagnostic in str(err.value), f"{site}: no native diagnostic in {str(err.value)!r}")

    for site in SITES:
        with (
            support.load(backend, model_path) as model,
            support.context(model, shape, n_ubatch=shape.micro_batch) as ctx,
            _trainer(ctx, site=site) as tr,
        ):
            fi.reset()
            fi.arm(site, 1 if site in PREPARATION else 2)
            raises_its_own(site, lambda: tr.epoch(ds))
    on_path("when=step")
    for site in PREPARATION:
        with (
            support.load(backend, model_path) as model,
            support.context(model, shape, n_ubatch=shape.micro_batch) as ctx,
        ):
            with _trainer(ctx, optimizer="adamw") as tr:
                start = tr.checkpoint()
                fi.reset()
                fi.arm(site, 1)
                raises_its_own(site, lambda: tr.restore(start))
                fi.reset()
                expect("FAIL-01", not tr.poisoned, f"{site}: a failed preparation poisoned the trainer")
                tr.restore(start)  # the memory is back: the same trainer prepares and trains
                expect("FAIL-01", tr.epoch(ds).epoch_complete, f"{site}: no epoch after the failed preparation")
    on_path("when=preparation")


@pytest.mark.clause("FAIL-02", "FAIL-03")
@pytest.mark.drives("callback=progress", "callback=epoch")
@pytest.mark.parametrize(
    "site, optimizer, accumulation, start",
    [
        ("alloc", "sgd", 1, "boundary"),
        ("compute", "sgd", 1, "boundary"),
        ("graph_build", "adamw", 2, "boundary"),
        ("graph_build", "adamw", 2, "mid-period"),
        ("compute", "adamw", 2, "mid-period"),
    ],
)
def test_a_failed_step_publishes_nothing_and_the_cursor_stays(
    backend, model_path, seed, shape, site, optimizer, accumulation, start
):
    """Failing micro-batch k: the progress callback and the caller's C epoch callback heard only of
    1..k-1, the optimizer iteration is the one the last completed step left, and (after a
    before-compute failure) the next call asks the learning-rate schedule for the failed step
    again. From mid-period, the call starts with one micro-batch of a period already accumulated
    (by an earlier call of one micro-batch): its first micro-batch closes that period, so the step
    counts run one micro-batch ahead of the call's own count, and the schedule is asked for steps
    0, 1, ... in order, each once, before the micro-batch that takes it."""
    with support.load(backend, model_path, trainable=False) as probe:
        ds = support.windows(2, shape.window, probe.n_vocab, seed + 21)
        one_micro_batch = support.windows(1, shape.micro_batch, probe.n_vocab, seed + 23)
    for k in (1, 3, 2 * shape.parts):  # the first, one inside, and the last of the epoch's micro-batches
        asked: list[int] = []

        def schedule(step: int, horizon: int) -> float:
            asked.append(step)
            return 0.05 if optimizer == "sgd" else 2e-3

        heard: list[tuple[bool, int]] = []

        @retro.EpochCallback
        def c_callback(train, opt_ctx, dataset, result, ibatch, ibatch_max, t_start_us):
            heard.append((bool(train), int(ibatch)))

        with (
            support.load(backend, model_path) as model,
            support.context(model, shape, n_ubatch=shape.micro_batch) as ctx,
            retro.Trainer(
                ctx, optimizer=_optimizer(optimizer), accumulation=accumulation, schedule=schedule, horizon=100
            ) as tr,
        ):
            pending = 0
            if start == "mid-period":
                tr.epoch(one_micro_batch)
                pending = tr.period_position
                assert pending == 1 and tr.iteration == 1, "one micro-batch of an accumulation period of 2"
            seen: list[int] = []

            def progress(p: retro.Progress) -> bool:
                seen.append(p.done)
                return True

            fi.reset()
            fi.arm(site, k)
            with pytest.raises(retro.TrainingError):
                tr.epoch(ds, progress=progress, epoch_callback=c_callback)
            expect("FAIL-02", seen == list(range(1, k)), f"{site} at {k}: progress callbacks for {seen}")
            expect(
                "FAIL-02",
                heard == [(True, i) for i in range(1, k)],
                f"{site} at {k}: the C epoch callback heard of {heard}",
            )
            on_path("callback=progress", "callback=epoch")
            completed_steps = (pending + k - 1) // accumulation
            expect(
                "FAIL-03",
                tr.iteration == 1 + completed_steps,
                f"{site} at {k} ({start}): cursor {tr.iteration}, the last completed step leaves {1 + completed_steps}",
            )
            # the failed micro-batch asked too, where it closes a period (before its compute)
            closing = (pending + k) // accumulation
            expect(
                "FAIL-03",
                asked == list(range(closing)),
                f"{site} at {k} ({start}): the schedule was asked for steps {asked}, not 0..{closing - 1}",
            )
            if site != "compute":  # a compute failure poisons the trainer: no next call
                fi.reset()
                asked.clear()
                tr.epoch(ds)
                expect(
                    "FAIL-03",
                    asked[:1] == [completed_steps],
                    f"{site} at {k}: the next call asked the schedule for steps {asked[:2]}, not {completed_steps}",
                )
    on_path(f"site={site}", f"optimizer={optimizer}", f"accumulation={accumulation}", f"start={start}")


def _unlike_a_fresh_sequence(ctx: retro.Context) -> str | None:
    """How a decode now differs from the same decode after an explicit reset (None: it does not),
    the context reset afterwards. A sequence left behind, or the binding's stale view of one, puts
    the tokens at other positions: llama.cpp's own record of the KV cache shows it (the logits need
    not: RoPE's scores depend on position differences only)."""
    ids = np.array([1, 2, 3], dtype=np.int32)
    try:
        now = ctx.decode(ids)
    except retro.RetroError as e:
        ctx.reset()
        return f"it failed ({type(e).__name__}: {str(e)[:300]})"
    held = ctx.sequence_length
    ctx.reset()
    fresh = ctx.decode(ids)
    ctx.reset()
    if held != ids.size:
        return f"the KV cache holds {held} positions after a decode of {ids.size} tokens"
    return None if np.array_equal(now, fresh) else "its logits differ from those after a reset"


def _check_state_dropped(backend, shape: Shape, model_path, seed, site):
    """From a trained state, a micro-batch of an accumulation period of 2 has left a gradient and
    its positions in the KV cache; the next one fails at the site. Observed right after the failed
    step (retro.testing.micro_batch, before any epoch call tidies up): the sequence state is empty
    (FAIL-04: the next decode starts at position 0), and the period restarts with zero accumulators
    (the site's own sub-clause); the trainer's next call completes. A call failing at the site in
    its evaluation tail drops the open period of its training as well."""
    clause = BEFORE_COMPUTE[site][0]
    with support.load(backend, model_path, trainable=False) as probe:
        ds = support.windows(1, shape.window, probe.n_vocab, seed + 22)
    tokens, labels = ds.tokens[0], ds.labels[0]
    ub = shape.micro_batch  # the window's first micro-batch is [:ub], its second [ub : 2 * ub]
    with (
        support.load(backend, model_path) as model,
        support.context(model, shape, n_ubatch=ub) as ctx,
        _trainer(ctx, 2, "adamw", site) as tr,
    ):
        tr.epoch(ds)
        micro_batch(tr, tokens[:ub], labels[:ub], pos0=0)
        expect(
            "FAIL-04",
            ctx.sequence_length == ub and tr.period_position == 1,
            f"the first micro-batch left {ctx.sequence_length} positions, period position {tr.period_position}",
        )
        fi.reset()
        fi.arm(site, 1)
        with pytest.raises(retro.BeforeComputeError) as err:
            micro_batch(tr, tokens[ub : 2 * ub], labels[ub : 2 * ub], pos0=ub)
        expect(clause, fi.failures(site) == 1, f"{site}: the armed failure did not fire")
        if site == "fused_head":  # the typed error names the op and the backend that lacks it
            named = re.search(r"needs ([A-Z_]+) on (\S+)", str(err.value))
            expect(clause, named is not None, f"no op and backend named in {str(err.value)!r}")
        expect("FAIL-04", ctx.sequence_length == 0, f"{site}: {ctx.sequence_length} positions left in the KV cache")
        expect(clause, tr.period_position == 0, f"{site}: the partial period survived ({tr.period_position})")
        accs = {n: tr.gradient_accumulator(n) for n in model.tensor_names()}
        live = [n for n, a in accs.items() if a is not None]
        expect(clause, bool(live), f"{site}: no accumulator exists after a backward pass")
        nonzero = [n for n in live if np.any(accs[n] != 0)]
        expect(clause, not nonzero, f"{site}: partial gradients kept in {nonzero[:3]}")
        # the binding's own view of the sequence went with it: the next decode starts at position 0
        differs = _unlike_a_fresh_sequence(ctx)
        expect("FAIL-04", differs is None, f"{site}: a decode right after the failed step: {differs}")
        # no leaked allocation: the same step failed again and again holds nothing more (ggml's own
        # counts of live contexts and backend buffers, patch 0029)
        held = []
        for _ in range(3):
            fi.reset()
            fi.arm(site, 1)
            with pytest.raises(retro.BeforeComputeError):
                micro_batch(tr, tokens[:ub], labels[:ub], pos0=0)
            held.append(live_allocations())
        expect(
            "FAIL-04",
            held[0] == held[1] == held[2],
            f"{site}: each failure of the same step left more allocated: (contexts, buffers) {[tuple(h) for h in held]}",
        )
        # and a step that closes a period (its own graph, the optimizer's step parameters with it):
        # each time one micro-batch opens the period and the closing one fails
        closing = []
        for _ in range(3):
            fi.reset()
            micro_batch(tr, tokens[:ub], labels[:ub], pos0=0)
            fi.arm(site, 1)
            with pytest.raises(retro.BeforeComputeError):
                micro_batch(tr, tokens[ub : 2 * ub], labels[ub : 2 * ub], pos0=ub)
            closing.append(live_allocations())
        expect(
            "FAIL-04",
            closing[0] == closing[1] == closing[2],
            f"{site}: each failure of a period-closing step left more allocated: (contexts, buffers) "
            f"{[tuple(h) for h in closing]}",
        )
        # a failing epoch call leaves no sequence behind: the next decode starts at position 0, as
        # one does after an explicit reset of the context
        fi.reset()
        fi.arm(site, 2)
        with pytest.raises(retro.BeforeComputeError):
            tr.epoch(ds)
        fi.reset()
        differs = _unlike_a_fresh_sequence(ctx)
        expect("FAIL-04", differs is None, f"{site}: a decode after the failed call: {differs}")
        expect(clause, tr.epoch(ds).epoch_complete and not tr.poisoned, f"{site}: the next call did not complete")

    # the evaluation tail: its failure drops the incomplete period of the training before it, as a
    # cancel there does (CANCEL-04); a training window of 3 micro-batches leaves one of 2 open
    with support.load(backend, model_path) as model, support.context(model, shape, n_ubatch=ub) as ctx:
        tail = support.windows(2, 3 * ub, model.n_vocab, seed + 23)
        passes: list[tuple[bool, int]] = []
        fi.reset()
        with _trainer(ctx, 2, "adamw", site) as clean:
            clean.epoch(tail, val_fraction=0.5, progress=support.recording(passes, lambda p: (p.train, fi.hits(site))))
            opened = clean.period_position
        trained = [hits for train, hits in passes if train]
        expect(
            "FAIL-04",
            len(trained) == 3 and opened == 1 and passes[-1][1] > trained[-1],
            f"{site}: the scenario is not an evaluation tail after an open period: {passes}, period {opened}",
        )
        fi.reset()
        fi.arm(site, trained[-1] + 1)  # the first time an evaluation micro-batch passes the site
        done: list[retro.Progress] = []
        with _trainer(ctx, 2, "adamw", site) as tr:
            with bound("FAIL-04"), pytest.raises(retro.BeforeComputeError):
                tr.epoch(tail, val_fraction=0.5, progress=support.recording(done))
            fi.reset()
            expect("FAIL-04", [p.train for p in done] == [True] * 3, f"{site}: it failed after {done}")
            tail_accs = [a for a in (tr.gradient_accumulator(n) for n in model.tensor_names()) if a is not None]
            kept = sum(1 for a in tail_accs if np.any(a != 0))
            expect(
                "FAIL-04",
                tr.period_position == 0 and bool(tail_accs) and not kept,
                f"{site}: a failure in the evaluation tail left period position {tr.period_position} and "
                f"{kept} of {len(tail_accs)} accumulators holding partial gradients",
            )
    if site == "alloc":
        _check_state_allocation_dropped(backend, shape, model_path, tokens, labels)


def _check_state_allocation_dropped(backend, shape: Shape, model_path, tokens, labels):
    """The optimizer's state, allocated by a trainer's first step one buffer type at a time (site
    opt_state, one hit per type; its parameters' own types): failed at each type in turn, the same
    first step failed three times holds nothing more, so the types allocated before the failing one
    were given back. On a backend that offloads, one layer on its device and the rest on the CPU
    puts the state in two types."""
    split = bool(backend.offload_devices)
    ub = shape.micro_batch
    with support.load(backend, model_path, gpu_layers=1) as model, support.context(model, shape, n_ubatch=ub) as ctx:
        fi.reset()
        with _trainer(ctx, 1, "adamw") as clean:
            micro_batch(clean, tokens[:ub], labels[:ub], pos0=0)
        types = fi.hits("opt_state")
        expect("FAIL-04e", types >= 1 + split, f"the first step allocated the optimizer state in {types} buffer types")
        for k in range(1, types + 1):
            held = []
            with _trainer(ctx, 1, "adamw") as tr:
                for _ in range(3):
                    fi.reset()
                    fi.arm("opt_state", k)
                    with pytest.raises(retro.AllocationError):
                        micro_batch(tr, tokens[:ub], labels[:ub], pos0=0)
                    held.append(live_allocations())
            fi.reset()
            expect(
                "FAIL-04e",
                held[0] == held[1] == held[2],
                f"opt_state at buffer type {k} of {types}: each failure left more allocated: (contexts, buffers) "
                f"{[tuple(h) for h in held]}",
            )


def _state_dropped_check(site: str):
    clause = BEFORE_COMPUTE[site][0]

    @pytest.mark.clause("FAIL-04", clause)
    def check(backend, model_path, seed, shape):
        _check_state_dropped(backend, shape, model_path, seed, site)

    check.__name__ = check.__qualname__ = f"test_{site}_failure_drops_the_step_state"
    check.__doc__ = f"{clause}: {_check_state_dropped.__doc__}"
    return check


# one check per site, each citing its own FAIL-04 sub-clause (and so run against its own defect)
for _site in BEFORE_COMPUTE:
    globals()[f"test_{_site}_failure_drops_the_step_state"] = _state_dropped_check(_site)


@pytest.mark.clause("FAIL-05")
@pytest.mark.parametrize("site", list(BEFORE_COMPUTE))
def test_after_a_before_compute_failure_the_next_call_equals_a_fresh_run(backend, model_path, seed, shape, site):
    """From a trained state (AdamW, accumulation 2), a call failing before compute, then a call
    that completes, equals the same trained state followed by that call alone."""
    with support.load(backend, model_path, trainable=False) as probe:
        warm = support.windows(1, shape.window, probe.n_vocab, seed + 23)
        failing = support.windows(1, shape.window, probe.n_vocab, seed + 24)
        later = support.windows(2, shape.window, probe.n_vocab, seed + 25)
    runs = []
    for fail in (True, False):
        with (
            support.load(backend, model_path) as model,
            support.context(model, shape, n_ubatch=shape.micro_batch) as ctx,
            _trainer(ctx, 2, "adamw", site) as tr,
        ):
            tr.epoch(warm)
            if fail:
                fi.arm(site, 2)  # the first micro-batch's gradient is pending when the second one fails
                # reported as anything but a failure before compute, it left the trainer unusable
                with raises_bound("FAIL-05", retro.BeforeComputeError):
                    tr.epoch(failing)
                fi.reset()
            after = succeeds("FAIL-05", f"{site}: the call after the failure", lambda: tr.epoch(later))
            expect(
                "FAIL-05",
                after is not None and after.epoch_complete,
                f"{site}: the call after the failure did not complete",
            )
            runs.append(model.parameters())
    with bound("FAIL-05"):
        support.assert_params_equal(runs[0], runs[1], backend, f"{site} failure then a call vs that call alone")
    # the step alone (retro.testing.micro_batch, no epoch around it to tidy up), at accumulation 4 (the
    # warm epoch ends at a boundary): a window's first micro-batch opens a period, the next window's
    # fails at its own first position; the trainer must be back at the period's start (a checkpoint
    # takes it) and the call after it must equal that call on the state before the period, whose
    # partial gradient is gone
    tokens, labels = failing.tokens[0], failing.labels[0]
    ub = shape.micro_batch
    alone = []
    for fail in (True, False):
        with (
            support.load(backend, model_path) as model,
            support.context(model, shape, n_ubatch=ub) as ctx,
            _trainer(ctx, 4, "adamw", site) as tr,
        ):
            tr.epoch(warm)
            if fail:
                micro_batch(tr, tokens[:ub], labels[:ub], pos0=0)
                fi.reset()
                fi.arm(site, 1)
                with raises_bound("FAIL-05", retro.BeforeComputeError):
                    micro_batch(tr, tokens[ub : 2 * ub], labels[ub : 2 * ub], pos0=0)
                fi.reset()
                expect(
                    "FAIL-05",
                    tr.period_position == 0,
                    f"{site}: the step alone left period position {tr.period_position}",
                )
                succeeds("FAIL-05", f"{site}: a checkpoint after the step alone failed", tr.checkpoint)
            after = succeeds("FAIL-05", f"{site}: the call after the step alone failed", lambda: tr.epoch(later))
            expect("FAIL-05", after is not None and after.epoch_complete, f"{site}: the call after the step alone")
            alone.append(model.parameters())
    with bound("FAIL-05"):
        support.assert_params_equal(alone[0], alone[1], backend, f"{site} step alone failed then a call vs the call")
    on_path(f"site={site}")


@pytest.mark.clause("FAIL-07")
def test_a_compute_failure_poisons_the_trainer(backend, model_path, seed, shape):
    """Every later call that computes or reads or writes training state raises
    PoisonedTrainerError, and none reaches the backend. The failure is real work failing: the
    first micro-batch's graph stops after some of its optimizer updates ran, so some weights took
    the step and others did not (a fault that failed before any update, or after all of them,
    would not be the failure this clause is about)."""
    with support.load(backend, model_path, trainable=False) as probe:
        ds = support.windows(1, shape.window, probe.n_vocab, seed + 26)
    with (
        support.load(backend, model_path) as model,
        support.context(model, shape, n_ubatch=shape.micro_batch) as ctx,
        _trainer(ctx) as tr,
    ):
        before = model.parameters()
        fi.arm("compute", 1)
        with pytest.raises(retro.ComputeError):
            tr.epoch(ds)
        expect("FAIL-07", tr.poisoned, "the compute failure was not recorded")
        moved = support.changed(before, model.parameters())
        # the input layer's rows move only where the batch's tokens are: left out of the count
        layers = set(before) - {"token_embd.weight"}
        expect(
            "FAIL-07",
            0 < len(moved & layers) < len(layers),
            f"{len(moved & layers)} of {len(layers)} weights moved: the fault did not stop the graph part-way",
        )
        computes = fi.hits("compute")
        for call in (lambda: tr.epoch(ds), lambda: tr.epoch(ds), tr.checkpoint):
            with bound("FAIL-07"), pytest.raises(retro.PoisonedTrainerError):
                call()
        expect("FAIL-07", fi.hits("compute") == computes, "a poisoned trainer reached the backend")


@pytest.mark.clause("FAIL-06")
@pytest.mark.parametrize("site", list(BEFORE_COMPUTE))
def test_steps_completed_before_a_failure_stay_applied(backend, model_path, seed, shape, site):
    """A before-compute failure at micro-batch k (one window each, accumulation 1): the
    parameters equal those of a run that completed the first k-1 micro-batches. (After a backend
    compute failure the parameters may be partly written: FAIL-07, not this clause.)"""
    with support.load(backend, model_path, trainable=False) as probe:
        ds = support.windows(4, shape.window, probe.n_vocab, seed + 27)
    k = 3
    with (
        support.load(backend, model_path) as model,
        support.context(model, shape) as ctx,
        _trainer(ctx, site=site) as tr,
    ):
        fi.arm(site, k)
        with pytest.raises(retro.TrainingError):
            tr.epoch(ds)
        failed = model.parameters()
    with (
        support.load(backend, model_path) as model,
        support.context(model, shape) as ctx,
        _trainer(ctx, site=site) as tr,
    ):
        fi.reset()
        tr.epoch(support.subset(ds, slice(0, k - 1)))
        completed = model.parameters()
    with bound("FAIL-06"):
        support.assert_params_equal(failed, completed, backend, f"{site} failure at {k} vs the {k - 1} steps before it")
    on_path(f"site={site}")


@pytest.mark.clause("FAIL-08")
def test_recovery_restores_a_checkpoint_and_training_continues_identically(backend, model_path, seed, shape, tmp_path):
    """A compute failure poisons the trainer after later steps moved the parameters on; a new
    trainer restoring a checkpoint (through a file) has the checkpoint's parameters, AdamW moments
    and cursor, and trains on exactly as the run that never failed."""
    with support.load(backend, model_path, trainable=False) as probe:
        first = support.windows(2, shape.window, probe.n_vocab, seed + 28)
        then = support.windows(2, shape.window, probe.n_vocab, seed + 29)
    adamw = retro.AdamW(lr=2e-3)
    with support.load(backend, model_path) as model, support.context(model, shape) as ctx:
        with retro.Trainer(ctx, optimizer=adamw) as tr:
            tr.epoch(first)
            saved = tr.checkpoint().save(tmp_path / "ckpt.npz")
            tr.epoch(then)
            never_failed = model.parameters()
    with support.load(backend, model_path) as model, support.context(model, shape) as ctx:
        with retro.Trainer(ctx, optimizer=adamw) as tr:
            tr.epoch(first)
            fi.arm("compute", 2)  # then's first step lands, its second fails
            with pytest.raises(retro.ComputeError):
                tr.epoch(then)
            expect("FAIL-08", tr.poisoned, "the trainer is not poisoned")
        ckpt = retro.Checkpoint.load(saved)
        expect(
            "FAIL-08",
            support.changed(ckpt.parameters, model.parameters()),
            "the failed call left the checkpoint's parameters: restoring would prove nothing",
        )
        with retro.Trainer(ctx, optimizer=adamw) as fresh:
            # a checkpoint that is not this model's is refused whole, before anything is written
            untouched = (model.parameters(), fresh.iteration)
            for what, damaged, kind in _damaged_checkpoints(ckpt):
                err = support.raised(lambda: fresh.restore(support.hostile(damaged)))
                expect("FAIL-08", type(err) is kind, f"restoring {what}: raised {err!r}, expected {kind.__name__}")
                now = (model.parameters(), fresh.iteration)
                expect(
                    "FAIL-08",
                    not support.changed(untouched[0], now[0]) and now[1] == untouched[1],
                    f"restoring {what} wrote into the model or the cursor before it was refused",
                )
            fresh.restore(ckpt)
            expect(
                "FAIL-08",
                fresh.iteration == ckpt.iteration == 3,
                f"cursor {fresh.iteration}, checkpoint {ckpt.iteration}",
            )
            with bound("FAIL-08"):
                support.assert_params_equal(model.parameters(), ckpt.parameters, backend, "restored parameters")
            for name, (m, v) in ckpt.moments.items():
                got = fresh.moments(name)
                with bound("FAIL-08"):
                    assert got is not None, f"{name}: no moments after restore"
                    support.assert_params_equal(
                        {"m": got[0], "v": got[1]}, {"m": m, "v": v}, backend, f"{name} moments"
                    )
            fresh.epoch(then)
            with bound("FAIL-08"):
                support.assert_params_equal(model.parameters(), never_failed, backend, "resumed vs never failed")
        # a checkpoint is taken, and restored, at an accumulation boundary only: 3 micro-batches of
        # a period of 2 leave one pending, which neither may drop or keep unseen
        with retro.Trainer(ctx, optimizer=adamw, accumulation=2) as mid:
            mid.epoch(support.windows(3, shape.window, model.n_vocab, seed + 27))
            expect("FAIL-08", mid.period_position == 1, f"period position {mid.period_position}, not 1")
            for what, call in (("checkpoint", mid.checkpoint), ("restore", lambda: mid.restore(ckpt))):
                with bound("FAIL-08"), pytest.raises(retro.InvalidStateError):
                    call()
                expect("FAIL-08", mid.period_position == 1, f"a refused {what} dropped the pending micro-batch")


def _damaged_checkpoints(ckpt: retro.Checkpoint) -> list[tuple[str, object, type]]:
    """(what, a checkpoint one detail of which does not fit the model, the typed error)."""
    params, moments = ckpt.parameters, ckpt.moments
    first = sorted(moments)[0]
    m, v = moments[first]
    return [
        ("a dictionary", {"parameters": params}, TypeError),
        (
            "a checkpoint missing a tensor",
            dataclasses.replace(ckpt, parameters=dict(list(params.items())[1:])),
            ValueError,
        ),
        (
            "a checkpoint with a tensor too many",
            dataclasses.replace(ckpt, parameters={**params, "extra": m}),
            ValueError,
        ),
        (
            "float64 parameters",
            dataclasses.replace(ckpt, parameters={n: a.astype(np.float64) for n, a in params.items()}),
            ValueError,
        ),
        ("a moment of another shape", dataclasses.replace(ckpt, moments={**moments, first: (m, v[:1])}), ValueError),
        ("a cursor of 0", dataclasses.replace(ckpt, iteration=0), ValueError),
    ]


#: the reference epoch of the sweep: a training window and an evaluation window, each in the
#: profile's micro-batches, accumulation 3 (the evaluation tail follows an open period), the fused
#: head (whose support question is a site of its own); every site is passed once per micro-batch
SWEEP_ACCUMULATION, SWEEP_VAL_FRACTION = 3, 0.5


def _one_step(tr: retro.Trainer, shape: Shape, ds) -> retro.RetroError | None:
    """What one training micro-batch of the dataset's first window raised (None: it ran)."""
    try:
        micro_batch(tr, ds.tokens[0, : shape.micro_batch], ds.labels[0, : shape.micro_batch], pos0=0)
    except retro.RetroError as err:
        return err
    return None


@pytest.mark.clause("HARNESS-02")
@pytest.mark.parametrize("persistent", [False, True], ids=["transient", "persistent"])
def test_every_site_fails_at_every_hit_of_a_reference_epoch(backend, model_path, seed, shape, persistent):
    """SQLite-style: for every fault site and every hit k that a clean reference epoch makes of it,
    an epoch armed at (site, k) fails in the micro-batch where the clean epoch passed the site for
    the k-th time (seen through its progress callbacks, not the hooks' own counters), with that
    site's error class and the state the contract leaves: after a before-compute failure the trainer
    is usable and the open period dropped (FAIL-04), after a compute failure it is poisoned
    (FAIL-07), in the training windows and in the evaluation tail alike. Armed persistently, the next
    call fails at the same site again. The sweep ends exactly at the site's last hit: armed one past
    it, the epoch completes."""
    with support.load(backend, model_path) as model, support.context(model, shape, n_ubatch=shape.micro_batch) as ctx:
        ds = support.windows(2, shape.window, model.n_vocab, seed + 30)

        def trainer() -> retro.Trainer:
            return retro.Trainer(ctx, optimizer=retro.SGD(lr=0.01), accumulation=SWEEP_ACCUMULATION, head="fused")

        # the clean epoch: how many times each site had been passed when each micro-batch ended
        passed: list[dict[str, int]] = []
        fi.reset()
        with trainer() as tr:
            tr.epoch(
                ds,
                val_fraction=SWEEP_VAL_FRACTION,
                progress=support.recording(passed, lambda p: {"train": p.train, **{s: fi.hits(s) for s in fi.SITES}}),
            )
            evaluated = sum(1 for p in passed if not p["train"])
        expect(
            "HARNESS-02",
            evaluated == shape.parts,
            f"the reference epoch evaluated {evaluated} micro-batches, not {shape.parts}",
        )
        totals = {s: fi.hits(s) for s in fi.SITES}
        # every site is reached, each micro-batch passing it once (the optimizer's state: once per
        # trainer, at its first step): a site no step reaches could never be armed
        per_batch = {s: [p[s] for p in passed] for s in fi.SITES if s not in PREPARATION}
        uneven = {s: hits for s, hits in per_batch.items() if hits != list(range(1, len(passed) + 1))}
        expect("HARNESS-02", not uneven, f"sites not passed once per micro-batch (hits after each): {uneven}")
        expect("HARNESS-02", all(totals[s] >= 1 for s in PREPARATION), f"preparation sites never reached: {totals}")
        fi.reset()
        for site in fi.SITES:
            cls, _ = SITES[site]
            completed: list[int] = []  # micro-batches completed before each injection failed

            def check(inj: fi.Injection) -> None:
                k, done = inj.hit, completed[-1]
                expected = sum(1 for p in passed if p[site] < k)
                expect(
                    "HARNESS-02",
                    type(inj.error) is cls,
                    f"{site} hit {k}: raised {type(inj.error).__name__}, expected {cls.__name__}",
                )
                expect(
                    "HARNESS-02",
                    done == expected,
                    f"{site} hit {k}: failed after {done} micro-batches; the clean epoch passed the site "
                    f"for the {k}th time in micro-batch {expected + 1}",
                )

            # each run builds its own trainer (sweep's rule), and the state it is left in is looked at there
            def epoch_and_state() -> None:
                done: list[retro.Progress] = []
                ctx.reset()
                with trainer() as tr:
                    try:
                        tr.epoch(ds, val_fraction=SWEEP_VAL_FRACTION, progress=support.recording(done))
                    except retro.RetroError:
                        completed.append(len(done))
                        if site == "compute":
                            expect("HARNESS-02", tr.poisoned, f"{site}: a compute failure left the trainer usable")
                        else:
                            expect(
                                "HARNESS-02",
                                not tr.poisoned and tr.period_position == 0,
                                f"{site}: poisoned={tr.poisoned}, period position {tr.period_position} after the failure",
                            )
                            if persistent:
                                with bound("HARNESS-02"), pytest.raises(cls):
                                    tr.epoch(ds)
                            else:  # armed once, the site failed once: the next step runs through
                                again = _one_step(tr, shape, ds)
                                expect(
                                    "HARNESS-02",
                                    again is None and fi.failures(site) == 1,
                                    f"{site} armed once at hit {fi.hits(site)}: the next step raised {again!r}, "
                                    f"{fi.failures(site)} failures",
                                )
                        raise

            result = fi.sweep(epoch_and_state, site, persistent=persistent, check=check)
            expect(
                "HARNESS-02",
                [i.hit for i in result.injections] == list(range(1, totals[site] + 1))
                and result.completed_after == totals[site],
                f"{site}: the sweep failed hits {[i.hit for i in result.injections]} and completed after "
                f"{result.completed_after}; the clean epoch passed the site {totals[site]} times",
            )
    on_path(f"persistent={persistent}")
