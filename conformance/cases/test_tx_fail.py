"""Tensor transactions (seed 004), TX-FAIL: failure containment: every handler exception becomes a
bounded, typed failure that sticks, and the graph runs on without the handler; and an exception at
every handler invocation (HARNESS-04). Each is observed from outside the binding: llama.cpp's own
record of the callback's user data and its destructor, the sequence state llama.cpp serializes, the
logits it returns, numpy references, and the handler's own log. Shared helpers: _transactions.py."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest

import retro
from retro.conformance import support
from retro.conformance.cases._transactions import (
    DRAFT_NOISE,
    RAISED,
    decode_tokens,
    foreign_profile,
    plain_context,
    plain_state,
    raise_at,
    tx_context,
)
from retro.conformance.evidence import bound, expect, on_path, raises_bound
from retro.conformance.shapes import Shape
from retro.testing import scheduler_data_phase_entries
from retro.transactions import Profile, TensorTransactions, Transaction


@pytest.mark.clause("TX-FAIL-01")
def test_every_exception_becomes_a_bounded_typed_failure(backend, loaded, shape: Shape):
    """Ordinary exceptions, KeyboardInterrupt, SystemExit, a BaseException subclass, one whose
    str() raises and one with a 1 MiB message: each is contained and reported by type, with its
    own text (str(), cut at the bound) for message and a traceback that names the handler; the
    interpreter goes on."""
    model, profile = loaded
    for type_name, make in RAISED:
        raised = make()

        def handler(t: Transaction, raised=raised) -> None:
            raise raised

        with tx_context(model, shape, profile, [profile.select("l_out-0")], handler) as ctx:
            with bound("TX-FAIL-01"), pytest.raises(retro.TensorCallbackError) as err:
                ctx.decode(decode_tokens(shape))
            f = err.value.failure
            expect("TX-FAIL-01", f.type == type_name, f"{type_name} reported as {f.type}")
            expect("TX-FAIL-01", len(f.message) <= 4200, f"{type_name}: a message of {len(f.message)} characters")
            expect("TX-FAIL-01", len(f.traceback) <= 4200, f"{type_name}: a traceback of {len(f.traceback)} characters")
            # the message is the exception's own text (its str(), as Python prints it), up to the bound
            try:
                own = str(raised)
            except Exception:  # noqa: BLE001 - Unprintable: any placeholder will do
                own = None
            expect(
                "TX-FAIL-01",
                own is None or (f.message == own if len(own) <= 4096 else f.message.startswith(own[:4096])),
                f"{type_name}: the message {f.message[:80]!r} is not the exception's text {(own or '')[:80]!r}",
            )
            expect("TX-FAIL-01", "handler" in f.traceback, f"{type_name}: the traceback lost the handler")


@pytest.mark.clause("TX-FAIL-02", "TX-FAIL-03", "TX-FAIL-05")
@pytest.mark.parametrize("failure", ["handler", "layout"])
def test_after_a_failure_the_graph_runs_to_the_end_without_the_handler(backend, loaded, failure, shape: Shape):
    """A failure in the first of 3 micro-batches, at the first of two selected nodes: the handler
    raises there, or the node's layout fails verification (a profile that records it as i32, as a
    stale one would) before the handler sees it. The handler is never called again, and the
    scheduler never again enters the data phase (its own count, patch 0054: every later ask
    answered false), yet every node of every micro-batch was computed (llama.cpp's sequence state
    equals an untouched decode's) and the tokens stay in the cache; and so do a failed
    generation's."""
    model, profile = loaded
    tokens = decode_tokens(shape)
    untouched = plain_state(model, shape, tokens)
    last = f"l_out-{shape.spec.n_layer - 1}"  # the last layer's output, at any depth
    # the count's control: a decode that never fails enters the data phase once per selected node
    # and micro-batch (two nodes, three micro-batches)
    sel = [profile.select("attn_norm-0"), profile.select(last)]
    with tx_context(model, shape, profile, sel, raise_at(-1)[0]) as ctx:
        before = scheduler_data_phase_entries()
        ctx.decode(tokens)
        entered = scheduler_data_phase_entries() - before
        expect("TX-FAIL-03", entered == 6, f"an untouched decode entered the data phase {entered} times, not 2 x 3")
    if failure == "layout":
        profile = foreign_profile(profile, "attn_norm-0", dtype="i32")
        handler, calls = raise_at(-1)
    else:
        handler, calls = raise_at(0)
    sel = [profile.select("attn_norm-0"), profile.select(last)]
    with tx_context(model, shape, profile, sel, handler) as ctx:
        before = scheduler_data_phase_entries()
        with pytest.raises(retro.TensorCallbackError) as err:
            ctx.decode(tokens)
        entered = scheduler_data_phase_entries() - before
        expect("TX-FAIL-03", err.value.failure.kind == failure, f"failed as {err.value.failure}")
        called = 1 if failure == "handler" else 0
        expect("TX-FAIL-03", len(calls) == called, f"{failure}: the handler was called {len(calls)} times")
        expect("TX-FAIL-03", entered == 1, f"{failure}: the scheduler entered the data phase {entered} times, not once")
        expect("TX-FAIL-02", ctx.sequence_state() == untouched, "the rest of the graph was not computed")
        expect("TX-FAIL-05", ctx.sequence_length == len(tokens), f"{ctx.sequence_length} positions after the failure")
        expect("TX-FAIL-05", ctx.n_past == len(tokens), f"n_past {ctx.n_past} after the failure")
    # a generation that fails in one of its decodes (the prompt's, on a layout; the second
    # generated token's, in its handler) rolls nothing back either: every token it decoded stays,
    # and n_past follows llama.cpp's record of them
    handler, calls = raise_at(-1) if failure == "layout" else raise_at(2)
    with tx_context(model, shape, profile, [profile.select("attn_norm-0")], handler) as ctx:
        before = scheduler_data_phase_entries()
        with pytest.raises(retro.TensorCallbackError):
            ctx.generate(tokens[:3], 6, stop_at_eog=False)
        entered = scheduler_data_phase_entries() - before
        # one entry per handler call, and the failing node's own on a layout failure
        asked = len(calls) + (failure == "layout")
        expect(
            "TX-FAIL-03",
            entered == asked,
            f"a failed generation ({failure}) entered the data phase {entered} times, not {asked}",
        )
        decoded = 3 + max(len(calls) - 1, 0)  # the prompt, then one token per later call
        expect(
            "TX-FAIL-05",
            (ctx.sequence_length, ctx.n_past) == (decoded, decoded),
            f"a generation failed ({failure}) after {decoded} positions: {ctx.sequence_length} in the cache, "
            f"n_past {ctx.n_past}",
        )
    on_path(f"failure={failure}")


@pytest.mark.clause("TX-FAIL-04", "TX-FAIL-06")
def test_the_first_failure_is_reported_and_sticks(backend, loaded, shape: Shape):
    """A decode and a generation whose handler raised report TensorCallbackError describing it;
    every later decode is refused with that first failure, without running or calling the
    handler."""
    model, profile = loaded
    tokens = decode_tokens(shape)
    handler, calls = raise_at(0, lambda: ValueError("the first failure"))
    with tx_context(model, shape, profile, [profile.select("l_out-0")], handler) as ctx:
        with bound("TX-FAIL-04"), pytest.raises(retro.DecodeError) as err:
            ctx.decode(tokens)
        expect("TX-FAIL-04", isinstance(err.value, retro.TensorCallbackError), f"reported as {err.value!r}")
        expect("TX-FAIL-04", "the first failure" in str(err.value), f"reported as {err.value}")
        for _ in range(2):
            with raises_bound("TX-FAIL-06", retro.TensorCallbackError) as again:
                ctx.decode([1])
            expect("TX-FAIL-06", "the first failure" in str(again.value), f"then {again.value}")
        expect("TX-FAIL-06", len(calls) == 1, f"the handler ran {len(calls)} times")
        expect("TX-FAIL-06", ctx.sequence_length == len(tokens), "a refused decode ran")
    handler, calls = raise_at(2, lambda: ValueError("in a generation"))
    with tx_context(model, shape, profile, [profile.select("l_out-0")], handler) as ctx:
        with bound("TX-FAIL-04"), pytest.raises(retro.DecodeError) as err:
            ctx.generate(tokens[:3], 6, stop_at_eog=False)
        expect("TX-FAIL-04", isinstance(err.value, retro.TensorCallbackError), f"reported as {err.value!r}")
        expect("TX-FAIL-04", "in a generation" in str(err.value), f"reported {err.value}")
        expect("TX-FAIL-06", len(calls) == 3, f"the handler ran {len(calls)} times in the generation")


@pytest.mark.clause("TX-FAIL-06")
@pytest.mark.parametrize("failure", ["handler", "layout"])
@pytest.mark.parametrize("then", ["decode", "generate", "speculative", "reset"])
def test_the_first_failure_refuses_every_later_call(backend, loaded, then, failure, shape: Shape):
    """After a decode that failed (its handler raised, or a node's layout failed verification
    before the handler saw it), a later call of each kind is refused with that first failure,
    runs nothing and calls no handler: a decode, a plain generation, a speculative one (the
    draft's context has no transactions; the target's failed; it starts on empty sequences, so
    after a reset), and a decode after reset(), which clears the sequence but not the context's
    failure. Stickiness is the context's, whatever the failure's kind, and reading the stored
    failure (Context.transaction_failure) leaves it stored."""
    model, profile = loaded
    if failure == "layout":
        profile = foreign_profile(profile, "l_out-0", dtype="i32")
        handler, calls = raise_at(-1)
    else:
        handler, calls = raise_at(0, lambda: ValueError("the first failure"))
    tokens = decode_tokens(shape)
    with (
        tx_context(model, shape, profile, [profile.select("l_out-0")], handler) as ctx,
        plain_context(model, shape) as draft,
    ):
        with pytest.raises(retro.TensorCallbackError) as err:
            ctx.decode(tokens)
        first = err.value.failure
        seen = ctx.transaction_failure
        expect(
            "TX-FAIL-06",
            seen is not None and (seen.kind, seen.message) == (first.kind, first.message),
            f"after a {failure} failure the context stores {seen!r}",
        )
        if then in ("reset", "speculative"):
            ctx.reset()
        length = ctx.sequence_length
        with raises_bound("TX-FAIL-06", retro.TensorCallbackError) as again:
            if then in ("decode", "reset"):
                ctx.decode(tokens[:2])
            else:
                ctx.generate(tokens[:2], 3, stop_at_eog=False, draft=draft if then == "speculative" else None)
        refused = again.value.failure
        expect(
            "TX-FAIL-06",
            (refused.kind, refused.message) == (first.kind, first.message),
            f"{then} after a {failure} failure: refused with {refused.kind}: {refused.message[:120]!r}",
        )
        expect("TX-FAIL-06", len(calls) == (failure == "handler"), f"{then}: the handler ran {len(calls)} times")
        expect("TX-FAIL-06", ctx.sequence_length == length, f"{then} after a {failure} failure: the refused call ran")
    on_path(f"failure={failure}", f"then={then}")


@pytest.mark.clause("HARNESS-04")
def test_a_handler_exception_at_every_invocation_is_contained(backend, loaded, tmp_path, seed, shape: Shape):
    """A 3-micro-batch decode with two selected nodes, and a speculative generation whose target
    and draft both have handlers: the handler raises at each of their invocations in turn. Every
    time: TensorCallbackError naming that invocation, no further call, the tokens of the failed
    decode kept, and the captures of earlier decodes committed."""
    model, profile = loaded
    sel = [profile.select("attn_norm-0", retain=True, access="mutable-f32"), profile.select("result_norm")]
    tokens = decode_tokens(shape)
    clean, calls = raise_at(-1)
    with tx_context(model, shape, profile, sel, clean) as ctx:
        ctx.decode(tokens)
    for k in range(len(calls)):
        handler, seen = raise_at(k, functools.partial(ValueError, f"invocation {k}"))
        with tx_context(model, shape, profile, sel, handler) as ctx:
            with bound("HARNESS-04"), pytest.raises(retro.TensorCallbackError) as err:
                ctx.decode(tokens)
            expect("HARNESS-04", err.value.failure.message == f"invocation {k}", f"at {k}: {err.value.failure}")
            expect(
                "HARNESS-04", len(seen) == k + 1 and ctx.sequence_length == len(tokens), f"at {k}: {len(seen)} calls"
            )

    with support.load(
        backend, support.model_file(tmp_path, seed, shape, draft_noise=DRAFT_NOISE), trainable=False
    ) as draft_model:
        draft_profile = Profile.record(draft_model)
        log: list[str] = []

        def speculate(fail_at: int) -> BaseException | None:
            """A speculative generation whose handlers (target and draft) raise at call fail_at."""

            def on(side: str) -> Callable[[Transaction], None]:
                def handler(t: Transaction) -> None:
                    log.append(side)
                    if len(log) == fail_at + 1:
                        raise ValueError(f"invocation {fail_at}")

                return handler

            target_tx = TensorTransactions(profile, [profile.select("l_out-0", retain=True)], on("target"))
            draft_tx = TensorTransactions(draft_profile, [draft_profile.select("l_out-0")], on("draft"))
            with plain_context(model, shape, target_tx) as target, plain_context(draft_model, shape, draft_tx) as draft:
                try:
                    target.generate(tokens[:3], 16, stop_at_eog=False, draft=draft, n_draft=3)
                except retro.DecodeError as err:
                    return err
            return None

        speculate(-1)
        total = len(log)
        expect("HARNESS-04", set(log) == {"target", "draft"}, "the speculative run called one side only")
        for k in range(total):
            log.clear()
            raised = speculate(k)
            with bound("HARNESS-04"):
                assert isinstance(raised, retro.TensorCallbackError), f"at {k} ({log[-1]}): {raised!r}"
                assert raised.failure.message == f"invocation {k}", f"at {k}: {raised.failure}"
            expect("HARNESS-04", len(log) == k + 1, f"at {k}: {len(log)} calls")
