"""Shapes and counters (seed 000): bad inputs are rejected with a typed error before any native
state changes, and values crossing signed native counters never wrap."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import retro
import retro.fault_injection as fi
from retro.conformance import support
from retro.conformance.evidence import expect, on_path
from retro.conformance.shapes import Shape

INT32_MAX, INT64_MAX = 2**31 - 1, 2**63 - 1
TYPED = (ValueError, TypeError, OverflowError)


raised = support.raised


def _state(model: retro.Model, tr: retro.Trainer) -> tuple:
    params = model.parameters()
    moments = tr.moments("output.weight")
    return (
        {n: a.tobytes() for n, a in params.items()},
        None if moments is None else (moments[0].tobytes(), moments[1].tobytes()),
        tr.iteration,
        tr.period_position,
    )


def _odd_width(shape: Shape) -> int:
    """A width below a window that its micro-batch does not divide."""
    return shape.micro_batch + 36


@st.composite
def bad_epochs(draw: st.DrawFn, n_vocab: int, shape: Shape) -> dict:
    """An epoch call one detail of which is wrong; the rest is a valid 3-window dataset."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    tokens = rng.integers(0, n_vocab, size=(3, shape.window)).astype(np.int32)
    labels = rng.integers(0, n_vocab, size=(3, shape.window)).astype(np.int32)
    kind = draw(st.sampled_from(["token id", "label id", "width", "val_fraction", "dtype"]))
    kwargs: dict = {}
    if kind in ("token id", "label id"):
        target = tokens if kind == "token id" else labels
        w, i = draw(st.integers(0, 2)), draw(st.integers(0, shape.window - 1))  # any window: a late one too
        target[w, i] = draw(st.sampled_from([n_vocab, n_vocab + 7, -1, INT32_MAX]))
    elif kind == "width":
        # no whole micro-batches; one past n_ctx; whole micro-batches past n_ctx; two windows
        window = shape.window
        width = draw(st.sampled_from([_odd_width(shape), window + 1, window + shape.micro_batch, 2 * window]))
        tokens, labels = np.zeros((1, width), np.int32), np.zeros((1, width), np.int32)
    elif kind == "val_fraction":
        kwargs["val_fraction"] = draw(st.sampled_from([1.0, -0.25, float("nan"), float("inf"), 2]))
    else:
        tokens = tokens.astype(np.float32)
    # the dataset is made inside the call under test: a wrong dtype is refused when it is made
    return {"dataset": lambda: retro.TokenDataset(tokens, labels), **kwargs}


def _bad_details(
    n_vocab: int, tr: retro.Trainer, shape: Shape
) -> list[tuple[str, str, Callable[[], object], type, str]]:
    """Every check a dataset, a packing, a trainer's schedule or an epoch call makes of its
    input, each met alone: (the input, as SHAPE-01's paths name it; what; the call; the typed
    error; what its message names)."""
    ctx = tr.context
    window, half, odd = shape.window, shape.window // 2, _odd_width(shape)
    t = np.zeros((1, window), np.int32)
    w = np.ones((1, window), np.float32)
    t2, w2 = np.zeros((2, window), np.int32), np.ones((2, window), np.float32)
    ids, kw = np.zeros((1, window, 2), np.int32), np.ones((1, window, 2), np.float32)
    docs = np.repeat(np.arange(shape.parts, dtype=np.int32), shape.micro_batch)[None]  # one per micro-batch
    stream = np.zeros(window + 44, np.int64)  # a window and its labels, and some to spare: an even count
    Token, Weighted, TopK, Packed = retro.TokenDataset, retro.WeightedDataset, retro.TopKDataset, retro.PackedDataset

    def with_one(arr: np.ndarray, value: float) -> np.ndarray:
        out = arr.copy()
        out.flat[out.size // 2] = value  # mid-window: not only the first element is read
        return out

    by_input: dict[str, list[tuple[str, Callable[[], object], type, str]]] = {
        # token windows, cut from a stream or given
        "token": [
            (
                "a stream of floats",
                lambda: Token.from_tokens(stream.astype(np.float32), width=window),
                TypeError,
                "integers",
            ),
            (
                "a 2-D stream",
                lambda: Token.from_tokens(stream.reshape(2, -1), width=shape.micro_batch),
                ValueError,
                "1-D",
            ),
            (
                "a negative id in a stream",
                lambda: Token.from_tokens(with_one(stream, -1), width=window),
                ValueError,
                ">= 0",
            ),
            ("a window width of 0", lambda: Token.from_tokens(stream, width=0), ValueError, "width"),
            ("a stride of 0", lambda: Token.from_tokens(stream, width=window, stride=0), ValueError, "stride"),
            (
                "a stream without a last label",
                lambda: Token.from_tokens(stream[:window], width=window),
                ValueError,
                "cannot fill",
            ),
            ("tokens as a list", lambda: Token(support.hostile(t.tolist()), t), TypeError, "numpy array"),
            ("labels of another shape", lambda: Token(t, t[:, :half].copy()), ValueError, "one shape"),
            ("int64 tokens", lambda: Token(t.astype(np.int64), t), TypeError, "tokens must be int32"),
            ("int64 labels", lambda: Token(t, t.astype(np.int64)), TypeError, "labels must be int32"),
            (
                "strided labels",
                lambda: Token(t, np.zeros((1, 2 * window), np.int32)[:, ::2]),
                ValueError,
                "C-contiguous",
            ),
            # Fortran order: contiguous, yet the binding would read a converted copy (two rows: a single
            # row is C- and Fortran-contiguous at once)
            ("Fortran-ordered labels", lambda: Token(t2, np.asfortranarray(t2)), ValueError, "C-contiguous"),
        ],
        # weighted windows: the caller's arrays, borrowed as they are
        "weighted": [
            ("Fortran-ordered weights", lambda: Weighted(t2, t2, np.asfortranarray(w2)), ValueError, "C-contiguous"),
            ("float64 weights", lambda: Weighted(t, t, w.astype(np.float64)), TypeError, "float32"),
            ("3-D labels", lambda: Weighted(t, t[..., None], w), ValueError, "labels must be 2-D"),
            (
                "strided tokens",
                lambda: Weighted(np.zeros((1, 2 * window), np.int32)[:, ::2], t, w),
                ValueError,
                "C-contiguous",
            ),
            ("weights of another shape", lambda: Weighted(t, t, w[:, :half].copy()), ValueError, "one shape"),
            ("a negative weight", lambda: tr.epoch(Weighted(t, t, with_one(w, -0.5))), ValueError, "dataset.weights"),
            ("a NaN weight", lambda: tr.epoch(Weighted(t, t, with_one(w, np.nan))), ValueError, "dataset.weights"),
            (
                "a label id past the vocabulary",
                lambda: tr.epoch(Weighted(t, with_one(t, n_vocab), w)),
                ValueError,
                "labels",
            ),
        ],
        "top-k": [
            ("2-D ids", lambda: TopK(t, t, w), ValueError, "ids must be 3-D"),
            ("ids and weights of other k", lambda: TopK(t, ids, kw[..., :1].copy()), ValueError, "shape x k"),
            ("k past the native limit", lambda: TopK(t, *_k_wide(shape, TopK.MAX_K + 1)), ValueError, "k must be in"),
            (
                "a target id past the vocabulary",
                lambda: tr.epoch(TopK(t, with_one(ids, n_vocab), kw)),
                ValueError,
                "ids",
            ),
            ("an infinite target weight", lambda: tr.epoch(TopK(t, ids, with_one(kw, np.inf))), ValueError, "weights"),
        ],
        "packed": [
            ("documents that decrease", lambda: Packed(t, docs[:, ::-1].copy()), ValueError, "decrease"),
            (
                "a document after padding",
                # padding from inside the second document to its end, the third after it
                lambda: Packed(t, _with_padding(docs, odd, 2 * shape.micro_batch - odd)),
                ValueError,
                "follows padding",
            ),
            ("a document index below padding", lambda: Packed(t, with_one(docs, -2)), ValueError, ">= 0"),
            ("no tokens at all", lambda: Packed(t[:, :0].copy(), docs[:, :0].copy()), ValueError, "empty"),
            ("documents of another shape", lambda: Packed(t, docs[:, :half].copy()), ValueError, "one shape"),
            ("nothing to pack", lambda: Packed.pack([], width=window), ValueError, "no documents"),
            (
                "a document past the window",
                lambda: Packed.pack([np.zeros(window + 1, int)], width=window),
                ValueError,
                "more than",
            ),
            (
                "weights for fewer documents",
                lambda: Packed.pack([[1, 2]] * 2, width=8, weights=[[1, 1]]),
                ValueError,
                "for 2",
            ),
            (
                "a document's weights of another length",
                lambda: _pack_weighted([1.0]),
                ValueError,
                "weights of document 0",
            ),
            ("a document of floats", lambda: Packed.pack([np.zeros(4)], width=8), ValueError, "integer sequence"),
            ("a negative id in a document", lambda: Packed.pack([[1, -2]], width=8), ValueError, "token ids"),
            (
                "more documents per micro-batch than sequences",
                lambda: tr.epoch(Packed(t, _four_per_micro_batch(shape))),
                ValueError,
                "sequences=",
            ),
            (
                "a micro-batch that does not divide the window",
                lambda: Packed(t, docs).sequences_needed(odd),
                ValueError,
                "n_ubatch",
            ),
        ],
        # the epoch call and the trainer's schedule
        "schedule": [
            ("not a dataset", lambda: tr.epoch(support.hostile(t)), TypeError, "dataset must be"),
            (
                "a window wider than the context",
                lambda: tr.epoch(Token(np.zeros((1, 2 * window), np.int32), np.zeros((1, 2 * window), np.int32))),
                ValueError,
                "n_ctx",
            ),
            (
                "a progress callback that is not callable",
                lambda: tr.epoch(Token(t, t), progress=support.hostile(1)),
                TypeError,
                "progress",
            ),
            (
                "an epoch callback not of ctypes",
                lambda: tr.epoch(Token(t, t), epoch_callback=support.hostile(print)),
                TypeError,
                "epoch_callback",
            ),
            (
                "a schedule without its horizon",
                lambda: retro.Trainer(ctx, schedule=lambda s, h: 1e-3),
                ValueError,
                "horizon",
            ),
            (
                "a horizon of 0 steps",
                lambda: retro.Trainer(ctx, schedule=lambda s, h: 1e-3, horizon=0),
                ValueError,
                "horizon",
            ),
            (
                "a schedule that is not callable",
                lambda: retro.Trainer(ctx, schedule=support.hostile(1e-3), horizon=4),
                TypeError,
                "callable",
            ),
            ("an unknown loss head", lambda: retro.Trainer(ctx, head="sparse"), ValueError, "head"),
            ("a trainer of no context", lambda: retro.Trainer(support.hostile("context")), TypeError, "context"),
            (
                "an optimizer named, not made",
                lambda: retro.Trainer(ctx, optimizer=support.hostile("adamw")),
                TypeError,
                "optimizer",
            ),
            ("a trainer on a closed context", lambda: retro.Trainer(_closed(ctx.model, shape)), ValueError, "closed"),
        ],
    }
    return [(source, *detail) for source, details in by_input.items() for detail in details]


def _closed(model: retro.Model, shape: Shape) -> retro.Context:
    with support.context(model, shape) as ctx:
        return ctx


def _k_wide(shape: Shape, k: int) -> tuple[np.ndarray, np.ndarray]:
    return np.zeros((1, shape.window, k), np.int32), np.ones((1, shape.window, k), np.float32)


def _with_padding(docs: np.ndarray, at: int, n: int) -> np.ndarray:
    """Padding in the middle of a window, documents after it."""
    out = docs.copy()
    out[:, at : at + n] = retro.datasets.PADDING
    return out


def _four_per_micro_batch(shape: Shape) -> np.ndarray:
    """Four documents in every micro-batch of a window, which a context of one sequence cannot train."""
    return np.repeat(np.arange(4 * shape.parts, dtype=np.int32), shape.micro_batch // 4)[None]


def _pack_weighted(weights: list[float]):
    return retro.PackedDataset.pack([[1, 2]], width=8, weights=[weights])


@pytest.mark.clause("SHAPE-01")
@pytest.mark.drives("input=token", "input=weighted", "input=top-k", "input=packed", "input=schedule")
def test_bad_inputs_are_rejected_before_any_state_changes(backend, model_path, seed, shape: Shape):
    """Property: for any epoch call with one bad detail (an id out of range in any window, a
    width that does not divide into micro-batches, a bad split, a wrong dtype), a typed error is
    raised and the parameters, AdamW moments, cursor and accumulation position are unchanged.
    Then every check of every dataset kind, of packing and of the trainer's schedule, each met
    alone (_bad_details): its own typed error, whose message names what is wrong, and nothing
    computed or changed."""
    with (
        support.load(backend, model_path) as model,
        support.context(model, shape, n_ubatch=shape.micro_batch) as ctx,
        retro.Trainer(ctx, optimizer=retro.AdamW(lr=1e-3), accumulation=2) as tr,
    ):
        tr.epoch(support.windows(1, shape.window, model.n_vocab, seed + 30))
        before = _state(model, tr)

        @settings(
            max_examples=40, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
        )
        @given(call=bad_epochs(model.n_vocab, shape))
        def check(call: dict) -> None:
            fi.reset()
            err = raised(lambda: tr.epoch(call["dataset"](), **{k: v for k, v in call.items() if k != "dataset"}))
            expect(
                "SHAPE-01", isinstance(err, TYPED), f"raised {err!r}, expected a ValueError, TypeError or OverflowError"
            )
            expect("SHAPE-01", fi.hits("compute") == 0, "a bad call reached the backend")
            expect("SHAPE-01", _state(model, tr) == before, "a rejected call changed the trainer's state")

        check()
        for source, what, call, kind, names in _bad_details(model.n_vocab, tr, shape):
            fi.reset()
            err = raised(call)
            expect(
                "SHAPE-01",
                type(err) is kind and names in str(err),
                f"{what}: raised {err!r}, expected a {kind.__name__} naming {names!r}",
            )
            expect("SHAPE-01", fi.hits("compute") == 0, f"{what}: a bad call reached the backend")
            expect("SHAPE-01", _state(model, tr) == before, f"{what}: a rejected call changed the trainer's state")
            on_path(f"input={source}")


@pytest.mark.clause("SHAPE-02")
def test_values_past_native_counters_raise_overflow_and_never_wrap(
    backend, model_path, seed, monkeypatch, shape: Shape
):
    window = shape.window
    with support.load(backend, model_path) as model:
        # the CPU thread count's bound (512), named or from RETRO_THREADS: legal at it, refused past it
        monkeypatch.setenv("RETRO_THREADS", "512")
        with retro.Context(model, n_ctx=window) as at_limit:
            expect("SHAPE-02", at_limit.n_threads == 512, f"RETRO_THREADS=512 gave {at_limit.n_threads} threads")
        monkeypatch.setenv("RETRO_THREADS", "513")
        err = raised(lambda: retro.Context(model, n_ctx=window))
        expect("SHAPE-02", type(err) is OverflowError, f"RETRO_THREADS=513: raised {err!r}, expected OverflowError")
        monkeypatch.undo()
        past = [
            ("n_ctx", lambda: retro.Context(model, n_ctx=2**31 + 256)),
            ("n_batch", lambda: retro.Context(model, n_ctx=window, n_batch=2**32 + 256)),
            ("n_ubatch", lambda: retro.Context(model, n_ctx=window, n_batch=window, n_ubatch=2**32 + 64)),
            ("n_threads", lambda: retro.Context(model, n_threads=2**32 + 1)),
            ("n_threads = 513", lambda: retro.Context(model, n_ctx=window, n_threads=513)),
            ("gpu_layers", lambda: retro.Model.load(model_path, devices=[], gpu_layers=INT64_MAX)),
            ("window width", lambda: retro.TokenDataset.from_tokens(np.arange(10), width=2**32 + 4)),
            ("token id", lambda: retro.TokenDataset.from_tokens(np.full(10, 2**32 + 5, np.int64), width=4)),
            # exactly one past the limits
            ("n_ctx = INT32_MAX + 1", lambda: retro.Context(model, n_ctx=INT32_MAX + 1)),
            (
                "n_ubatch = INT32_MAX + 1",
                lambda: retro.Context(model, n_ctx=window, n_batch=window, n_ubatch=INT32_MAX + 1),
            ),
            (
                "token id = INT32_MAX + 1",
                lambda: retro.TokenDataset.from_tokens(np.full(10, INT32_MAX + 1, np.int64), width=4),
            ),
            ("gpu_layers = INT32_MAX + 1", lambda: retro.Model.load(model_path, devices=[], gpu_layers=INT32_MAX + 1)),
        ]
        with support.context(model, shape, n_ubatch=shape.micro_batch) as ctx:
            past += [
                ("decode token id", lambda: ctx.decode(np.array([2**32 + 5], dtype=np.int64))),
                ("schedule horizon", lambda: retro.Trainer(ctx, schedule=lambda s, h: 1e-3, horizon=INT64_MAX + 1)),
                ("accumulation", lambda: retro.Trainer(ctx, accumulation=2**32 + 1)),
            ]
            for what, call in past:
                err = raised(call)
                expect("SHAPE-02", type(err) is OverflowError, f"{what}: raised {err!r}, expected OverflowError")
            expect("SHAPE-02", ctx.n_past == 0, "a rejected decode reached the context")
            # an optimizer iteration past INT64_MAX in a checkpoint is refused before anything of
            # it is written: the trainer's parameters stay as they were
            with retro.Trainer(ctx, optimizer=retro.AdamW(lr=1e-3)) as tr:
                start = tr.checkpoint()
                moved = {n: a + 1 for n, a in start.parameters.items()}
                for iteration in (INT64_MAX + 1, 2**64 + 1):
                    forged = dataclasses.replace(start, parameters=moved, iteration=iteration)
                    err = raised(lambda forged=forged: tr.restore(forged))
                    expect(
                        "SHAPE-02",
                        type(err) is OverflowError,
                        f"a checkpoint at iteration {iteration}: raised {err!r}, expected OverflowError",
                    )
                    written = [n for n, a in model.parameters().items() if not np.array_equal(a, start.parameters[n])]
                    expect("SHAPE-02", not written, f"iteration {iteration}: refused after writing {written[:3]}")
            # at the limit the bound holds without wrapping: INT32_MAX micro-batches per step is legal
            with retro.Trainer(ctx, optimizer=retro.SGD(lr=0.01), accumulation=INT32_MAX) as tr:
                m = tr.epoch(support.windows(1, window, model.n_vocab, seed + 31))
                expect("SHAPE-02", (m.optimizer_steps, tr.period_position) == (0, shape.parts), f"at INT32_MAX: {m}")
        _check_token_counts(model, shape)


def _check_token_counts(model: retro.Model, shape: Shape) -> None:
    """The token counts a decode or a generation hands to llama.cpp (its batch, the positions it
    fills, the tokens it may generate and draft) are bounded by the context before anything
    native: each bound met alone is a typed error naming it, and the sequences are left as they
    were. At the bound itself the call runs: a decode, and a generation after a decode, each
    filling the context exactly."""
    window = shape.window  # each context's n_ctx and n_batch
    with support.context(model, shape) as ctx, support.context(model, shape) as other:
        ctx.decode(np.arange(8, dtype=np.int32))
        tokens = np.arange(4, dtype=np.int32)
        room = window - 8  # the positions left after the 8 decoded
        bounded = [
            ("a decode of no tokens", lambda: ctx.decode(tokens[:0]), ValueError, "empty"),
            ("a decode past n_batch", lambda: ctx.decode(np.zeros(window + 1, np.int32)), ValueError, "n_batch"),
            ("a decode past n_ctx", lambda: ctx.decode(np.zeros(room + 1, np.int32)), ValueError, "n_ctx"),
            ("a prompt of no tokens", lambda: ctx.generate(tokens[:0], 4), ValueError, "empty"),
            ("no token to generate", lambda: ctx.generate(tokens, 0), ValueError, "max_new"),
            ("more tokens to generate than n_ctx", lambda: ctx.generate(tokens, window + 1), OverflowError, "max_new"),
            ("a generation past n_ctx", lambda: ctx.generate(tokens, room - tokens.size + 1), ValueError, "n_ctx"),
            ("no token to draft", lambda: other.generate(tokens, 4, draft=ctx, n_draft=0), ValueError, "n_draft"),
            (
                "more drafted tokens than 64",
                lambda: other.generate(tokens, 4, draft=ctx, n_draft=65),
                OverflowError,
                "n_draft",
            ),
            ("a draft that is the target", lambda: other.generate(tokens, 4, draft=other), TypeError, "draft"),
            ("a draft on a used sequence", lambda: other.generate(tokens, 4, draft=ctx), ValueError, "empty sequences"),
            # a count is an int: never a float or a bool taken for one, nor a cast of text
            ("tokens of two dimensions", lambda: ctx.decode(np.zeros((2, 2), np.int32)), ValueError, "1-D"),
            (
                "n_ubatch past n_batch",
                lambda: retro.Context(model, n_batch=window // 2, n_ubatch=window),
                ValueError,
                "n_ubatch",
            ),
            # each count of a context alone, named in its error
            ("n_ctx of 0", lambda: retro.Context(model, n_ctx=0), ValueError, "n_ctx"),
            ("n_batch of 0", lambda: retro.Context(model, n_batch=0), ValueError, "n_batch"),
            ("n_batch past INT32", lambda: retro.Context(model, n_batch=INT32_MAX + 1), OverflowError, "n_batch"),
            ("n_ubatch of 0", lambda: retro.Context(model, n_ubatch=0), ValueError, "n_ubatch"),
            ("no sequence", lambda: retro.Context(model, sequences=0), ValueError, "sequences"),
            ("n_threads of 0", lambda: retro.Context(model, n_threads=0), ValueError, "n_threads"),
            (
                "n_ctx as a float",
                lambda: retro.Context(model, n_ctx=support.hostile(float(window))),
                TypeError,
                "n_ctx",
            ),
            ("n_ctx as a bool", lambda: retro.Context(model, n_ctx=True), TypeError, "n_ctx"),
            (
                "a duty cycle as text",
                lambda: retro.Trainer(ctx, duty_cycle=support.hostile("1")),
                TypeError,
                "duty_cycle",
            ),
        ]
        for what, call, kind, names in bounded:
            held = (ctx.n_past, ctx.sequence_length, other.n_past, other.sequence_length)
            err = raised(call)
            expect(
                "SHAPE-02",
                type(err) is kind and names in str(err),
                f"{what}: raised {err!r}, expected a {kind.__name__} naming {names!r}",
            )
            now = (ctx.n_past, ctx.sequence_length, other.n_past, other.sequence_length)
            expect("SHAPE-02", now == held, f"{what}: the sequences moved from {held} to {now}")
        ctx.reset()
        other.decode(tokens)
        err = raised(lambda: other.generate(tokens[:1], 4, draft=ctx))
        expect(
            "SHAPE-02",
            type(err) is ValueError and "empty sequences" in str(err),
            f"a speculative generation on a used target: raised {err!r}",
        )
        other.reset()
        # a prompt of 1, a draft of 4 and window - 4 new tokens: one position past n_ctx
        err = raised(lambda: other.generate(tokens[:1], window - 4, draft=ctx, n_draft=4))
        expect(
            "SHAPE-02",
            type(err) is ValueError and "fit both contexts" in str(err),
            f"a speculative generation past both contexts: raised {err!r}",
        )
        # each context's own bound: a draft smaller than its target, a target smaller than its
        # draft (llama.cpp pads n_ctx to 256: two windows against one); at the bound, the generation runs
        with support.context(model, shape, n_ctx=2 * window, n_ubatch=window) as large:
            for target, draft, which in ((large, other, "draft"), (other, large, "target")):
                err = raised(lambda: target.generate(tokens[:1], window - 4, draft=draft, n_draft=4))
                expect(
                    "SHAPE-02",
                    type(err) is ValueError and "fit both contexts" in str(err),
                    f"a speculative generation past its {which}'s n_ctx of {window}: raised {err!r}",
                )
                try:
                    made = len(
                        target.generate(tokens[:1], window - 5, draft=draft, n_draft=4, stop_at_eog=False).tokens
                    )
                except ValueError as refusal:
                    made, why = 0, f"was refused: {refusal}"
                else:
                    why = f"made {made} tokens"
                expect("SHAPE-02", made == window - 5, f"a speculative generation filling its {which}'s n_ctx {why}")
                target.reset()
                draft.reset()
        ctx.decode(np.arange(room, dtype=np.int32))
        ctx.decode(np.arange(8, dtype=np.int32))  # the context filled exactly
        expect("SHAPE-02", ctx.sequence_length == window, f"a decode to n_ctx left {ctx.sequence_length} positions")
        # 8 decoded, a prompt of 4 and the rest to generate: n_ctx positions, the context's own count
        ctx.reset()
        ctx.decode(np.arange(8, dtype=np.int32))
        try:
            made = len(ctx.generate(tokens, room - tokens.size, stop_at_eog=False).tokens)
        except ValueError as refusal:  # a refusal of a generation that fits is the violation
            made, why = 0, f"was refused: {refusal}"
        else:
            why = f"made {made} tokens"
        expect(
            "SHAPE-02",
            made == room - tokens.size,
            f"a generation to n_ctx (8 decoded, a prompt of 4, {room - tokens.size} new) {why}",
        )
