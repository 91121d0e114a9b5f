"""The packed-topology cache (seed 000, "Packed graph topology is rebuilt on every step"):
TOPO-01 (off by default: every step builds its graph, nothing of a graph is kept), TOPO-02 (an
immutable kept topology, and a disposable clone for the scheduler), TOPO-03 (every allocation
remaps the inputs and outputs; parameters, optimizer slots and accumulators stay), TOPO-04 (a
change of a key part misses), TOPO-05 (events invalidate the entry), TOPO-06 (one entry) and
TOPO-07 (enabling is gated on this build's evidence).

Observations come from the fork: its step timer (the nodes of the forward graph a step built), its
counters of hits, misses and invalidations with their reason, its walk of the kept graphs (sources
that are not their own tensors, tensors at a stale compute address), and ggml's counts of live
contexts and buffers. The oracle of every result is the same run with the cache off: bitwise on
the CPU, within the CPU-oracle tolerance elsewhere. The rebuild cost the cache removes is measured
with the cache off and on, side by side in one run, into results.json for the gate."""

from __future__ import annotations

import contextlib
import functools
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import retro
import retro.fault_injection as fi
from retro.conformance import gate, registry, results, support
from retro.conformance.evidence import bound, expect, measure, on_path
from retro.conformance.shapes import Shape
from retro.testing import last_step_forward_nodes, live_allocations, micro_batch, topology_walk, upstream_epoch


def _ungated(cache: bool | str) -> contextlib.AbstractContextManager[None]:
    """The checks' cache modes: off (False), or "forced", on without the gate whose evidence these
    checks make, through the test door."""
    return fi.ungated_topology_cache() if cache == "forced" else contextlib.nullcontext()


def _data(n_vocab: int, seed: int, shape: Shape, windows: int = 4, width: int | None = None) -> retro.TokenDataset:
    """Token windows of `width` tokens, the profile's window unless given."""
    return support.windows(windows, shape.window if width is None else width, n_vocab, seed)


#: sequence ids of a context that trains packed windows (one per document of a window, at most)
SEQUENCES = 4


def _packed(n_vocab: int, seed: int, shape: Shape, windows: int) -> retro.PackedDataset:
    """Windows of three documents (two of 25/64 of the window each, the third the rest): one
    geometry, so the cache can hit."""
    rng = np.random.default_rng(seed)
    long = shape.window * 25 // 64
    docs = [rng.integers(0, n_vocab, size=n) for _ in range(windows) for n in (long, long, shape.window - 2 * long)]
    return retro.PackedDataset.pack(docs, width=shape.window)


def _top_k(n_vocab: int, seed: int, shape: Shape, k: int, windows: int = 2) -> retro.TopKDataset:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, n_vocab, size=(windows, shape.window), dtype=np.int32)
    ids = rng.integers(0, n_vocab, size=(windows, shape.window, k), dtype=np.int32)
    return retro.TopKDataset(tokens, ids, np.full(ids.shape, 1.0 / k, np.float32))


def _n_vocab(backend, model_path) -> int:
    with support.load(backend, model_path, trainable=False) as probe:
        return probe.n_vocab


class _Run:
    """One trainer's run: its epochs' metrics, what the fork showed after every micro-batch, and
    the parameters at the end."""

    def __init__(self) -> None:
        self.metrics: list[retro.EpochMetrics] = []
        self.wall_s: list[float] = []  # each epoch call, on this process's clock
        self.built: list[int] = []  # forward nodes the step built
        self.walks: list[tuple[int, int]] = []
        self.live: list[tuple[int, int]] = []
        self.entry: list[bool] = []
        self.errors: list[str] = []
        self.stats: retro.topology.TopologyCacheStats | None = None
        self.params: dict[str, np.ndarray] = {}
        self.seen: list[tuple[str, bool, bool, int]] = []  # event, entry before, after, counted
        self.observe = lambda _p=None: True  # the progress callback of the run's epochs


def _run(
    backend,
    model_path,
    shape: Shape,
    cache: bool | str,
    steps,
    *,
    n_ctx: int | None = None,
    n_ubatch: int | None = None,
    head="dense",
    accumulation=1,
    opt=None,
    sequences=1,
    held_after_each_step: str | None = None,
):
    """`steps(trainer, context, run)` drives the trainer; every micro-batch of its epochs records
    the fork's observations. `held_after_each_step` names a clause that asserts, after each step
    and before the next one runs, that the one entry is held and ran in the allocations its misses
    made (a broken entry may abort the interpreter a few steps later). The context's n_ctx and
    n_ubatch are each the profile's window unless given."""
    run = _Run()
    n_ubatch = shape.window if n_ubatch is None else n_ubatch
    with (
        support.load(backend, model_path) as model,
        support.context(model, shape, n_ctx=n_ctx, n_ubatch=n_ubatch, sequences=sequences) as ctx,
    ):
        with (
            _ungated(cache),
            retro.Trainer(
                ctx,
                optimizer=opt or retro.AdamW(lr=1e-3),
                accumulation=accumulation,
                head=head,
                topology_cache=bool(cache),
            ) as tr,
        ):

            def observe(_p=None) -> bool:
                run.built.append(last_step_forward_nodes(ctx))
                run.walks.append(topology_walk(tr))
                contexts, buffers = live_allocations()
                run.live.append((contexts, buffers))
                stats = tr.topology_cache
                run.entry.append(stats.has_entry)
                if held_after_each_step and stats.enabled:
                    expect(
                        held_after_each_step,
                        stats.has_entry and stats.allocations <= stats.misses,
                        f"after step {len(run.entry)}: {stats}",
                    )
                return True

            run.observe = observe
            steps(tr, ctx, run)
            run.stats = tr.topology_cache
        run.params = model.parameters()
    return run


def _epochs(datasets, val_fraction=0.0):
    def steps(tr, ctx, run):
        for ds in datasets:
            start = time.perf_counter()
            run.metrics.append(tr.epoch(ds, val_fraction=val_fraction, progress=run.observe))
            run.wall_s.append(time.perf_counter() - start)

    return steps


def _measure_rebuild(cache: str, warm: retro.EpochMetrics, configuration: str) -> None:
    """The per-step rebuild cost of one warm epoch (forward build, backward build, allocation) for
    the gate (retro/_gate.py), which weighs the mean over every configuration measured: the
    cache's best case (accumulation 1) and the common ones (accumulation 3 with an evaluation tail;
    packed documents; the fused head)."""
    steps = warm.micro_batches

    def per_step(field: str) -> float:
        return 1e6 * getattr(warm, field) / steps

    measure(
        gate.MEASUREMENT,
        cache=cache,
        configuration=configuration,
        steps=steps,
        forward_build_us=per_step("graph_build_s"),
        backward_build_us=per_step("backward_build_s"),
        alloc_us=per_step("alloc_s"),
        step_us=per_step("compute_s")
        + per_step("staging_s")
        + per_step("backward_alloc_s")
        + per_step("graph_build_s"),
    )


def _same_as_oracle(clause: str, backend, on: _Run, off: _Run, what: str) -> None:
    with bound(clause):
        losses_on = np.array([m.train_loss for m in on.metrics])
        losses_off = np.array([m.train_loss for m in off.metrics])
        support.assert_close(losses_on, losses_off, backend, f"{what}: losses with the cache on")
        # the accuracies read outputs of the forward graph that a step of another kind must leave
        # alone: equal on the CPU, and within one token's argmax (a near tie) on other kernels
        for field in ("train_accuracy", "eval_accuracy"):
            for m_on, m_off in zip(on.metrics, off.metrics, strict=True):
                a_on, a_off = getattr(m_on, field) or 0.0, getattr(m_off, field) or 0.0
                slack = 0.0 if backend.name == "cpu" else 1.0 / max(1, m_off.physical_tokens)
                assert abs(a_on - a_off) <= slack, f"{what}: {field} with the cache on {a_on}, off {a_off}"
        support.assert_params_equal(on.params, off.params, backend, f"{what}: parameters with the cache on")


@pytest.mark.clause("TOPO-01")
def test_by_default_every_step_builds_its_graph_and_keeps_none(backend, model_path, shape, seed):
    """A trainer that did not ask for the cache: the fork reports it off, every micro-batch built
    its forward graph (the fork's step timer), no entry is held after any step, and ggml's live
    contexts stay as many, and buffers step for step those of the first of two like epochs (what
    persists is metadata storage, not a graph per step)."""
    n_vocab = _n_vocab(backend, model_path)
    run = _run(
        backend, model_path, shape, False, _epochs([_data(n_vocab, seed, shape), _data(n_vocab, seed + 1, shape)], 0.25)
    )
    steps = sum(m.micro_batches for m in run.metrics)
    expect("TOPO-01", not run.stats.enabled, "the cache is on in a trainer that did not ask for it")
    expect(
        "TOPO-01",
        len(run.built) == steps and all(n > 0 for n in run.built),
        f"forward nodes built per step: {run.built}",
    )
    expect("TOPO-01", not any(run.entry), "a graph is held across steps with the cache off")
    expect("TOPO-01", run.stats.hits == 0, f"{run.stats.hits} steps ran a kept graph")
    first = run.metrics[0].micro_batches
    expect(
        "TOPO-01",
        run.live[first:] == run.live[:first] and len({c for c, _ in run.live}) == 1,
        f"live ggml contexts and buffers after each step of two epochs alike: {run.live}",
    )


@pytest.mark.clause("TOPO-02")
def test_the_cache_keeps_an_immutable_topology_and_the_scheduler_gets_a_clone(backend, model_path, shape, seed):
    """With the cache on, after every micro-batch the fork's walk of the kept graphs finds no
    source that is not their own tensor (a scheduler copy; the graph splits across backends off
    the CPU, where llama.cpp keeps the input layer) and no tensor at a compute address other than
    a remapped input or output of the current clone; hits run without building, and without
    allocating at any accumulation period: at 1, and at 2 with an evaluation tail, where the
    gradient-only, optimizer and evaluation steps all run the one clone the scheduler holds
    (their allocations are the misses). The rebuild cost
    per step (forward build, backward build, allocation) is measured with the cache off and on,
    the two runs side by side, for the gate: over the second epoch, after one that warms both up
    (the entry is made by the first step; a miss costs a whole rebuild)."""
    n_vocab = _n_vocab(backend, model_path)
    data = [_data(n_vocab, seed, shape), _data(n_vocab, seed + 1, shape, windows=8)]
    off = _run(backend, model_path, shape, False, _epochs(data))
    on = _run(backend, model_path, shape, "forced", _epochs(data))
    with bound("TOPO-02"):
        assert on.stats.enabled and on.stats.hits > 0, f"the cache ran no kept graph: {on.stats}"
        assert all(w == (0, 0) for w in on.walks), f"walk of the kept graphs per step (foreign, stale): {on.walks}"
        assert [n > 0 for n in on.built].count(True) == on.stats.misses, f"steps that built: {on.built}, {on.stats}"
        # at accumulation 1 the scheduler still holds a hit's clone: only the steps that built allocate
        assert on.stats.allocations == on.stats.misses, f"hits allocated a clone again: {on.stats}"
    # every step kind runs the optimizer graph's clone: a gradient-only step, the optimizer's, and an
    # evaluation after them hit without allocating (the first step of the run is its one miss)
    shared = _run(backend, model_path, shape, "forced", _epochs(data, 0.25), n_ubatch=shape.window // 2, accumulation=2)
    with bound("TOPO-02"):
        assert shared.stats.misses == 1 and shared.stats.hits > 0, f"accumulation 2, evaluation tail: {shared.stats}"
        assert shared.stats.allocations == shared.stats.misses, f"hits allocated a clone again: {shared.stats}"
        assert all(w == (0, 0) for w in shared.walks), f"walk of the kept graphs per step: {shared.walks}"
    for cache, r in (("off", off), ("on", on)):
        warm = r.metrics[1]
        steps = warm.micro_batches
        # the figures the gate weighs are times: each phase within the epoch's own duration on
        # this process's clock, the disjoint ones summed too; a step that built its graph took at
        # least 10 ns a forward node (the fork's count) to build it
        phases = {f: getattr(warm, f) for f in ("staging_s", "graph_build_s", "backward_alloc_s", "compute_s")}
        phases |= {f: getattr(warm, f) for f in ("backward_build_s", "alloc_s")}
        expect(
            "TOPO-02",
            all(0.0 <= v <= r.wall_s[1] for v in phases.values())
            and sum(phases[f] for f in ("staging_s", "graph_build_s", "backward_alloc_s", "compute_s")) <= r.wall_s[1],
            f"cache {cache}: phases {phases} against the epoch's {r.wall_s[1]:.6f} s",
        )
        built = sum(r.built[len(r.built) - steps :])
        expect(
            "TOPO-02",
            warm.graph_build_s >= 10e-9 * built,
            f"cache {cache}: {built} forward nodes built in {warm.graph_build_s:.3e} s",
        )

        _measure_rebuild(cache, warm, "accumulation 1, token windows, dense head")
    _same_as_oracle("TOPO-02", backend, on, off, "period 1")


@pytest.mark.clause("TOPO-03")
@pytest.mark.parametrize("head", ["dense", "fused"])
@pytest.mark.parametrize("kind", ["token", "packed"])
def test_every_allocation_remaps_inputs_and_outputs_and_keeps_the_state(backend, model_path, shape, seed, kind, head):
    """Accumulation over three micro-batches alternates the gradient and the optimizer graph, with a
    period running across an evaluation tail that runs the forward graph, all in the optimizer graph's one clone with the nodes
    past their own muted: with the cache on, the losses, accuracies and every parameter after AdamW
    steps equal those with it off, so the allocation gave each step its own inputs and targets,
    read its own loss and kept parameters, moments and accumulators, and no step ran another
    kind's nodes; for token windows and packed documents (whose positions and sequences are
    inputs too), on the dense and the fused head."""
    n_vocab = _n_vocab(backend, model_path)
    make = _data if kind == "token" else _packed
    data = [make(n_vocab, seed, shape, windows=5), make(n_vocab, seed + 2, shape, windows=5)]
    # a period of 3 over 8 training micro-batches (two a window) runs across the evaluation tail:
    # an evaluation that moved it would shift the next epoch's optimizer steps
    how = {"n_ubatch": shape.window // 2, "accumulation": 3, "head": head, "sequences": SEQUENCES}
    off = _run(backend, model_path, shape, False, _epochs(data, 0.2), **how)
    on = _run(backend, model_path, shape, "forced", _epochs(data, 0.2), **how)
    expect("TOPO-03", on.stats.hits > on.stats.misses, f"the steps did not run the kept graphs: {on.stats}")
    expect("TOPO-03", all(w[0] == 0 for w in on.walks), f"scheduler copies in the kept graphs: {on.walks}")
    _same_as_oracle("TOPO-03", backend, on, off, f"{kind} windows, {head} head, accumulation 3 with an evaluation tail")
    for cache, r in (("off", off), ("on", on)):
        _measure_rebuild(cache, r.metrics[1], f"accumulation 3, {kind} windows, {head} head, evaluation tail")
    with bound("TOPO-03"):
        support.assert_close(
            np.array([m.eval_loss for m in on.metrics]),
            np.array([m.eval_loss for m in off.metrics]),
            backend,
            "eval loss",
        )
    on_path(f"head={head}", f"kind={kind}")


@pytest.mark.clause("TOPO-04")
def test_a_change_of_each_key_part_misses_the_cache(backend, model_path, shape, seed):
    """Each key part changed alone misses with that part's reason in the fork's counters, and the
    run equals the cache-off one: the target count (k 4, then 2, on either head), the step kind (an
    evaluation micro-batch, then a training one) and the token geometry (a window over a KV cache
    whose view grows: two windows' tokens in micro-batches of half a window). The loss head and the
    trainable tensors cannot change within a trainer (it keeps both for its life), so they cannot
    miss there."""
    n_vocab = _n_vocab(backend, model_path)
    targets = [_top_k(n_vocab, seed, shape, 4), _top_k(n_vocab, seed + 1, shape, 2)]
    for head in retro.training.HEADS:  # both heads' inputs are k pairs per token
        off = _run(backend, model_path, shape, False, _epochs(targets), head=head, opt=retro.SGD(lr=0.5))
        on = _run(backend, model_path, shape, "forced", _epochs(targets), head=head, opt=retro.SGD(lr=0.5))
        expect("TOPO-04", on.stats.misses_by["targets"] == 1, f"{head} head, k 4 then 2: {on.stats.misses_by}")
        _same_as_oracle("TOPO-04", backend, on, off, f"{head} head, k 4 then 2")

    window = _data(n_vocab, seed + 3, shape, windows=1)
    tokens, labels = window.tokens[0], window.labels[0]

    def kinds(tr, ctx, run):
        for train in (False, True, True):
            try:
                micro_batch(tr, tokens, labels, train=train)
            except retro.RetroError as e:
                run.errors.append(f"{type(e).__name__}: {e}")
        run.metrics.append(tr.epoch(_data(n_vocab, seed + 4, shape, windows=1)))

    off = _run(backend, model_path, shape, False, kinds)
    on = _run(backend, model_path, shape, "forced", kinds)
    expect("TOPO-04", not on.errors and not off.errors, f"evaluation then training: {on.errors or off.errors}")
    expect("TOPO-04", on.stats.misses_by["kind"] >= 1, f"evaluation then training: {on.stats.misses_by}")
    _same_as_oracle("TOPO-04", backend, on, off, "evaluation then training")

    two_windows, half_window = 2 * shape.window, shape.window // 2
    grow = [_data(n_vocab, seed + 5, shape, windows=2, width=two_windows)]
    off = _run(backend, model_path, shape, False, _epochs(grow), n_ctx=two_windows, n_ubatch=half_window)
    on = _run(backend, model_path, shape, "forced", _epochs(grow), n_ctx=two_windows, n_ubatch=half_window)
    expect("TOPO-04", on.stats.misses_by["geometry"] >= 1, f"a growing KV view: {on.stats.misses_by}")
    _same_as_oracle("TOPO-04", backend, on, off, "a growing KV view")


def _faults_between_epochs(n_vocab: int, seed: int, shape: Shape):
    """Epochs with an event before each: a decode (generation, scoring), a preflight, a checkpoint
    restore (the optimizer state made again), an epoch of upstream's own loop (graphs of its own
    laid out on the scheduler), and a step failing at each before-compute site a
    step that runs the entry reaches (a hit builds nothing, so the build and metadata sites are
    reached only by a miss, which has dropped the entry already; a hit allocates nothing either, at
    any accumulation period: _no_allocation_at_a_hit holds that)."""
    data = _data(n_vocab, seed, shape, windows=2)
    sites = ["batch_init", "memory_init", "output_reserve"]

    def steps(tr, ctx, run):
        run.metrics.append(tr.epoch(data, progress=run.observe))

        def decode() -> None:
            ctx.decode(data.tokens[0, : shape.micro_batch // 4])  # a short prompt
            ctx.reset()

        # (what happens, the reason the fork counts it under, the event)
        events: list[tuple[str, str, Callable[[], object]]] = [
            ("decode", "decode", decode),
            ("preflight", "preflight", lambda: tr.preflight(data)),
            ("restore", "layout", lambda: tr.restore(tr.checkpoint())),
            ("upstream's loop", "layout", lambda: upstream_epoch(tr, data)),
        ]
        for site in sites:
            events.append((f"a step failing at {site}", "error", functools.partial(_fail_once, tr, data, site)))
        for what, reason, event in events:
            before = tr.topology_cache
            event()
            after = tr.topology_cache
            counted = after.invalidations_by[reason] - before.invalidations_by[reason]
            run.seen.append((what, before.has_entry, after.has_entry, counted))
            run.metrics.append(tr.epoch(data, progress=run.observe))

    return steps


def _no_allocation_at_a_hit(n_vocab: int, seed: int, shape: Shape):
    """Accumulation 2 with an evaluation tail: the gradient-only, optimizer and evaluation steps all
    run the entry's one clone, so the allocation site, armed for a whole epoch of hits, is never
    reached there (a failure at it could only come from a miss, which has dropped the entry
    already); the entry and the run go on as with the cache off."""
    data = _data(n_vocab, seed + 6, shape, windows=4)

    def steps(tr, ctx, run):
        run.metrics.append(tr.epoch(data, val_fraction=0.25, progress=run.observe))
        before = tr.topology_cache
        if before.enabled:  # with the cache off every step allocates: the oracle's run is left alone
            fi.arm("alloc", 1)
        try:
            run.metrics.append(tr.epoch(data, val_fraction=0.25, progress=run.observe))
        finally:
            failed = fi.failures("alloc")
            fi.reset()
        after = tr.topology_cache
        hits = after.hits - before.hits
        run.seen.append(("an epoch of hits with the allocation site armed", hits, failed, after.has_entry))

    return steps


def _fail_once(tr: retro.Trainer, data, site: str) -> int:
    """An epoch failing at the site's first hit: how many failures the hooks made."""
    fi.arm(site, 1)
    try:
        tr.epoch(data)
    except retro.BeforeComputeError:
        pass
    finally:
        failed = fi.failures(site)
        fi.reset()
    return failed


@pytest.mark.clause("TOPO-05")
def test_decodes_preflights_restores_and_failed_steps_invalidate_the_entry(backend, model_path, shape, seed):
    n_vocab = _n_vocab(backend, model_path)
    off = _run(backend, model_path, shape, False, _faults_between_epochs(n_vocab, seed, shape))
    on = _run(backend, model_path, shape, "forced", _faults_between_epochs(n_vocab, seed, shape))
    for name, had, has, counted in on.seen:
        expect(
            "TOPO-05", had and not has and counted == 1, f"{name}: entry before {had}, after {has}, counted {counted}"
        )
    _same_as_oracle("TOPO-05", backend, on, off, "events between epochs")

    how = {"n_ubatch": shape.window // 2, "accumulation": 2}
    off = _run(backend, model_path, shape, False, _no_allocation_at_a_hit(n_vocab, seed, shape), **how)
    on = _run(backend, model_path, shape, "forced", _no_allocation_at_a_hit(n_vocab, seed, shape), **how)
    for name, hits, failed, has in on.seen:
        expect("TOPO-05", hits > 0 and failed == 0 and has, f"{name}: {hits} hits, {failed} failed, entry {has}")
    _same_as_oracle("TOPO-05", backend, on, off, "an epoch of hits with the allocation site armed, accumulation 2")


@pytest.mark.clause("TOPO-06")
def test_the_cache_holds_one_entry(backend, model_path, shape, seed):
    """Epochs whose target count alternates (k 4, then 2), each with an evaluation tail: every
    epoch's first training step misses and replaces the entry, and its evaluation runs the entry
    the training left. The fork holds one entry after every step (a replacement counts no
    invalidation), and ggml's live contexts and buffers after every step of the later epochs are
    those of the first epoch's steps (replaced entries and their clones are freed). Training alone
    at accumulation 2, every step hits the entry and allocates nothing, so the counts after the
    first period repeat those of the first period."""
    n_vocab = _n_vocab(backend, model_path)
    alternating = [_top_k(n_vocab, seed + i, shape, 4 if i % 2 == 0 else 2) for i in range(4)]
    on = _run(backend, model_path, shape, "forced", _epochs(alternating, 0.5), held_after_each_step="TOPO-06")
    with bound("TOPO-06"):
        assert on.stats.misses_by["targets"] >= 3, f"the target counts did not alternate: {on.stats}"
        assert on.stats.hits >= 4, f"the evaluations did not run the training's entry: {on.stats}"
        assert all(on.entry), "a step left no entry"
        # a miss replaces the entry: no event, so no invalidation is counted (TOPO-05 counts events)
        assert on.stats.invalidations == 0, f"replacing the entry was counted as an event: {on.stats}"
        first = set(on.live[:2])
        grown = [(i, lv) for i, lv in enumerate(on.live[2:], start=2) if lv not in first]
        assert not grown, f"live contexts and buffers grew after the first epoch: {grown[:3]} (first {first})"
    data = [_data(n_vocab, seed + i, shape, windows=2) for i in range(3)]
    hits = _run(backend, model_path, shape, "forced", _epochs(data), accumulation=2, held_after_each_step="TOPO-06")
    with bound("TOPO-06"):
        assert hits.stats.hits >= 4 and all(hits.entry), f"training alone did not hit the entry: {hits.stats}"
        period = set(hits.live[:2])  # two micro-batches per epoch, one period
        grown = [(i, lv) for i, lv in enumerate(hits.live[2:], start=2) if lv not in period]
        assert not grown, f"live contexts and buffers grew after the first period: {grown[:3]} (first {period})"


def _package(
    tmp_path,
    backend,
    *,
    series: str | None = None,
    failing: tuple[str, ...] = (),
    unnamed: str | None = None,
    other: str | None = None,
):
    """A results package of this build whose gate enables the cache for `backend` (every gated clause
    passing, the rebuild 95 % removed), or refuses it (the clauses `failing` fail on `backend`), or
    comes from another patch series, or names no build for the run field `unnamed`; `other` adds a
    backend the model does not run on, whose gate refuses (TOPO-05 fails there)."""
    info = retro.build_info()
    run = {
        "start_time": "2026-01-01T00:00:00+00:00",
        "retro": retro.__version__,
        "llama_cpp": info["llama_cpp_commit"],
        "patch_series_sha256": series or info["patch_series_sha256"],
    }
    if unnamed:
        del run[unnamed]
    names = sorted({"cpu", backend.name} | ({other} if other else set()))
    cases = [
        {
            "id": f"rebuild-{name}-{cache}",
            "clauses": ["TOPO-02"],
            "backend": name,
            "defect": None,
            "outcome": "pass",
            "duration_s": 0.0,
            "message": "",
            "caught": None,
            "measurements": [
                {
                    "name": gate.MEASUREMENT,
                    "cache": cache,
                    "forward_build_us": cost,
                    "backward_build_us": 0.0,
                    "alloc_us": 0.0,
                }
            ],
        }
        for name in names
        for cache, cost in (("off", 100.0), ("on", 5.0))
    ]
    res = {
        "schema": results.SCHEMA,
        "run": run,
        "shards": [run],
        "selected": list(registry.clauses()),
        "backends": {n: {"status": "available", "reason": ""} for n in names},
        "clauses": {c: dict.fromkeys(names, "pass") for c in registry.clauses()},
        "clause_details": {c: dict.fromkeys(names, "") for c in registry.clauses()},
        "cases": cases,
        "verdict": dict.fromkeys(names, "certified"),
    }
    for clause in failing:
        res["clauses"][clause][backend.name] = "fail"
    if other:
        res["clauses"]["TOPO-05"][other] = "fail"
    res["gates"] = {gate.NAME: gate.decide(res)}
    res["digest"] = results.digest(res)
    folder = tmp_path / f"package-{series or 'this'}-{len(failing)}-{unnamed or ''}-{other or ''}"
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps(res), encoding="utf-8")
    return folder


@pytest.mark.clause("TOPO-07")
def test_switching_the_cache_on_needs_this_builds_passing_gate(backend, model_path, shape, tmp_path):
    """topology_cache=True with no package, a refusing one or one of another patch series raises the
    typed error naming what is missing (each missing piece of evidence, the gate's own list, and past
    six a count of the rest), before a trainer exists; with a package of this build whose
    gate enables the cache for this backend it is on; only the test door's waiver, for the checks that
    make the evidence, needs none, and the API is gated again once it ends; any other value ("forced",
    a string that reads as "on", a number) is refused as bad input, never taken as a wish that skips
    the gate."""
    enabling = _package(tmp_path, backend)
    refusing = _package(tmp_path, backend, failing=("TOPO-05",))
    foreign = _package(tmp_path, backend, series="0" * 64)
    unnamed = [_package(tmp_path, backend, unnamed=key) for key in ("retro", "llama_cpp", "patch_series_sha256")]
    # a backend the model does not run on refuses: the model's own backends decide
    beside = _package(tmp_path, backend, other="vulkan" if backend.name == "cuda" else "cuda")
    with support.load(backend, model_path) as model, support.context(model, shape) as ctx:
        refusals = [(None, "needs a results package"), (refusing, "TOPO-05 on"), (foreign, "another build")]
        refusals += [(package, "another build") for package in unnamed]  # a shard that names no build
        for package, why in refusals:
            with bound("TOPO-07"), pytest.raises(retro.TopologyGateError, match=why):
                retro.Trainer(ctx, topology_cache=True, topology_gate=package)
        # the error names what is missing, the whole of it: each missing piece of evidence, the
        # gate's own list, and past six a count of the rest
        targets = retro.topology.backends_of(model.tensor_devices())
        many = tuple(c for c in registry.clauses() if c.startswith(("TOPO", "FAIL")))
        for package in (refusing, _package(tmp_path, backend, failing=many)):
            missing = gate.decide(json.loads((package / "results.json").read_text(encoding="utf-8")), targets)
            shown = missing["missing"][:6] + (
                [f"and {len(missing['missing']) - 6} more"] if len(missing["missing"]) > 6 else []
            )
            with bound("TOPO-07"), pytest.raises(retro.TopologyGateError) as refused:
                retro.Trainer(ctx, topology_cache=True, topology_gate=package)
            expect(
                "TOPO-07",
                str(refused.value).endswith(f"by {package / 'results.json'}: " + "; ".join(shown)),
                f"{len(missing['missing'])} missing, the error says: {refused.value}",
            )
        for package in (enabling, beside):
            try:
                with retro.Trainer(ctx, topology_cache=True, topology_gate=package) as tr:
                    enabled, why = tr.topology_cache.enabled, "the cache is off"
            except retro.TopologyGateError as err:
                enabled, why = False, str(err)
            expect("TOPO-07", enabled, f"a gate that enables the model's backends was refused ({package.name}): {why}")
        with fi.ungated_topology_cache(), retro.Trainer(ctx, topology_cache=True) as tr:
            expect("TOPO-07", tr.topology_cache.enabled, "the test door's waiver left the cache off")
        # the waiver ends with its block, however the block ends: the API is gated again
        with pytest.raises(KeyboardInterrupt), fi.ungated_topology_cache():
            raise KeyboardInterrupt
        with bound("TOPO-07"), pytest.raises(retro.TopologyGateError):
            retro.Trainer(ctx, topology_cache=True)
        with retro.Trainer(ctx) as tr:
            expect("TOPO-07", not tr.topology_cache.enabled, "the cache is on without being asked for")
        # a spelling of "on" the binding does not know is refused, not taken as a wish that skips the gate
        unknown: tuple[Any, ...] = ("forced", "on", "True", 1, 2.0, None)  # what a caller may pass untyped
        for mode in unknown:
            with bound("TOPO-07"), pytest.raises(ValueError, match="topology_cache must be"):
                retro.Trainer(ctx, topology_cache=mode)
