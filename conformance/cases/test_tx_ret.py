"""Tensor transactions (seed 004), TX-RET: retained captures: staged per decode, discarded with a
failed one, within their byte limit. Each is observed from outside the binding: llama.cpp's own
record of the callback's user data and its destructor, the sequence state llama.cpp serializes, the
logits it returns, numpy references, and the handler's own log. Shared helpers: _transactions.py."""

from __future__ import annotations

import dataclasses

import pytest

import retro
from retro.conformance import support
from retro.conformance.cases._transactions import (
    committed_positions,
    decode_tokens,
    fails_closed,
    foreign_profile,
    tx_context,
)
from retro.conformance.evidence import bound, expect, on_path, raises_bound
from retro.conformance.shapes import Shape
from retro.transactions import Profile, TensorTransactions, Transaction


@pytest.mark.clause("TX-RET-01")
def test_captures_are_staged_per_decode(backend, loaded, shape: Shape):
    """A generation of 5 tokens commits each of its decodes' rows once: the captured rows are
    exactly the tokens decoded, grouped by decode, in order."""
    model, profile = loaded
    tokens = decode_tokens(shape)
    with tx_context(model, shape, profile, [profile.select("l_out-0", retain=True)]) as ctx:
        g = ctx.generate(tokens[:3], 5, stop_at_eog=False)
        covered = committed_positions(ctx.drain_captures(), "l_out-0")
    expected = {d: [p] for d, p in zip(range(1, g.decodes), range(3, 3 + g.decodes - 1), strict=True)}
    expected[0] = [0, 1, 2]
    expect("TX-RET-01", covered == expected, f"captures per decode {covered}, expected {expected}")
    # a decode of several micro-batches is one decode: the next ones are numbered on from it, in
    # their captures and in the transactions their handler sees
    seen: list[int] = []
    with tx_context(
        model, shape, profile, [profile.select("l_out-0", retain=True)], lambda t: seen.append(t.decode)
    ) as ctx:
        ctx.decode(tokens)
        ctx.decode([1])
        ctx.decode([2])
        covered = committed_positions(ctx.drain_captures(), "l_out-0")
    n = len(tokens)
    expected = {0: list(range(n)), 1: [n], 2: [n + 1]}
    expect("TX-RET-01", covered == expected, f"captures per decode after {n} tokens in micro-batches: {covered}")
    expect("TX-RET-01", sorted(set(seen)) == [0, 1, 2], f"the handler saw decodes {sorted(set(seen))}")


@pytest.mark.clause("TX-RET-02", "TX-PROF-02")
def test_a_graph_that_does_not_match_the_profile_fails_closed(backend, loaded, tmp_path, seed, shape: Shape):
    """Selectors bound to a profile of a model one layer deeper of the same architecture, used on
    the profile's model: the deeper model's last l_out is never computed, so the decode fails after
    it ran (coverage), the handler never saw a mismatched node, and no capture of that decode is
    committed. A profile of a wider model fails closed on the row width, and so does one of a
    narrower model. No prefix matching (a name that begins others is not theirs) and no type
    coercion (an i32 record of an f32 node of the same element size is refused)."""
    model, profile = loaded
    tokens, spec = decode_tokens(shape), shape.spec
    with support.load(
        backend, support.model_file(tmp_path, seed, shape, n_layer=spec.n_layer + 1), trainable=False
    ) as deeper:
        deep = Profile.record(deeper)
    with support.load(
        backend, support.model_file(tmp_path, seed, shape, n_embd=2 * spec.n_embd), trainable=False
    ) as wider:
        wide = Profile.record(wider)
    sel = [deep.select("l_out-0", retain=True), deep.select(f"l_out-{spec.n_layer}", retain=True)]
    with tx_context(model, shape, deep, sel) as ctx:
        with bound("TX-PROF-02"), pytest.raises(retro.TensorCallbackError) as err:
            ctx.decode(tokens)
        expect("TX-PROF-02", err.value.failure.kind == "coverage", f"failed as {err.value.failure}")
        expect("TX-RET-02", ctx.drain_captures() == [], "a decode that failed its coverage committed captures")
    calls: list = []
    with tx_context(model, shape, wide, [wide.select("l_out-0")], calls.append) as ctx, bound("TX-PROF-02"):
        assert "elements per row" in fails_closed(ctx, calls, tokens)
    # and of a narrower one: a node wider than its selector fails closed too, never cut to fit
    half = spec.n_embd // 2
    with support.load(backend, support.model_file(tmp_path, seed, shape, n_embd=half), trainable=False) as narrower:
        narrow = Profile.record(narrower)
    with tx_context(model, shape, narrow, [narrow.select("l_out-0")], calls.append) as ctx, bound("TX-PROF-02"):
        got = fails_closed(ctx, calls, tokens)
        assert got == f"{model.n_embd} elements per row, selected {half}", got
    # no prefix matching: a node this graph lacks, whose name begins those of nodes it has
    # (attn_norm-0, attn_norm-1), is absent: the decode fails its coverage, the handler unseen
    nodes = {**profile.nodes, "attn_norm": dataclasses.replace(profile.nodes["attn_norm-0"], name="attn_norm")}
    prefix = dataclasses.replace(profile, nodes=nodes)
    with tx_context(model, shape, prefix, [prefix.select("attn_norm")], calls.append) as ctx:
        with bound("TX-PROF-02"), pytest.raises(retro.TensorCallbackError) as err:
            ctx.decode(tokens)
        expect("TX-PROF-02", err.value.failure.kind == "coverage", f"a name's prefix: failed as {err.value.failure}")
        expect("TX-PROF-02", not calls, f"a name's prefix: the handler saw {len(calls)} copies of other nodes")
    # no type coercion: a node recorded as i32 (the element size of its real f32) is refused
    foreign = foreign_profile(profile, "l_out-0", dtype="i32")
    with tx_context(model, shape, foreign, [foreign.select("l_out-0")], calls.append) as ctx, bound("TX-PROF-02"):
        got = fails_closed(ctx, calls, tokens)
        assert got == "element type f32, selected i32", got


@pytest.mark.clause("TX-RET-03")
def test_a_failed_internal_decode_discards_only_its_own_staging(backend, loaded, shape: Shape):
    """A generation whose handler raises in its 4th decode: the error carries the tokens made
    before, and the captures of the 3 decodes before it stay committed, complete; none of the
    failed decode's."""
    model, profile = loaded

    def handler(t: Transaction) -> None:
        if t.decode == 3:
            raise ValueError("fourth decode")

    sel = [profile.select("l_out-0", retain=True, access="mutable-f32")]
    with tx_context(model, shape, profile, sel, handler) as ctx:
        with pytest.raises(retro.TensorCallbackError) as err:
            ctx.generate(decode_tokens(shape)[:3], 6, stop_at_eog=False)
        covered = committed_positions(ctx.drain_captures(), "l_out-0")
    expect("TX-RET-03", len(err.value.tokens) == 3, f"tokens before the failure: {err.value.tokens}")
    expect("TX-RET-03", covered == {0: [0, 1, 2], 1: [3], 2: [4]}, f"committed: {covered}")


#: a node with a row per token of the decode, and one with a row per output
RETAINED = {"tokens": "l_out-0", "outputs": "result_norm"}


@pytest.mark.clause("TX-RET-04")
@pytest.mark.parametrize("rows", list(RETAINED))
def test_undrained_captures_stay_within_their_byte_limit(backend, loaded, rows, shape: Shape):
    """With room for two decodes of a micro-batch each of a retained node (one with a row per token,
    one with a row per output: a decode outputs every token), a third is refused before it runs
    (nothing decoded, nothing lost); draining frees the room. The limit is a count of bytes: a
    negative one is refused as the bad value it is (a ValueError naming the bound), beside retained
    selectors and beside ones a handler takes unretained. The bound holds to the byte: with two decodes' rows
    held, a limit one byte short of three decodes' refuses the third, one of exactly three takes it;
    and with decodes of other lengths and of several micro-batches, a decode's own rows count."""
    model, profile = loaded
    tokens, m = decode_tokens(shape), shape.decode_micro_batch
    limit = 2 * m * model.n_embd * 4
    sel = [profile.select(RETAINED[rows], retain=True, max_rows=m)]
    for chosen in (sel, [profile.select(RETAINED[rows], retain=False)]):
        with bound("TX-RET-04"), pytest.raises(ValueError, match=r"retained_limit must be >= 0"):
            TensorTransactions(profile, chosen, lambda t: None, retained_limit=-1)
    with tx_context(model, shape, profile, sel, retained_limit=limit) as ctx:
        ctx.decode(tokens[:m])
        ctx.decode(tokens[m : 2 * m])
        with raises_bound("TX-RET-04", retro.CaptureLimitError):
            ctx.decode(tokens[2 * m :])
        expect("TX-RET-04", ctx.sequence_length == 2 * m, f"the refused decode ran: {ctx.sequence_length} positions")
        held = ctx.drain_captures()
        expect("TX-RET-04", sum(c.data.nbytes for c in held) <= limit, "the undrained captures exceeded the limit")
        two = [list(range(m)), list(range(m, 2 * m))]
        expect("TX-RET-04", [c.positions.tolist() for c in held] == two, "captures lost")
        ctx.decode(tokens[2 * m :])
        expect("TX-RET-04", len(ctx.drain_captures()) == 1, "drained room was not given back")
    # the limit is held in bytes, to the byte: with two decodes' rows held, a limit one byte short
    # of three decodes' refuses the third, and one of exactly three decodes' takes it
    one = m * model.n_embd * 4
    for room, fits in ((3 * one - 1, False), (3 * one, True)):
        with tx_context(model, shape, profile, sel, retained_limit=room) as ctx:
            ctx.decode(tokens[:m])
            ctx.decode(tokens[m : 2 * m])
            took = support.raised(lambda: ctx.decode(tokens[:m]))
            expect(
                "TX-RET-04",
                (took is None) == fits and (fits or isinstance(took, retro.CaptureLimitError)),
                f"a limit of {room} bytes, {2 * one} held, a decode retaining {one}: {took!r}",
            )
    # decodes of different lengths, and of more than one micro-batch: the room a decode needs is
    # its own rows', all its micro-batches', not another decode's or its first micro-batch's. The
    # room is the rows held and the decode's own, or one row short of them
    row = model.n_embd * 4
    half, whole = m // 2, len(tokens)
    for held, length, fits in (
        ((m, half), m, False),
        ((m, half), m - 1, True),
        ((), m + half, False),
        ((), m + half, True),
        ((half,), whole, True),
        ((half,), whole, False),
    ):
        room = (sum(held) + length - (0 if fits else 1)) * row
        with tx_context(model, shape, profile, sel, retained_limit=room) as ctx:
            start = 0
            for n in held:
                ctx.decode(tokens[start : start + n])
                start += n
            took = support.raised(lambda ctx=ctx, n=length: ctx.decode(tokens[:n]))
            expect(
                "TX-RET-04",
                (took is None) == fits and (fits or isinstance(took, retro.CaptureLimitError)),
                f"a limit of {room // row} rows, decodes of {list(held)} held, a decode of {length}: {took!r}",
            )
    on_path(f"rows={rows}")
