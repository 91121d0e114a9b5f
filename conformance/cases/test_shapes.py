"""Shapes and counters (seed 000): bad inputs are rejected with a typed error before any native
state changes, and values crossing signed native counters never wrap."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import retro
import retro.fault_injection as fi
from retro.conformance import support
from retro.conformance.evidence import expect

INT32_MAX, INT64_MAX = 2**31 - 1, 2**63 - 1
TYPED = (ValueError, TypeError, OverflowError)


def raised(fn: Callable[[], object]) -> BaseException | None:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the check judges what was raised
        return err
    return None


def _state(model: retro.Model, tr: retro.Trainer) -> tuple:
    params = model.parameters()
    moments = tr.moments("output.weight")
    return (
        {n: a.tobytes() for n, a in params.items()},
        None if moments is None else (moments[0].tobytes(), moments[1].tobytes()),
        tr.iteration,
        tr.period_position,
    )


@st.composite
def bad_epochs(draw: st.DrawFn, n_vocab: int) -> dict:
    """An epoch call one detail of which is wrong; the rest is a valid 3-window dataset."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    tokens = rng.integers(0, n_vocab, size=(3, 256)).astype(np.int32)
    labels = rng.integers(0, n_vocab, size=(3, 256)).astype(np.int32)
    kind = draw(st.sampled_from(["token id", "label id", "width", "val_fraction", "dtype"]))
    kwargs: dict = {}
    if kind in ("token id", "label id"):
        target = tokens if kind == "token id" else labels
        w, i = draw(st.integers(0, 2)), draw(st.integers(0, 255))  # any window: a late one too
        target[w, i] = draw(st.sampled_from([n_vocab, n_vocab + 7, -1, INT32_MAX]))
    elif kind == "width":
        width = draw(st.sampled_from([100, 257, 320, 512]))
        tokens, labels = np.zeros((1, width), np.int32), np.zeros((1, width), np.int32)
    elif kind == "val_fraction":
        kwargs["val_fraction"] = draw(st.sampled_from([1.0, -0.25, float("nan"), float("inf"), 2]))
    else:
        tokens = tokens.astype(np.float32)
    return {"dataset": retro.TokenDataset(tokens, labels), **kwargs}


@pytest.mark.clause("SHAPE-01")
def test_bad_inputs_are_rejected_before_any_state_changes(backend, model_path, seed):
    """Property: for any epoch call with one bad detail (an id out of range in any window, a
    width that does not divide into micro-batches, a bad split, a wrong dtype), a typed error is
    raised and the parameters, AdamW moments, cursor and accumulation position are unchanged."""
    with (
        support.load(backend, model_path) as model,
        support.context(model, n_ubatch=64) as ctx,
        retro.Trainer(ctx, optimizer=retro.AdamW(lr=1e-3), accumulation=2) as tr,
    ):
        tr.epoch(support.windows(1, 256, model.n_vocab, seed + 30))
        before = _state(model, tr)

        @settings(
            max_examples=40, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
        )
        @given(call=bad_epochs(model.n_vocab))
        def check(call: dict) -> None:
            fi.reset()
            err = raised(lambda: tr.epoch(**call))
            expect(
                "SHAPE-01", isinstance(err, TYPED), f"raised {err!r}, expected a ValueError, TypeError or OverflowError"
            )
            expect("SHAPE-01", fi.hits("compute") == 0, "a bad call reached the backend")
            expect("SHAPE-01", _state(model, tr) == before, "a rejected call changed the trainer's state")

        check()


@pytest.mark.clause("SHAPE-02")
def test_values_past_native_counters_raise_overflow_and_never_wrap(backend, model_path, seed, monkeypatch):
    with support.load(backend, model_path) as model:
        # the CPU thread count's bound (512), named or from RETRO_THREADS: legal at it, refused past it
        monkeypatch.setenv("RETRO_THREADS", "512")
        with retro.Context(model, n_ctx=256) as at_limit:
            expect("SHAPE-02", at_limit.n_threads == 512, f"RETRO_THREADS=512 gave {at_limit.n_threads} threads")
        monkeypatch.setenv("RETRO_THREADS", "513")
        err = raised(lambda: retro.Context(model, n_ctx=256))
        expect("SHAPE-02", type(err) is OverflowError, f"RETRO_THREADS=513: raised {err!r}, expected OverflowError")
        monkeypatch.undo()
        past = [
            ("n_ctx", lambda: retro.Context(model, n_ctx=2**31 + 256)),
            ("n_batch", lambda: retro.Context(model, n_ctx=256, n_batch=2**32 + 256)),
            ("n_ubatch", lambda: retro.Context(model, n_ctx=256, n_batch=256, n_ubatch=2**32 + 64)),
            ("n_threads", lambda: retro.Context(model, n_threads=2**32 + 1)),
            ("n_threads = 513", lambda: retro.Context(model, n_ctx=256, n_threads=513)),
            ("gpu_layers", lambda: retro.Model.load(model_path, devices=[], gpu_layers=INT64_MAX)),
            ("window width", lambda: retro.TokenDataset.from_tokens(np.arange(10), width=2**32 + 4)),
            ("token id", lambda: retro.TokenDataset.from_tokens(np.full(10, 2**32 + 5, np.int64), width=4)),
            # exactly one past the limits
            ("n_ctx = INT32_MAX + 1", lambda: retro.Context(model, n_ctx=INT32_MAX + 1)),
            ("n_ubatch = INT32_MAX + 1", lambda: retro.Context(model, n_ctx=256, n_batch=256, n_ubatch=INT32_MAX + 1)),
            (
                "token id = INT32_MAX + 1",
                lambda: retro.TokenDataset.from_tokens(np.full(10, INT32_MAX + 1, np.int64), width=4),
            ),
            ("gpu_layers = INT32_MAX + 1", lambda: retro.Model.load(model_path, devices=[], gpu_layers=INT32_MAX + 1)),
        ]
        with support.context(model, n_ubatch=64) as ctx:
            past += [
                ("decode token id", lambda: ctx.decode(np.array([2**32 + 5], dtype=np.int64))),
                ("schedule horizon", lambda: retro.Trainer(ctx, schedule=lambda s, h: 1e-3, horizon=INT64_MAX + 1)),
                ("accumulation", lambda: retro.Trainer(ctx, accumulation=2**32 + 1)),
            ]
            for what, call in past:
                err = raised(call)
                expect("SHAPE-02", type(err) is OverflowError, f"{what}: raised {err!r}, expected OverflowError")
            expect("SHAPE-02", ctx.n_past == 0, "a rejected decode reached the context")
            # at the limit the bound holds without wrapping: INT32_MAX micro-batches per step is legal
            with retro.Trainer(ctx, optimizer=retro.SGD(lr=0.01), accumulation=INT32_MAX) as tr:
                m = tr.epoch(support.windows(1, 256, model.n_vocab, seed + 31))
                expect("SHAPE-02", (m.optimizer_steps, tr.period_position) == (0, 4), f"at INT32_MAX: {m}")
