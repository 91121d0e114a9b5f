"""Host buffers (seed 000, "Host buffers") of packed datasets: HOST-01 (the caller's arrays are
read in place for the call, not kept), HOST-03 (the row plan: built once per call, its spans and
padding those of a reference computed here), HOST-04 (physical tokens are what llama.cpp computed,
padding included; logical apart) and HOST-06 (the packed batch keeps one token/membership
geometry and is replaced when either changes). Several documents share each window; every
document is its own sequence, so the loss of a packed window is held against numpy's over each
document decoded alone: the independent proof that attention stays inside a document and that
positions restart."""

from __future__ import annotations

import weakref

import numpy as np
import pytest

import retro
from retro.conformance import support
from retro.conformance.evidence import Bound, bound, expect, on_path, succeeds, within
from retro.conformance.shapes import Shape
from retro.testing import last_step_tokens, micro_batch, packed_batch

SEQUENCES = 16  # sequence ids of the checks' contexts: more than any micro-batch here needs
#: a packed loss against numpy's over per-document decodes, relative (float32 sums in another
#: order); attention across documents moves it by O(1e-2)
PACKED_LOSS = Bound(
    "HOST-06 packed eval loss vs numpy over each document alone, relative",
    1e-5,
    cpu=2e-6,
    reason="lavapipe measures 1.2e-6, the GPU-like server 1.9e-6: a GPU's attention sums each document's "
    "rows in its own order; 5x the GPU-like server's",
)


def _n_vocab(backend, model_path) -> int:
    with support.load(backend, model_path, trainable=False) as probe:
        return probe.n_vocab


def _documents(n_vocab: int, seed: int, lengths: list[int]) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, n_vocab, size=n, dtype=np.int32) for n in lengths]


def _packed(n_vocab: int, seed: int, shape: Shape, *, windows: int = 3, weighted: bool = False) -> retro.PackedDataset:
    """Windows of documents of 1 token to a little more than a micro-batch (a 1-token one has no
    target), the first window opening with a 1-token document (its boundary is at token 1, the
    earliest there is), the last window short, a micro-batch and part of the next, so that its
    padding fills part of a micro-batch and whole micro-batches after it."""
    rng = np.random.default_rng(seed)
    lengths: list[int] = [1]
    while sum(lengths) < (windows - 1) * shape.window + shape.micro_batch + 26:
        lengths.append(int(rng.choice([1, 2, *range(5, shape.micro_batch + 7)])))
    # padded with the last id, as a tokenizer's pad id is seldom 0
    ds = retro.PackedDataset.pack(_documents(n_vocab, seed + 1, lengths), width=shape.window, pad_token=n_vocab - 1)
    if weighted:
        weights = rng.choice(np.array([0.0, 0.5, 1.0, 2.0], np.float32), size=ds.tokens.shape)
        ds = retro.PackedDataset(ds.tokens, ds.documents, np.ascontiguousarray(weights))
    return ds


def _reference_plan(ds: retro.PackedDataset, n_ubatch: int, n_train: int, n_seq: int):
    """The row plan computed here, independently of the native one: a window's active span runs
    to the end of its last document; it is cut into micro-batches of n_ubatch, the last padded
    up to n_ubatch; each document is a sequence (ids round-robin), positions restart in each."""
    steps, seq, pos = [], np.zeros(ds.tokens.size, np.int32), np.zeros(ds.tokens.size, np.int32)
    for w in range(ds.n_windows):
        docs = ds.documents[w]
        span = int((docs != retro.datasets.PADDING).sum())
        starts = np.r_[True, (docs[1:] != docs[:-1]) & (np.arange(1, ds.width) < span)]
        first = np.maximum.accumulate(np.where(starts, np.arange(ds.width), 0))
        row = slice(w * ds.width, (w + 1) * ds.width)
        seq[row] = (np.cumsum(starts) - 1) % n_seq
        pos[row] = np.arange(ds.width) - first
        for off in range(0, span, n_ubatch):
            steps.append((w, w * ds.width + off, n_ubatch, min(n_ubatch, span - off), int(w < n_train)))
    return np.array(steps, dtype=np.int64).reshape(-1, 5), seq, pos


def _train(
    backend, model_path, shape: Shape, ds, *, n_ubatch: int, lr: float = 0.25, progress=None, val_fraction: float = 0.0
):
    with support.load(backend, model_path) as model:
        with support.context(model, shape, n_ubatch=n_ubatch, sequences=SEQUENCES) as ctx:
            with retro.Trainer(ctx, optimizer=retro.SGD(lr=lr)) as tr:
                m = tr.epoch(ds, progress=progress, val_fraction=val_fraction)
        return model.parameters(), m


def _copy(ds: retro.PackedDataset) -> retro.PackedDataset:
    w = None if ds.weights is None else ds.weights.copy()
    return retro.PackedDataset(ds.tokens.copy(), ds.documents.copy(), w)


@pytest.mark.clause("HOST-01")
@pytest.mark.drives("kind=packed")
def test_packed_arrays_are_read_in_place_and_not_kept(backend, model_path, shape, seed):
    """A progress callback rewrites the second window's tokens and weights in the caller's own
    arrays after the first window's micro-batch: the run equals a run on the rewritten arrays (a
    copy taken at the call would train on the old ones). Once the call returned and the caller
    dropped the dataset, its arrays are freed while trainer, context and model are still open."""
    n_vocab = _n_vocab(backend, model_path)
    ds = _packed(n_vocab, seed + 70, shape, windows=2, weighted=True)
    other = _packed(n_vocab, seed + 71, shape, windows=2, weighted=True)
    caller = {"dataset": ds}

    def rewrite_second_window(p: retro.Progress) -> None:
        if p.done == 1:
            target = caller["dataset"]
            assert target.weights is not None and other.weights is not None
            target.tokens[1] = other.tokens[0]
            target.weights[1] = other.weights[0]

    refs = {
        "tokens": weakref.ref(ds.tokens),
        "documents": weakref.ref(ds.documents),
        "weights": weakref.ref(ds.weights),
    }
    with support.load(backend, model_path) as model, support.context(model, shape, sequences=SEQUENCES) as ctx:
        with retro.Trainer(ctx, optimizer=retro.SGD(lr=0.25)) as tr:
            tr.epoch(ds, progress=rewrite_second_window)
            borrowed = model.parameters()
            rewritten, _ = _train(backend, model_path, shape, _copy(ds), n_ubatch=shape.window)
            with bound("HOST-01"):
                support.assert_params_equal(
                    borrowed, rewritten, backend, "packed: rewritten during the call vs rewritten before it"
                )
            del ds
            caller.clear()
            alive = support.released(refs)
            expect("HOST-01", not alive, f"the caller dropped the packed dataset, yet its {alive} live on")
            on_path("kind=packed")


@pytest.mark.clause("HOST-03")
@pytest.mark.parametrize("micro_batch", ["part", "window"])
def test_the_row_plan_is_the_reference_and_built_once_per_call(backend, model_path, shape, seed, micro_batch):
    """The plan the native loop iterates (Trainer.plan) equals the reference computed here: its
    micro-batches, their padding and each token's sequence and position, with an evaluation tail;
    the epoch runs exactly the plan's micro-batches. Built once per call: a membership the progress
    callback rewrites after the first micro-batch changes nothing of the call (it trains as the
    memberships it started with), while tokens and weights are read in place (HOST-01)."""
    n_ubatch = shape.window if micro_batch == "window" else shape.micro_batch
    n_vocab = _n_vocab(backend, model_path)
    ds = _packed(n_vocab, seed + 72, shape, windows=4, weighted=True)
    with (
        support.load(backend, model_path) as model,
        support.context(model, shape, n_ubatch=n_ubatch, sequences=SEQUENCES) as ctx,
    ):
        with retro.Trainer(ctx, optimizer=retro.SGD(lr=0.25)) as tr:
            plan = tr.plan(ds, val_fraction=0.25)
            steps, seq, pos = _reference_plan(ds, ctx.training_ubatch, 3, ctx.sequences)
            expect(
                "HOST-03",
                plan.steps.shape == steps.shape and np.array_equal(plan.steps, steps),
                f"plan steps (window, offset, tokens, active, train) {plan.steps.tolist()[:8]} vs reference {steps.tolist()[:8]}",
            )
            expect("HOST-03", np.array_equal(plan.seq, seq), "the plan's sequence ids differ from the reference's")
            expect("HOST-03", np.array_equal(plan.pos, pos), "the plan's positions differ from the reference's")
            totals: dict[bool, int] = {}
            m = tr.epoch(ds, val_fraction=0.25, progress=lambda p: totals.__setitem__(p.train, p.total))
            planned = {True: int(steps[:, 4].sum()), False: int((1 - steps[:, 4]).sum())}
            expect("HOST-03", totals == planned, f"the epoch's phases had {totals} micro-batches, planned {planned}")
            expect(
                "HOST-03",
                (m.train_micro_batches, m.eval_micro_batches) == (planned[True], planned[False]),
                f"ran {m.train_micro_batches} + {m.eval_micro_batches}, planned {planned}",
            )

    # once per call: one document per window from the second window on, written mid-call
    original = _copy(ds)

    def rewrite_memberships(p: retro.Progress) -> None:
        if p.done == 1:
            ds.documents[1:] = np.where(ds.documents[1:] == retro.datasets.PADDING, retro.datasets.PADDING, 0)

    rewritten_mid_call, _ = _train(backend, model_path, shape, ds, n_ubatch=n_ubatch, progress=rewrite_memberships)
    as_planned, _ = _train(backend, model_path, shape, original, n_ubatch=n_ubatch)
    with bound("HOST-03"):
        support.assert_params_equal(
            rewritten_mid_call, as_planned, backend, "memberships rewritten mid-call vs the call's own plan"
        )
    on_path(f"micro_batch={micro_batch}")


@pytest.mark.clause("HOST-04")
def test_physical_tokens_are_what_llama_cpp_computed(backend, model_path, shape, seed):
    """After every micro-batch, the tokens llama.cpp's graph computed (read from the fork's step,
    padding included) are summed: the epoch's physical token count equals that sum, and its logical
    count the tokens with a weighted target of their own document, counted here from the arrays;
    the row plan asked before the call (Trainer.plan) forecasts the same physical count. The data
    holds padding, so that the two differ."""
    n_vocab = _n_vocab(backend, model_path)
    ds = _packed(n_vocab, seed + 73, shape, windows=3, weighted=True)
    computed: list[int] = []
    with (
        support.load(backend, model_path) as model,
        support.context(model, shape, n_ubatch=shape.micro_batch, sequences=SEQUENCES) as ctx,
    ):
        with retro.Trainer(ctx, optimizer=retro.SGD(lr=0.25)) as tr:
            planned = tr.plan(ds, val_fraction=0.34).physical_tokens
            m = tr.epoch(ds, val_fraction=0.34, progress=lambda p: computed.append(last_step_tokens(ctx)))
    expect("HOST-04", len(computed) == m.micro_batches, f"{len(computed)} steps seen, {m.micro_batches} reported")
    expect("HOST-04", planned == sum(computed), f"the row plan says {planned} physical tokens, {sum(computed)} ran")
    expect(
        "HOST-04",
        m.physical_tokens == sum(computed),
        f"physical tokens {m.physical_tokens}, llama.cpp computed {sum(computed)} in {len(computed)} micro-batches",
    )
    expect(
        "HOST-04",
        m.logical_tokens == ds.logical_tokens < m.physical_tokens,
        f"logical tokens {m.logical_tokens}, weighted targets in the arrays {ds.logical_tokens}, physical {m.physical_tokens}",
    )


def _numpy_loss(backend, model_path, shape: Shape, ds: retro.PackedDataset, window: int) -> float:
    """Sum over the window's documents, each decoded alone from position 0, of weight x -log p(next
    token of the same document): what the packed window's loss is a mean of."""
    total = 0.0
    with support.load(backend, model_path, trainable=False) as model, support.context(model, shape) as ctx:
        docs, tokens = ds.documents[window], ds.tokens[window]
        weights = np.ones(ds.width, np.float32) if ds.weights is None else ds.weights[window]
        for d in np.unique(docs[docs != retro.datasets.PADDING]):
            at = np.flatnonzero(docs == d)
            if at.size < 2:
                continue
            ctx.reset()
            logits = ctx.decode(tokens[at]).astype(np.float64)[:-1]
            shifted = logits - logits.max(axis=1, keepdims=True)
            log_p = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
            picked = log_p[np.arange(at.size - 1), tokens[at[1:]]]
            total += float(-(weights[at[:-1]].astype(np.float64) * picked).sum())
    return total


@pytest.mark.clause("HOST-06")
def test_the_packed_batch_keeps_one_geometry_and_is_replaced_when_it_changes(backend, model_path, shape, seed):
    """After every step the batch llama.cpp computed (its positions and sequence ids, read back
    from the fork) holds that step's geometry from the row plan: replaced when the membership
    changes at the same token count, and when the token count changes (a shorter step), and whole
    as built (llama.cpp logs no warning of having to complete one); steps of
    one geometry (windows of one micro-batch with the same document boundaries) reuse the same
    batch, at the same address. And the geometry is the one attention runs on: the loss of an
    evaluated window, computed after a window of other boundaries, equals numpy's over each of its
    documents decoded alone."""
    n_vocab = _n_vocab(backend, model_path)
    ubatch, half = shape.micro_batch, shape.micro_batch // 2
    # windows of one micro-batch each, the last document of each filling it
    lengths = [[20, 30, ubatch - 50], [20, 30, ubatch - 50], [5, 50, ubatch - 55], [ubatch]]
    windows = [
        retro.PackedDataset.pack(_documents(n_vocab, seed + 74 + i, ls), width=ubatch) for i, ls in enumerate(lengths)
    ]
    ds = retro.PackedDataset(
        np.ascontiguousarray(np.concatenate([w.tokens for w in windows])),
        np.ascontiguousarray(np.concatenate([w.documents + 10 * i for i, w in enumerate(windows)])),
    )
    seen = []
    with (
        support.load(backend, model_path) as model,
        support.context(model, shape, n_ubatch=ubatch, sequences=SEQUENCES) as ctx,
    ):
        with retro.Trainer(ctx, optimizer=retro.SGD(lr=0.25)) as tr, support.native_warnings() as warned:
            plan = tr.plan(ds)
            # a batch llama.cpp refuses to build is a geometry not kept: the clause's failure
            succeeds(
                "HOST-06", "the packed epoch", lambda: tr.epoch(ds, progress=lambda p: seen.append(packed_batch(ctx)))
            )
            short = support.windows(1, half, n_vocab, seed + 78)
            micro_batch(tr, short.tokens[0], short.labels[0])  # a step of another token count
            seen.append(packed_batch(ctx))
    # each batch is whole as built: llama.cpp's batch allocator warns when it must complete one
    # (an output flag left unset on a token the loss reads, say)
    expect("HOST-06", not warned, f"llama.cpp corrected the batches it was given: {warned[:3]}")
    expected = [(plan.pos[o : o + n], plan.seq[o : o + n]) for _, o, n, _, _ in plan.steps.tolist()]
    expected.append((np.arange(half, dtype=np.int32), np.zeros(half, np.int32)))
    for i, (batch, (pos, seq)) in enumerate(zip(seen, expected)):
        expect(
            "HOST-06",
            np.array_equal(batch.positions, pos) and np.array_equal(batch.sequences, seq),
            f"step {i}: the batch llama.cpp computed holds positions {batch.positions[:12].tolist()} and sequences "
            f"{batch.sequences[:12].tolist()}, the step's membership gives {pos[:12].tolist()} and {seq[:12].tolist()}",
        )
    expect("HOST-06", len(seen) == len(expected), f"{len(seen)} steps seen, {len(expected)} planned")
    # windows 0 and 1 have one geometry: the second step reuses the first one's batch
    expect(
        "HOST-06",
        seen[0].address != 0 and seen[1].address == seen[0].address,
        f"a step of the same geometry got another batch: positions at {seen[0].address:#x}, then {seen[1].address:#x}",
    )

    # a membership change that keeps every position: a window of two documents of half a
    # micro-batch, in micro-batches of half, gives two steps of one token count and the same
    # positions, the second in another sequence; the second step's batch must hold it
    halves = retro.PackedDataset.pack(_documents(n_vocab, seed + 79, [half, half]), width=ubatch)
    stepped = []
    with (
        support.load(backend, model_path) as model,
        support.context(model, shape, n_ubatch=half, sequences=SEQUENCES) as ctx,
    ):
        with retro.Trainer(ctx, optimizer=retro.SGD(lr=0.25)) as tr:
            succeeds(
                "HOST-06",
                "two documents' epoch",
                lambda: tr.epoch(halves, progress=lambda p: stepped.append(packed_batch(ctx))),
            )
    got = [(b.positions.tolist(), b.sequences.tolist()) for b in stepped]
    want = [(list(range(half)), [0] * half), (list(range(half)), [1] * half)]
    expect("HOST-06", got == want, f"two steps of the same positions, the second in sequence 1: {got}")

    # window 2 evaluated right after window 1 trained (same token count, other boundaries)
    two = retro.PackedDataset(np.ascontiguousarray(ds.tokens[1:3]), np.ascontiguousarray(ds.documents[1:3]))
    with (
        support.load(backend, model_path) as model,
        support.context(model, shape, n_ubatch=ubatch, sequences=SEQUENCES) as ctx,
    ):
        with retro.Trainer(ctx, optimizer=retro.SGD(lr=0.25)) as tr:
            m = succeeds("HOST-06", "the evaluated epoch", lambda: tr.epoch(two, val_fraction=0.5))
        path = support.saved(model, model_path.parent / f"host06-{backend.name}-{seed}.gguf")
    expected_loss = _numpy_loss(backend, path, shape, two, 1) / ubatch  # a mean over the window's tokens
    eval_loss = m.eval_loss if m is not None else None
    expect("HOST-06", eval_loss is not None, "a packed window evaluated without an eval loss")
    off = abs((eval_loss or 0.0) - expected_loss) / abs(expected_loss)
    within("HOST-06", PACKED_LOSS, "eval loss of a packed window vs numpy over its documents decoded alone", off)
