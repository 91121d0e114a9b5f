"""Tensor transactions (seed 004), TX-ACC: native tensor access: the node a selector names, its exact
type, layout, rows and bounds, and write-back. Each is observed from outside the binding:
llama.cpp's own record of the callback's user data and its destructor, the sequence state llama.cpp
serializes, the logits it returns, numpy references, and the handler's own log. Shared helpers:
_transactions.py."""

from __future__ import annotations

import numpy as np
import pytest

import retro
from retro import _native
from retro.conformance import support
from retro.conformance.cases._transactions import (
    decode_ok,
    decode_tokens,
    fails_closed,
    foreign_profile,
    micro_batches,
    plain_context,
    plain_state,
    rows_of,
    steer,
    tx_context,
)
from retro.conformance.evidence import Bound, bound, expect, measure, on_path, within
from retro.conformance.shapes import Shape
from retro.testing import reference
from retro.transactions import Profile, ProfileError, Transaction

#: attn_norm-0 as the handler sees it against numpy's RMS norm of the token embeddings (float32
#: against float64; an uncomputed node holds another graph's values, off by O(1))
NORM_ROWS = Bound(
    "TX-ACC-01 attn_norm-0 seen vs numpy, relative",
    1e-6,
    cpu=5e-7,
    reason="a GPU sums the squares of an RMS norm by warps, in another order than the CPU; lavapipe and the "
    "GPU-like server measure the CPU's 8.6e-8 (the emulation changes matrix products only): 12x that",
)
#: a node's rows captured in micro-batches against the same rows of one whole batch: the same
#: kernels on the same rows, on the CPU to the bit (rows out of place differ by O(1))
SPLIT_ROWS = Bound(
    "TX-ACC-07 rows captured split vs whole, absolute",
    1e-6,
    cpu=0.0,
    reason="CUDA picks a matrix kernel by the batch's row count (a vector kernel for one row, tiles for "
    "many), so a row computed in a smaller batch rounds another way (lavapipe and the GPU-like server: "
    "0); 8 ulps of a value of order 1",
)
#: the steering a mutable copy wrote back (steered minus unsteered logits, against numpy's v . W^T),
#: in units of the backend's own error on the same product: that error measured on the unsteered
#: logits against float64 numpy (largely cancelling in the difference; a GPU's F32 product may run
#: at TF32), floored at 5e-7 of the logits' scale for the F32 rounding of two decodes where it comes
#: out small (the CPU measures 0.33 of it). A copy written twice, or not at all, is off by the whole
#: steering (about 0.26)
STEERING = Bound("TX-ACC-09 steering written back vs numpy, in the backend's own product errors", 3.0)


def refused(node: str, message: str) -> tuple[str, str, str, str, str]:
    """What the data phase's checks (retro._native.tx_verify) return for a layout they refuse:
    the report names the node and says what it found against what was selected."""
    return ("layout", node, "", message, "")


@pytest.mark.clause("TX-ACC-01", "TX-ACC-08")
@pytest.mark.shapes("tiny", "realistic")
def test_the_handler_sees_the_complete_computed_tensor(backend, loaded, model_path, shape: Shape):
    """The copy of result_output the handler gets, micro-batch by micro-batch, is the complete
    tensor llama.cpp computed: row for row the logits the decode returns, and those are the logits
    of a decode without transactions (a node read before this decode computed it holds what an
    earlier graph left there, and whatever read it after would too). A node inside the graph,
    attn_norm-0, is what numpy computes from the model file for these tokens, and selecting it
    leaves the decode's logits as they are without transactions."""
    model, profile = loaded
    tokens, split = decode_tokens(shape), micro_batches(shape)
    with plain_context(model, shape) as plain:
        untouched = plain.decode(tokens)
    seen: list[np.ndarray] = []
    # the decodes are the clause's observation: one whose data phase met a node before it was
    # computed fails here (its rows are not the batch's, or it was never seen), not elsewhere
    with tx_context(model, shape, profile, [profile.select("result_output")], lambda t: seen.append(t.data)) as ctx:
        logits = decode_ok("TX-ACC-01", ctx, tokens)
    with bound("TX-ACC-08"):  # owned storage, whatever the values: a view of native memory is no copy
        assert all(a.flags.owndata for a in seen), "the handler got a view, not an owned copy"
    # complete, whatever the timing: a mutable copy of attn_norm-0 written back as the handler got it
    # leaves the logits to the bit (an incomplete copy writes its holes back; a copy taken before the
    # node was computed is overwritten by the compute, and is TX-ACC-01's, below)
    zero = steer(np.zeros(model.n_embd, np.float32))
    with tx_context(model, shape, profile, [profile.select("attn_norm-0", access="mutable-f32")], zero) as ctx:
        with bound("TX-ACC-08"):
            round_trip = ctx.decode(tokens)
            support.assert_close(round_trip, untouched, backend, "a mutable copy written back unchanged")
    with bound("TX-ACC-01"):
        assert len(seen) == len(split), f"the handler saw {len(seen)} copies for {len(split)} micro-batches"
        # a node read before it was computed holds nothing of this micro-batch: not one row of its
        # copy is the decode's (a copy short of the whole tensor still holds some: TX-ACC-08, below)
        for (first, rows), copy in zip(split, seen, strict=True):
            mine = logits[first : first + rows]
            assert any(np.array_equal(a, b) for a, b in zip(copy, mine)), "the node was read before it was computed"
        support.assert_close(logits, untouched, backend, "logits with result_output selected vs without transactions")
    norms: list[np.ndarray] = []
    with tx_context(model, shape, profile, [profile.select("attn_norm-0")], lambda t: norms.append(t.data)) as ctx:
        logits = decode_ok("TX-ACC-01", ctx, tokens)
    with bound("TX-ACC-01"):
        support.assert_close(logits, untouched, backend, "logits with attn_norm-0 selected vs without transactions")
        assert sum(len(n) for n in norms) == len(tokens), f"{[len(n) for n in norms]} rows of attn_norm-0 seen"
    weights = reference.read_weights(model_path)
    x = weights["token_embd.weight"][tokens]
    want = x / np.sqrt((x * x).mean(-1, keepdims=True) + reference.RMS_EPS) * weights["blk.0.attn_norm.weight"]
    off = float(np.max(np.abs(np.concatenate(norms) - want) / np.max(np.abs(want))))
    within(
        "TX-ACC-01",
        NORM_ROWS,
        "attn_norm-0 rows seen vs numpy's",
        off,
        "largest error, relative to the largest row value",
    )
    with bound("TX-ACC-08"):
        for (first, rows), copy in zip(split, seen, strict=True):
            np.testing.assert_array_equal(
                copy, logits[first : first + rows], err_msg="the copy is not the whole tensor"
            )
    # retained, two nodes of different widths in one decode: each drained capture is its own
    # node whole (the logits, and result_norm as the handler saw it)
    retained = [profile.select("result_norm", retain=True), profile.select("result_output", retain=True)]
    norms = []
    with tx_context(
        model, shape, profile, retained, lambda t: norms.append(t.data) if t.name == "result_norm" else None
    ) as ctx:
        logits = ctx.decode(tokens)
        captures = ctx.drain_captures()
    with bound("TX-ACC-08"):
        _, kept_logits = rows_of(captures, "result_output")
        _, kept_norms = rows_of(captures, "result_norm")
        np.testing.assert_array_equal(kept_logits, logits, err_msg="a retained copy of result_output")
        np.testing.assert_array_equal(kept_norms, np.concatenate(norms), err_msg="a retained copy of result_norm")
        assert all(c.data.flags.owndata for c in captures), "a drained capture is a view, not an owned copy"


@pytest.mark.clause("TX-ACC-02")
def test_a_selector_names_one_node_exactly(backend, tmp_path, seed, shape: Shape):
    """On an 11-layer model, l_out-1 selects l_out-1 alone (not l_out-10): one copy per
    micro-batch, all of that name. A name that is only a prefix, or that names several nodes
    (Qcur-0), cannot be selected."""
    # eleven layers, whatever the profile's: l_out-10 exists, and l_out-1 is a prefix of its name
    path = support.model_file(tmp_path, seed, shape, n_layer=11)
    m = shape.decode_micro_batch
    with support.load(backend, path, trainable=False) as model:
        profile = Profile.record(model)
        names: list[str] = []
        with tx_context(model, shape, profile, [profile.select("l_out-1")], lambda t: names.append(t.name)) as ctx:
            decode_ok("TX-ACC-02", ctx, decode_tokens(shape))
            expect("TX-ACC-02", names == ["l_out-1"] * 3, f"the handler saw {names}")
        for name in ("l_out", "l_out-", "Qcur-0"):
            with bound("TX-ACC-02"), pytest.raises(ProfileError):
                profile.select(name)
        # a name the graph gives two nodes (norm-0: the attention's and the FFN's input norms),
        # presented as one by a stale profile: in a decode of one micro-batch, the second node of
        # that name fails closed after decode, named for what it is
        twice = foreign_profile(profile, "norm-0", occurrences=1)
        seen: list[Transaction] = []
        with tx_context(model, shape, twice, [twice.select("norm-0")], seen.append) as ctx, bound("TX-ACC-02"):
            with pytest.raises(retro.TensorCallbackError) as err:
                ctx.decode(decode_tokens(shape)[:m])
            met = err.value.failure
            assert (met.kind, met.node) == ("layout", "norm-0"), f"failed as {met}"
            assert met.message.startswith("the selected name names more than one node"), met.message
            assert len(seen) == 1, f"the handler saw {len(seen)} copies of norm-0"
        # the data phase's own check, given another node's metadata: refused, both names reported
        spec = profile.select("l_out-1")._spec()
        with bound("TX-ACC-02"):
            failure = _native.tx_verify("l_out-10", 0, (model.n_embd, m, 1, 1), True, spec, m)
            assert failure == refused("l_out-10", "the node is not the selected node 'l_out-1'"), failure


@pytest.mark.clause("TX-ACC-03")
def test_the_element_type_is_exact(backend, loaded, shape: Shape):
    """A profile that records l_out-0 as i32 (same element size as its real f32): the data phase
    refuses the node after decode, nothing reinterpreted; f16 against f32 is refused as well."""
    model, profile = loaded
    foreign = foreign_profile(profile, "l_out-0", dtype="i32")
    calls: list = []
    with tx_context(model, shape, foreign, [foreign.select("l_out-0")], calls.append) as ctx, bound("TX-ACC-03"):
        assert fails_closed(ctx, calls, decode_tokens(shape)) == "element type f32, selected i32"
    spec = profile.select("l_out-0")._spec()
    with bound("TX-ACC-03"):
        m = shape.decode_micro_batch
        failure = _native.tx_verify("l_out-0", 1, (model.n_embd, m, 1, 1), True, spec, m)  # GGML_TYPE_F16
        assert failure == refused("l_out-0", "element type f16, selected f32"), f"f16: {failure}"


@pytest.mark.clause("TX-ACC-04")
def test_the_layout_is_two_dimensional_contiguous_and_not_empty(backend, loaded, shape: Shape):
    """Qcur-0 (view) is [head size, heads, tokens]: in a micro-batch of as many tokens as heads its
    first two dimensions look like a row per token, and a profile claiming so must still be refused;
    so must a non-contiguous and an empty node (the data phase's checks given that metadata)."""
    model, profile = loaded
    heads = shape.spec.n_head
    node = profile.nodes["Qcur-0 (view)"]
    foreign = foreign_profile(profile, node.name, shape=(node.shape[0], 3, 1, 1), rows="tokens")
    calls: list = []
    not_2d = "not a two-dimensional, non-empty, contiguous tensor [{}, {}, {}, {}]"
    one = list(range(3, 3 + heads))  # as many tokens as heads, decoded in one micro-batch
    with (
        tx_context(model, shape, foreign, [foreign.select(node.name)], calls.append, n_ubatch=heads) as ctx,
        bound("TX-ACC-04"),
    ):
        assert fails_closed(ctx, calls, one) == not_2d.format(node.shape[0], node.shape[1], heads, 1)
    spec = profile.select("l_out-0")._spec()
    e, m = model.n_embd, shape.decode_micro_batch
    for ne, contiguous, rows in (((e, m, 1, 1), False, m), ((e, 0, 1, 1), True, 1), ((e, 2, 3, 1), True, 2)):
        with bound("TX-ACC-04"):
            failure = _native.tx_verify("l_out-0", 0, ne, contiguous, spec, rows)
            assert failure == refused("l_out-0", not_2d.format(*ne)), f"{ne} (contiguous {contiguous}): {failure}"


@pytest.mark.clause("TX-ACC-05")
def test_row_width_is_exact_and_the_row_bound_inclusive(backend, loaded, shape: Shape):
    """Micro-batches of m, m and m/2 rows (m: the decoding micro-batch) pass a bound of m
    (inclusive) and fail one of m - 1; a profile recording another row width fails closed."""
    model, profile = loaded
    tokens, m = decode_tokens(shape), shape.decode_micro_batch
    calls: list = []
    with tx_context(model, shape, profile, [profile.select("l_out-0", max_rows=m)], calls.append) as ctx:
        decode_ok("TX-ACC-05", ctx, tokens)
        per_micro_batch = [rows for _, rows in micro_batches(shape)]
        expect("TX-ACC-05", [t.data.shape[0] for t in calls] == per_micro_batch, "rows at the bound were refused")
    calls.clear()
    with (
        tx_context(model, shape, profile, [profile.select("l_out-0", max_rows=m - 1)], calls.append) as ctx,
        bound("TX-ACC-05"),
    ):
        assert fails_closed(ctx, calls, tokens) == f"{m} rows, at most {m - 1} selected"
    node = profile.nodes["l_out-0"]
    wider = foreign_profile(profile, "l_out-0", shape=(node.shape[0] * 2, *node.shape[1:]))
    with tx_context(model, shape, wider, [wider.select("l_out-0")], calls.append) as ctx, bound("TX-ACC-05"):
        assert fails_closed(ctx, calls, tokens) == f"{node.shape[0]} elements per row, selected {node.shape[0] * 2}"


@pytest.mark.clause("TX-ACC-06")
def test_element_and_byte_counts_are_overflow_checked(backend):
    """The data phase's checks given node metadata whose element or byte count overflows 64 bits
    report the overflow, at the element count and at the byte count alone (an element count that
    fits, whose bytes wrap to 0 or to a few bytes); the largest node a selector admits gets its
    exact byte count."""
    from retro.transactions import MAX_ROW_ELEMENTS, MAX_ROWS

    spec = ("big", 0, MAX_ROW_ELEMENTS, MAX_ROWS, 0, False, 0, 0, 0)
    for ne in (
        (MAX_ROW_ELEMENTS, MAX_ROWS, 1 << 20, 1 << 20),
        (MAX_ROW_ELEMENTS, MAX_ROWS, 1 << 21, 1),
        (1 << 62, 2, 1, 1),
        (1 << 31, 1 << 31, 1, 1),  # 2^62 elements fit; their 4-byte size wraps to 0
        ((1 << 62) + 1, 1, 1, 1),  # wraps to 4 bytes
    ):
        failure = _native.tx_verify("big", 0, ne, True, spec, MAX_ROWS)
        expect("TX-ACC-06", failure == refused("big", "the element or byte count overflows"), f"{ne}: {failure}")
    fits = _native.tx_verify("big", 0, (MAX_ROW_ELEMENTS, MAX_ROWS, 1, 1), True, spec, MAX_ROWS)
    expect("TX-ACC-06", fits == MAX_ROW_ELEMENTS * MAX_ROWS * 4, f"the largest node: {fits}")


@pytest.mark.clause("TX-ACC-07")
def test_rows_are_the_logical_rows_of_the_submitted_batch(backend, loaded, shape: Shape):
    """Decoded in three micro-batches (two whole, one half), each copy starts at its micro-batch's
    first logical row and carries its positions, and together they equal the copy of one
    micro-batch holding the whole decode; an output node's rows are the outputs (a generation's
    prompt: its last token only)."""
    model, profile = loaded
    tokens, m = decode_tokens(shape), shape.decode_micro_batch
    calls: list[Transaction] = []
    with tx_context(model, shape, profile, [profile.select("attn_norm-0", retain=True)], calls.append) as ctx:
        ctx.decode(tokens)
        positions, split = rows_of(ctx.drain_captures(), "attn_norm-0")
    expect("TX-ACC-07", [(t.first_row, t.data.shape[0]) for t in calls] == micro_batches(shape), "micro-batch rows")
    expect("TX-ACC-07", positions.tolist() == list(range(len(tokens))), f"positions {positions.tolist()}")
    # four micro-batches' room: the whole decode in one
    with tx_context(model, shape, profile, [profile.select("attn_norm-0", retain=True)], n_ubatch=4 * m) as ctx:
        ctx.decode(tokens)
        _, whole = rows_of(ctx.drain_captures(), "attn_norm-0")
    with bound("TX-ACC-07"):
        assert split.shape == whole.shape, f"{split.shape} rows split, {whole.shape} whole"
    within("TX-ACC-07", SPLIT_ROWS, "attn_norm-0 rows split vs whole", float(np.max(np.abs(split - whole))))
    prompt = tokens[: m + m // 2]  # a micro-batch and a half
    with tx_context(model, shape, profile, [profile.select("result_norm", retain=True)]) as ctx:
        ctx.generate(prompt, 1)
        positions, _ = rows_of(ctx.drain_captures(), "result_norm")
    expect("TX-ACC-07", positions.tolist() == [len(prompt) - 1], f"output rows at {positions.tolist()}")
    # the data phase's own check, given a node of one row fewer than its micro-batch's tokens
    spec = profile.select("attn_norm-0")._spec()
    failure = _native.tx_verify("attn_norm-0", 0, (model.n_embd, m - 1, 1, 1), True, spec, m)
    want = refused("attn_norm-0", f"{m - 1} rows where the submitted batch has {m} in this micro-batch")
    expect("TX-ACC-07", failure == want, f"{m - 1} rows for {m}: {failure}")


@pytest.mark.clause("TX-ACC-09")
@pytest.mark.parametrize("value", ["nan", "+inf", "-inf"])
def test_a_mutable_copy_is_written_back_once_when_finite(backend, loaded, seed, value, shape: Shape):
    """Adding a steering vector to result_norm moves every logit by what numpy computes from the
    vector and the output weights, once (v . W^T); a copy with one non-finite value (NaN, +Inf or
    -Inf) in its last row is not written: llama.cpp's sequence state is the untouched decode's.

    The bound comes from the backend, not from CPU numerics: the steering is read as the
    difference between the steered and the unsteered logits, in which the backend's own error on
    the output product largely cancels, and is held to three times that error (STEERING)."""
    model, profile = loaded
    tokens = decode_tokens(shape)
    v = np.random.default_rng(seed).normal(0, 0.5, model.n_embd).astype(np.float32)
    w = model.tensor("output.weight").astype(np.float64)
    with tx_context(model, shape, profile, [profile.select("result_norm", retain=True)]) as ctx:
        unsteered = ctx.decode(tokens).astype(np.float64)
        _, norm = rows_of(ctx.drain_captures(), "result_norm")
    with tx_context(model, shape, profile, [profile.select("result_norm", access="mutable-f32")], steer(v)) as ctx:
        steered = ctx.decode(tokens).astype(np.float64)
    backend_error = float(np.abs(unsteered - norm.astype(np.float64) @ w.T).max())
    steering = v.astype(np.float64) @ w.T  # what one write-back of the vector adds to each row
    error = float(np.abs((steered - unsteered) - steering).max())
    unit = max(backend_error, 5e-7 * float(np.abs(unsteered).max()))
    tolerance = STEERING.on(backend.name) * unit
    measure("steering-write-back", error=error, unit=unit, defect_error=float(np.abs(steering).max()))
    expect(
        "TX-ACC-09",
        tolerance < 0.1 * float(np.abs(steering).max()),
        f"the backend's own error ({backend_error:.3g}) leaves a bound ({tolerance:.3g}) that could hide a copy "
        "written twice or not at all",
    )
    within("TX-ACC-09", STEERING, f"value={value}: steered minus unsteered logits", error / unit)
    untouched = plain_state(model, shape, tokens)
    sel = [profile.select("attn_norm-0", access="mutable-f32")]
    with tx_context(model, shape, profile, sel, steer(v, poison_last=float(value))) as ctx:
        with bound("TX-ACC-09"), pytest.raises(retro.TensorCallbackError):
            ctx.decode(tokens)
        failure = ctx.transaction_failure
        expect("TX-ACC-09", failure is not None and failure.kind == "non-finite", f"failed as {failure}")
        expect("TX-ACC-09", ctx.sequence_state() == untouched, f"a copy holding {value} was written back")
    on_path(f"value={value}")


@pytest.mark.clause("TX-ACC-10")
def test_a_failed_transaction_writes_nothing_back(backend, loaded, seed, shape: Shape):
    """A handler that edits its copy and then raises, one whose last row holds a NaN, and ones
    that edit and then change their array's shape or element type in place (the same bytes, read
    as another tensor) leave the node as computed: llama.cpp's sequence state equals the
    untouched decode's, and a changed array fails the decode as such."""
    model, profile = loaded
    v = np.full(model.n_embd, 0.25, np.float32)
    tokens = decode_tokens(shape)
    untouched = plain_state(model, shape, tokens)
    for how in ({"then_raise": True}, {"poison_last": float("nan")}):
        sel = [profile.select("attn_norm-0", access="mutable-f32")]
        with tx_context(model, shape, profile, sel, steer(v, **how)) as ctx:
            err = support.raised(lambda ctx=ctx: ctx.decode(tokens))
            expect("TX-ACC-10", ctx.sequence_state() == untouched, f"{how}: part of the copy was written back")
            expect("TX-ACC-10", isinstance(err, retro.TensorCallbackError), f"{how}: the decode ended with {err!r}")
    changes = {
        "transposed shape": lambda a: setattr(a, "shape", (a.shape[1], a.shape[0])),
        "one flat row": lambda a: setattr(a, "shape", (1, a.size)),
        "int32 elements": lambda a: setattr(a, "dtype", np.int32),
    }
    for what, change in changes.items():

        def edit_then_change(t: Transaction, change=change) -> None:
            t.data += v
            change(t.data)

        sel = [profile.select("attn_norm-0", access="mutable-f32")]
        with tx_context(model, shape, profile, sel, edit_then_change) as ctx:
            err = support.raised(lambda ctx=ctx: ctx.decode(tokens))
            failure = getattr(err, "failure", None)
            expect(
                "TX-ACC-10",
                failure is not None and failure.message == "the handler changed the shape or type of its array",
                f"{what}: the decode ended with {err!r} ({failure})",
            )
            expect("TX-ACC-10", ctx.sequence_state() == untouched, f"{what}: the changed array was written back")
