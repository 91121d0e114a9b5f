"""Tensor transactions (seed 004): ownership, native tensor access, retained captures, failure
containment and profile binding, on the backend under test, each observed from outside the
binding: llama.cpp's own record of the callback's user data and of its destructor, the sequence
state llama.cpp serializes, the logits it returns, numpy references, and the handler's own log."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import itertools
import os
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from collections.abc import Callable, Iterator

import numpy as np
import pytest

import retro
from retro import _native
from retro.conformance import support
from retro.conformance.evidence import bound, expect
from retro.transactions import Profile, ProfileError, Selector, TensorTransactions, Transaction
from retro.unsafe import TensorCapture

N_UBATCH = 4
TOKENS = list(range(3, 13))  # 10 tokens: micro-batches of 4, 4 and 2
SPLIT = [(0, 4), (4, 4), (8, 2)]  # (first row, rows) of each micro-batch
DRAFT_NOISE = 1.0  # the draft: the model with noise in its last FFN, so it agrees in part


@pytest.fixture
def loaded(backend, model_path):
    """The model on the backend under test and its profile."""
    with support.load(backend, model_path, trainable=False) as model:
        yield model, Profile.record(model)


def _context(model: retro.Model, tx: TensorTransactions | None = None, *, n_ubatch: int = N_UBATCH) -> retro.Context:
    return retro.Context(
        model, n_ctx=256, n_batch=64, n_ubatch=n_ubatch, n_threads=support.CHECK_THREADS, transactions=tx
    )


@contextlib.contextmanager
def _tx_context(
    model: retro.Model, profile: Profile, selectors: list[Selector], handler=None, **kwargs
) -> Iterator[retro.Context]:
    n_ubatch = kwargs.pop("n_ubatch", N_UBATCH)
    with _context(model, TensorTransactions(profile, selectors, handler, **kwargs), n_ubatch=n_ubatch) as ctx:
        yield ctx


def _plain_state(model: retro.Model, tokens: list[int]) -> bytes:
    """llama.cpp's sequence state after a decode without transactions: what an untouched graph computes."""
    with _context(model) as ctx:
        ctx.decode(tokens)
        return ctx.sequence_state()


def _raise_at(k: int, exc: Callable[[], BaseException] = lambda: ValueError("handler failed")):
    """A handler that logs its calls and raises at call k (0-based)."""
    calls: list[Transaction] = []

    def handler(t: Transaction) -> None:
        calls.append(t)
        if len(calls) == k + 1:
            raise exc()

    return handler, calls


def _decode_ok(clause: str, ctx: retro.Context, tokens: list[int]) -> None:
    """Decode, bound to `clause`: a failed transaction is a failed assertion of that clause."""
    with bound(clause):
        try:
            ctx.decode(tokens)
        except retro.DecodeError as err:
            pytest.fail(f"the decode failed: {err}")


def _foreign(profile: Profile, name: str, **changes) -> Profile:
    """The profile with one node's record changed, as a stale or foreign profile would present it."""
    nodes = dict(profile.nodes)
    nodes[name] = dataclasses.replace(nodes[name], **changes)
    return dataclasses.replace(profile, nodes=nodes)


def _rows(captures, name: str) -> tuple[np.ndarray, np.ndarray]:
    picked = [c for c in captures if c.name == name]
    return np.concatenate([c.positions for c in picked]), np.concatenate([c.data for c in picked])


# -- ownership and lifetime ------------------------------------------------------------------------


@pytest.mark.clause("TX-OWN-01", "TX-OWN-02")
def test_llama_calls_back_the_state_the_context_owns(backend, loaded):
    """The state is built at its address before the context exists; llama.cpp holds that address
    as its eval-callback user data (read back from llama.cpp); the context owns the state at that
    same address, and what the callback records is what the context reports."""
    model, profile = loaded
    tx = TensorTransactions(profile, [profile.select("l_out-0", retain=True)])
    before = tx.address
    with _context(model, tx) as ctx:
        installed = ctx._h.eval_callback_user_data
        expect("TX-OWN-01", installed == before, f"llama.cpp holds {installed:#x}, the state was at {before:#x}")
        owned = ctx._h.transactions_address
        expect("TX-OWN-02", owned == installed, f"the context owns {owned:#x}, llama.cpp calls {installed:#x}")
        ctx.decode(TOKENS)
        positions, _ = _rows(ctx.drain_captures(), "l_out-0")
        expect("TX-OWN-02", positions.tolist() == list(range(len(TOKENS))), "the context saw no capture of its decode")


_CHILD = textwrap.dedent(
    """
    import gc, os, sys, threading, time
    import retro, retro._native as native
    from retro.conformance import backends, support
    from retro.transactions import Profile, TensorTransactions

    mode, path, backend_name, defects = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    for defect in filter(None, defects.split(",")):  # the seeded defect the parent runs under
        native.hooks.set_defect(defect, True)
    backend = backends.discover()[backend_name]

    in_handler = threading.Event()

    class Handler:
        def __call__(self, t):
            in_handler.set()
            time.sleep(0.01)
        def __del__(self, write=os.write, logs=native.drain_logs):
            # llama.cpp's destructor logs from ~llama_context; the state is released after it
            freed = any("~llama_context" in line for _, line in logs())
            write(1, b"native-context-freed-first\\n" if freed else b"state-freed-first\\n")

    model = support.load(backend, __import__("pathlib").Path(path), trainable=False)
    profile = Profile.record(model)
    ctx = retro.Context(model, n_ctx=256, n_batch=64, n_ubatch=4, n_threads=1,
                        transactions=TensorTransactions(profile, [profile.select("l_out-0")], Handler()))
    ctx.decode(list(range(3, 13)))
    native.drain_logs()
    if mode == "close":
        ctx.close()
    elif mode == "gc":
        ctx.cycle = ctx  # only the cycle collector can free it
        del ctx
        gc.collect()
    elif mode == "mid-use":  # the interpreter exits while another thread is decoding
        def decode_forever():
            while True:
                try:
                    ctx.reset()
                    ctx.decode(list(range(3, 13)))
                except retro.RetroError:
                    return
        in_handler.clear()
        threading.Thread(target=decode_forever, daemon=True).start()
        in_handler.wait()
    # "exit" and "mid-use": left to interpreter shutdown
    """
)


@pytest.mark.clause("TX-OWN-03")
def test_the_native_context_is_freed_before_the_callback_state(backend, model_path):
    """In a child interpreter under -X dev, the handler's finalizer (run when the callback state
    lets it go) looks for llama.cpp's own destructor lines: closed, collected as garbage, left to
    interpreter shutdown, and left there while another thread is inside a decode, the native
    context is always freed first, and the child exits cleanly."""
    env = dict(os.environ)
    defects = ",".join(d for d in _native.hooks.defects() if _native.hooks.defect_on(d))
    # -S as this interpreter has it (a site view of a separate build), so the child imports this retro
    python = [sys.executable, *(["-S"] if sys.flags.no_site else [])]
    for mode in ("close", "gc", "exit", "mid-use"):
        run = subprocess.run(
            [*python, "-X", "dev", "-c", _CHILD, mode, str(model_path), backend.name, defects],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        crashed = [m for m in ("Fatal Python error", "terminate called", "ptrace", "Aborted") if m in run.stderr]
        expect("TX-OWN-03", run.returncode == 0 and not crashed, f"{mode}: exit {run.returncode}: {run.stderr[-600:]}")
        expect(
            "TX-OWN-03",
            run.stdout.strip().splitlines() == ["native-context-freed-first"],
            f"{mode}: {run.stdout.strip() or 'the handler was never released'}",
        )


@pytest.mark.clause("TX-OWN-04")
def test_a_handler_belongs_to_one_context_and_runs_inside_its_decodes(backend, loaded):
    """A second context cannot take the same transactions (and the first is unharmed); the
    handler runs on the decoding thread while the decode is in progress; two threads decoding one
    context are served one after the other, never at once; a handler calling into its own
    context is refused."""
    model, profile = loaded
    spans: list[tuple[float, float, int]] = []
    inside = threading.local()

    def handler(t: Transaction) -> None:
        start = time.monotonic()
        expect("TX-OWN-04", getattr(inside, "decoding", False), "the handler ran outside its decode call")
        time.sleep(0.01)
        spans.append((start, time.monotonic(), threading.get_ident()))

    tx = TensorTransactions(profile, [profile.select("l_out-0")], handler)
    with _context(model, tx) as ctx:
        with bound("TX-OWN-04"), pytest.raises(retro.InvalidStateError):
            _context(model, tx).close()
        expect("TX-OWN-04", tx.taken, "the transactions were released")

        def decode_three() -> None:
            inside.decoding = True
            for _ in range(3):
                ctx.reset()
                ctx.decode(TOKENS[:4])
            inside.decoding = False

        threads = [threading.Thread(target=decode_three) for _ in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        spans.sort()
        overlaps = [(a, b) for a, b in itertools.pairwise(spans) if b[0] < a[1]]
        expect("TX-OWN-04", len(spans) == 6 and not overlaps, f"{len(spans)} calls, overlapping: {overlaps[:2]}")
        expect("TX-OWN-04", len({s[2] for s in spans}) == 2, "the handler did not run on the decoding threads")

    def reenter(t: Transaction) -> None:
        own.decode([1])

    with _tx_context(model, profile, [profile.select("l_out-0")], reenter) as own:
        with pytest.raises(retro.TensorCallbackError) as err:
            own.decode(TOKENS[:4])
        expect(
            "TX-OWN-04",
            err.value.failure.type == "retro.errors.InvalidStateError",
            f"a handler calling its own context: {err.value.failure}",
        )


def _covered(captures, name: str) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for c in captures:
        if c.name == name:
            out.setdefault(c.decode, []).extend(c.positions.tolist())
    return out


@pytest.mark.clause("TX-OWN-05")
def test_the_hooks_bracket_every_internal_decode(backend, loaded, tmp_path, seed):
    """A generation (one decode per token) and a speculative generation (a draft model proposes,
    the target checks in one decode) make their decodes inside one call: each of the target's
    decodes is bracketed, so every position the target's KV cache holds was captured by a
    committed decode, and there are as many committed decodes as llama_decode calls."""
    model, profile = loaded
    sel = [profile.select("attn_norm-0", retain=True)]
    with _tx_context(model, profile, sel) as ctx:
        g = ctx.generate(TOKENS[:3], 6, stop_at_eog=False)
        covered = _covered(ctx.drain_captures(), "attn_norm-0")
        held = ctx.sequence_length
        expect("TX-OWN-05", len(covered) == g.decodes, f"{len(covered)} committed decodes of {g.decodes}")
        positions = sorted(p for ps in covered.values() for p in ps)
        expect("TX-OWN-05", positions == list(range(held)), f"captured positions {positions}, cache holds {held}")
    draft_path = support.model_file(tmp_path, seed, draft_noise=DRAFT_NOISE)
    with support.load(backend, draft_path, trainable=False) as draft_model, _context(draft_model) as draft:
        with _tx_context(model, profile, sel) as ctx:
            g = ctx.generate(TOKENS[:3], 12, stop_at_eog=False, draft=draft, n_draft=3)
            covered = _covered(ctx.drain_captures(), "attn_norm-0")
            expect("TX-OWN-05", 0 < g.accepted < g.drafted, f"{g.accepted} of {g.drafted} drafted tokens kept")
            expect("TX-OWN-05", len(covered) == g.decodes, f"{len(covered)} committed decodes of {g.decodes}")
            seen = {p for ps in covered.values() for p in ps}
            missing = sorted(set(range(ctx.sequence_length)) - seen)
            expect("TX-OWN-05", not missing, f"positions decoded outside a transaction: {missing}")
        with _context(model) as plain:
            expect(
                "TX-OWN-05",
                plain.generate(TOKENS[:3], 12, stop_at_eog=False).tokens == g.tokens,
                "speculative generation gave other tokens than greedy generation",
            )


@pytest.mark.clause("TX-OWN-06")
def test_no_python_object_outlives_its_handler_call(backend, loaded):
    """After a handler raised, neither its exception object, nor anything its frames held, nor
    the error raised to the caller keeps them: all are collectable. The array a handler kept is
    its own: writing to it after the decode changes nothing the context computes."""
    model, profile = loaded

    class Boom(Exception):
        pass

    class Local:
        pass

    refs: list[weakref.ref] = []
    kept: list[np.ndarray] = []

    def handler(t: Transaction) -> None:
        local = Local()
        boom = Boom("raised by the handler")
        refs.extend([weakref.ref(local), weakref.ref(boom)])
        raise boom

    with _tx_context(model, profile, [profile.select("l_out-0")], handler) as ctx:
        with pytest.raises(retro.TensorCallbackError) as err:
            ctx.decode(TOKENS)
        expect("TX-OWN-06", err.value.__cause__ is None, "the handler's exception is chained to the error")
        del err
    gc.collect()
    expect("TX-OWN-06", all(r() is None for r in refs), "the handler's exception or frame objects are still alive")

    def keep(t: Transaction) -> None:
        kept.append(t.data)

    with _tx_context(model, profile, [profile.select("l_out-0", retain=True, access="mutable-f32")], keep) as ctx:
        ctx.decode(TOKENS[:4])
        first = ctx.drain_captures()[0].data.copy()
        kept[0][:] = 1e6  # after the decode returned
        ctx.reset()
        ctx.decode(TOKENS[:4])
        again = ctx.drain_captures()[0].data
        expect("TX-OWN-06", np.array_equal(first, again), "a handler's kept array reached the context afterwards")
        expect("TX-OWN-06", kept[0].base is None and kept[0].flags.owndata, "the handler's array is a view")


# -- native tensor access --------------------------------------------------------------------------


@pytest.mark.clause("TX-ACC-01", "TX-ACC-08")
def test_the_handler_sees_the_complete_computed_tensor(backend, loaded):
    """The copy of result_output the handler gets, micro-batch by micro-batch, is the complete
    tensor llama.cpp computed: row for row the logits the decode returns."""
    model, profile = loaded
    seen: list[np.ndarray] = []
    with _tx_context(model, profile, [profile.select("result_output")], lambda t: seen.append(t.data)) as ctx:
        logits = ctx.decode(TOKENS)
    got = np.concatenate(seen) if seen else np.zeros((0, model.n_vocab), np.float32)
    with bound("TX-ACC-01"):
        assert got.shape == logits.shape, f"{got.shape} rows seen for logits {logits.shape}"
        assert np.array_equal(got[:, :1], logits[:, :1]), "the node was read before it was computed"
    with bound("TX-ACC-08"):
        np.testing.assert_array_equal(got, logits, err_msg="the copy is not the whole tensor")
        assert all(a.flags.owndata for a in seen), "the handler got a view, not an owned copy"


@pytest.mark.clause("TX-ACC-02")
def test_a_selector_names_one_node_exactly(backend, tmp_path, seed):
    """On an 11-layer model, l_out-1 selects l_out-1 alone (not l_out-10): one copy per
    micro-batch, all of that name. A name that is only a prefix, or that names several nodes
    (Qcur-0), cannot be selected."""
    path = support.model_file(tmp_path, seed, n_layer=11)
    with support.load(backend, path, trainable=False) as model:
        profile = Profile.record(model)
        names: list[str] = []
        with _tx_context(model, profile, [profile.select("l_out-1")], lambda t: names.append(t.name)) as ctx:
            _decode_ok("TX-ACC-02", ctx, TOKENS)
            expect("TX-ACC-02", names == ["l_out-1"] * 3, f"the handler saw {names}")
        for name in ("l_out", "l_out-", "Qcur-0"):
            with bound("TX-ACC-02"), pytest.raises(ProfileError):
                profile.select(name)


def _fails_closed(ctx: retro.Context, calls: list, tokens: list[int] = TOKENS) -> str:
    """Decode: it must fail on the layout, without the handler ever seeing the node."""
    with pytest.raises(retro.TensorCallbackError) as err:
        ctx.decode(tokens)
    assert err.value.failure.kind == "layout", f"failed as {err.value.failure}"
    assert not calls, f"the handler saw {len(calls)} mismatched copies"
    return err.value.failure.message


@pytest.mark.clause("TX-ACC-03")
def test_the_element_type_is_exact(backend, loaded):
    """A profile that records l_out-0 as i32 (same element size as its real f32): the data phase
    refuses the node after decode, nothing reinterpreted; f16 against f32 is refused as well."""
    model, profile = loaded
    foreign = _foreign(profile, "l_out-0", dtype="i32")
    calls: list = []
    with _tx_context(model, foreign, [foreign.select("l_out-0")], calls.append) as ctx, bound("TX-ACC-03"):
        assert "type" in _fails_closed(ctx, calls)
    spec = profile.select("l_out-0")._spec()
    with bound("TX-ACC-03"):
        failure = _native.tx_verify("l_out-0", 1, (64, 4, 1, 1), True, spec, 4)  # GGML_TYPE_F16
        assert isinstance(failure, tuple) and "type" in failure[3], f"f16 accepted: {failure}"


@pytest.mark.clause("TX-ACC-04")
def test_the_layout_is_two_dimensional_contiguous_and_not_empty(backend, loaded):
    """Qcur-0 (view) is [16, heads, tokens]: with 4 tokens and 4 heads its first two dimensions
    look like 4 rows of 16, and a profile claiming so must still be refused; so must a
    non-contiguous and an empty node (the data phase's checks given that metadata)."""
    model, profile = loaded
    node = profile.nodes["Qcur-0 (view)"]
    foreign = _foreign(profile, node.name, shape=(node.shape[0], 3, 1, 1), rows="tokens")
    calls: list = []
    with _tx_context(model, foreign, [foreign.select(node.name)], calls.append) as ctx, bound("TX-ACC-04"):
        assert "two-dimensional" in _fails_closed(ctx, calls, TOKENS[:4])
    spec = profile.select("l_out-0")._spec()
    for ne, contiguous, rows in (((64, 4, 1, 1), False, 4), ((64, 0, 1, 1), True, 1), ((64, 2, 2, 1), True, 2)):
        with bound("TX-ACC-04"):
            failure = _native.tx_verify("l_out-0", 0, ne, contiguous, spec, rows)
            assert isinstance(failure, tuple), f"{ne} (contiguous {contiguous}) accepted"


@pytest.mark.clause("TX-ACC-05")
def test_row_width_is_exact_and_the_row_bound_inclusive(backend, loaded):
    """Micro-batches of 4, 4 and 2 rows pass a bound of 4 (inclusive) and fail one of 3; a
    profile recording another row width fails closed."""
    model, profile = loaded
    calls: list = []
    with _tx_context(model, profile, [profile.select("l_out-0", max_rows=4)], calls.append) as ctx:
        _decode_ok("TX-ACC-05", ctx, TOKENS)
        expect("TX-ACC-05", [t.data.shape[0] for t in calls] == [4, 4, 2], "rows at the bound were refused")
    calls.clear()
    with _tx_context(model, profile, [profile.select("l_out-0", max_rows=3)], calls.append) as ctx, bound("TX-ACC-05"):
        assert "rows" in _fails_closed(ctx, calls)
    node = profile.nodes["l_out-0"]
    wider = _foreign(profile, "l_out-0", shape=(node.shape[0] * 2, *node.shape[1:]))
    with _tx_context(model, wider, [wider.select("l_out-0")], calls.append) as ctx, bound("TX-ACC-05"):
        assert "elements per row" in _fails_closed(ctx, calls)


@pytest.mark.clause("TX-ACC-06")
def test_element_and_byte_counts_are_overflow_checked(backend):
    """The data phase's checks given node metadata whose element or byte count overflows 64 bits
    report the overflow; the largest node a selector admits gets its exact byte count."""
    from retro.transactions import MAX_ROW_ELEMENTS, MAX_ROWS

    spec = ("big", 0, MAX_ROW_ELEMENTS, MAX_ROWS, 0, False, 0, 0, 0)
    for ne in (
        (MAX_ROW_ELEMENTS, MAX_ROWS, 1 << 20, 1 << 20),
        (MAX_ROW_ELEMENTS, MAX_ROWS, 1 << 21, 1),
        (1 << 62, 2, 1, 1),
    ):
        failure = _native.tx_verify("big", 0, ne, True, spec, MAX_ROWS)
        expect("TX-ACC-06", isinstance(failure, tuple) and "overflow" in failure[3], f"{ne}: {failure}")
    fits = _native.tx_verify("big", 0, (MAX_ROW_ELEMENTS, MAX_ROWS, 1, 1), True, spec, MAX_ROWS)
    expect("TX-ACC-06", fits == MAX_ROW_ELEMENTS * MAX_ROWS * 4, f"the largest node: {fits}")


@pytest.mark.clause("TX-ACC-07")
def test_rows_are_the_logical_rows_of_the_submitted_batch(backend, loaded):
    """Decoded in micro-batches of 4, 4 and 2, each copy starts at its micro-batch's first
    logical row and carries its positions, and together they equal one 16-token micro-batch's
    copy; an output node's rows are the outputs (a generation's prompt: its last token only)."""
    model, profile = loaded
    calls: list[Transaction] = []
    with _tx_context(model, profile, [profile.select("attn_norm-0", retain=True)], calls.append) as ctx:
        ctx.decode(TOKENS)
        positions, split = _rows(ctx.drain_captures(), "attn_norm-0")
    expect("TX-ACC-07", [(t.first_row, t.data.shape[0]) for t in calls] == SPLIT, "micro-batch rows")
    expect("TX-ACC-07", positions.tolist() == list(range(len(TOKENS))), f"positions {positions.tolist()}")
    with _tx_context(model, profile, [profile.select("attn_norm-0", retain=True)], n_ubatch=16) as ctx:
        ctx.decode(TOKENS)
        _, whole = _rows(ctx.drain_captures(), "attn_norm-0")
    with bound("TX-ACC-07"):
        np.testing.assert_allclose(split, whole, rtol=1e-5, atol=1e-6, err_msg="rows out of place")
    with _tx_context(model, profile, [profile.select("result_norm", retain=True)]) as ctx:
        ctx.generate(TOKENS[:6], 1)
        positions, _ = _rows(ctx.drain_captures(), "result_norm")
    expect("TX-ACC-07", positions.tolist() == [5], f"output rows at {positions.tolist()}")


def _steer(vector: np.ndarray, *, poison_last: bool = False, then_raise: bool = False):
    def handler(t: Transaction) -> None:
        t.data += vector
        if poison_last:
            t.data[-1, -1] = np.nan
        if then_raise:
            raise RuntimeError("after editing")

    return handler


@pytest.mark.clause("TX-ACC-09")
def test_a_mutable_copy_is_written_back_once_when_finite(backend, loaded, seed):
    """Adding a steering vector to result_norm changes the logits to exactly what numpy computes
    from the unsteered result_norm and the output weights (added once); a copy with one NaN,
    anywhere, is not written: llama.cpp's sequence state is the untouched decode's."""
    model, profile = loaded
    v = np.random.default_rng(seed).normal(0, 0.5, model.n_embd).astype(np.float32)
    with _tx_context(model, profile, [profile.select("result_norm", retain=True)]) as ctx:
        ctx.decode(TOKENS)
        _, norm = _rows(ctx.drain_captures(), "result_norm")
    with _tx_context(model, profile, [profile.select("result_norm", access="mutable-f32")], _steer(v)) as ctx:
        steered = ctx.decode(TOKENS)
    reference = (norm.astype(np.float64) + v) @ model.tensor("output.weight").astype(np.float64).T
    with bound("TX-ACC-09"):
        np.testing.assert_allclose(steered, reference, rtol=1e-4, atol=1e-4, err_msg="steered logits")
    untouched = _plain_state(model, TOKENS)
    sel = [profile.select("attn_norm-0", access="mutable-f32")]
    with _tx_context(model, profile, sel, _steer(v, poison_last=True)) as ctx:
        with bound("TX-ACC-09"), pytest.raises(retro.TensorCallbackError):
            ctx.decode(TOKENS)
        failure = ctx.transaction_failure
        expect("TX-ACC-09", failure is not None and failure.kind == "non-finite", f"failed as {failure}")
        expect("TX-ACC-09", ctx.sequence_state() == untouched, "a copy holding a NaN was written back")


@pytest.mark.clause("TX-ACC-10")
def test_a_failed_transaction_writes_nothing_back(backend, loaded, seed):
    """A handler that edits its copy and then raises, and one whose last row holds a NaN, leave
    the node as computed: llama.cpp's sequence state equals the untouched decode's."""
    model, profile = loaded
    v = np.full(model.n_embd, 0.25, np.float32)
    untouched = _plain_state(model, TOKENS)
    for how in ({"then_raise": True}, {"poison_last": True}):
        sel = [profile.select("attn_norm-0", access="mutable-f32")]
        with _tx_context(model, profile, sel, _steer(v, **how)) as ctx:
            with pytest.raises(retro.TensorCallbackError):
                ctx.decode(TOKENS)
            expect("TX-ACC-10", ctx.sequence_state() == untouched, f"{how}: part of the copy was written back")


# -- retained captures -----------------------------------------------------------------------------


@pytest.mark.clause("TX-RET-01")
def test_captures_are_staged_per_decode(backend, loaded):
    """A generation of 5 tokens commits each of its decodes' rows once: the captured rows are
    exactly the tokens decoded, grouped by decode, in order."""
    model, profile = loaded
    with _tx_context(model, profile, [profile.select("l_out-0", retain=True)]) as ctx:
        g = ctx.generate(TOKENS[:3], 5, stop_at_eog=False)
        covered = _covered(ctx.drain_captures(), "l_out-0")
    expected = {d: [p] for d, p in zip(range(1, g.decodes), range(3, 3 + g.decodes - 1), strict=True)}
    expected[0] = [0, 1, 2]
    expect("TX-RET-01", covered == expected, f"captures per decode {covered}, expected {expected}")


@pytest.mark.clause("TX-RET-02", "TX-PROF-02")
def test_a_graph_that_does_not_match_the_profile_fails_closed(backend, loaded, tmp_path, seed):
    """Selectors bound to a profile of a 3-layer model of the same architecture, used on the
    2-layer model: l_out-2 is never computed, so the decode fails after it ran (coverage), the
    handler never saw a mismatched node, and no capture of that decode is committed. A profile
    of a wider model fails closed on the row width."""
    model, _ = loaded
    with support.load(backend, support.model_file(tmp_path, seed, n_layer=3), trainable=False) as deeper:
        three = Profile.record(deeper)
    with support.load(backend, support.model_file(tmp_path, seed, n_embd=128), trainable=False) as wider:
        wide = Profile.record(wider)
    sel = [three.select("l_out-0", retain=True), three.select("l_out-2", retain=True)]
    with _tx_context(model, three, sel) as ctx:
        with bound("TX-PROF-02"), pytest.raises(retro.TensorCallbackError) as err:
            ctx.decode(TOKENS)
        expect("TX-PROF-02", err.value.failure.kind == "coverage", f"failed as {err.value.failure}")
        expect("TX-RET-02", ctx.drain_captures() == [], "a decode that failed its coverage committed captures")
    calls: list = []
    with _tx_context(model, wide, [wide.select("l_out-0")], calls.append) as ctx, bound("TX-PROF-02"):
        assert "elements per row" in _fails_closed(ctx, calls)


@pytest.mark.clause("TX-RET-03")
def test_a_failed_internal_decode_discards_only_its_own_staging(backend, loaded):
    """A generation whose handler raises in its 4th decode: the error carries the tokens made
    before, and the captures of the 3 decodes before it stay committed, complete; none of the
    failed decode's."""
    model, profile = loaded

    def handler(t: Transaction) -> None:
        if t.decode == 3:
            raise ValueError("fourth decode")

    with _tx_context(model, profile, [profile.select("l_out-0", retain=True, access="mutable-f32")], handler) as ctx:
        with pytest.raises(retro.TensorCallbackError) as err:
            ctx.generate(TOKENS[:3], 6, stop_at_eog=False)
        covered = _covered(ctx.drain_captures(), "l_out-0")
    expect("TX-RET-03", len(err.value.tokens) == 3, f"tokens before the failure: {err.value.tokens}")
    expect("TX-RET-03", covered == {0: [0, 1, 2], 1: [3], 2: [4]}, f"committed: {covered}")


@pytest.mark.clause("TX-RET-04")
def test_undrained_captures_stay_within_their_byte_limit(backend, loaded):
    """With room for two 4-token decodes of l_out-0, a third is refused before it runs (nothing
    decoded, nothing lost); draining frees the room."""
    model, profile = loaded
    limit = 2 * 4 * model.n_embd * 4
    sel = [profile.select("l_out-0", retain=True, max_rows=4)]
    with _tx_context(model, profile, sel, retained_limit=limit) as ctx:
        ctx.decode(TOKENS[:4])
        ctx.decode(TOKENS[4:8])
        with bound("TX-RET-04"), pytest.raises(retro.CaptureLimitError):
            ctx.decode(TOKENS[8:])
        expect("TX-RET-04", ctx.sequence_length == 8, f"the refused decode ran: {ctx.sequence_length} positions")
        held = ctx.drain_captures()
        expect("TX-RET-04", sum(c.data.nbytes for c in held) <= limit, "the undrained captures exceeded the limit")
        expect("TX-RET-04", [c.positions.tolist() for c in held] == [[0, 1, 2, 3], [4, 5, 6, 7]], "captures lost")
        ctx.decode(TOKENS[8:])
        expect("TX-RET-04", len(ctx.drain_captures()) == 1, "drained room was not given back")


# -- failure containment ---------------------------------------------------------------------------


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("str() raises")


class _Custom(BaseException):
    pass


_RAISED: list[tuple[str, Callable[[], BaseException]]] = [
    ("builtins.ValueError", lambda: ValueError("plain")),
    ("builtins.KeyboardInterrupt", KeyboardInterrupt),
    ("builtins.SystemExit", lambda: SystemExit(3)),
    (f"{__name__}._Custom", lambda: _Custom("a BaseException")),
    (f"{__name__}._Unprintable", _Unprintable),
    ("builtins.MemoryError", lambda: MemoryError("x" * (1 << 20))),
]


@pytest.mark.clause("TX-FAIL-01")
def test_every_exception_becomes_a_bounded_typed_failure(backend, loaded):
    """Ordinary exceptions, KeyboardInterrupt, SystemExit, a BaseException subclass, one whose
    str() raises and one with a 1 MiB message: each is contained and reported by type, with a
    bounded message and a traceback that names the handler; the interpreter goes on."""
    model, profile = loaded
    for type_name, make in _RAISED:

        def handler(t: Transaction, make=make) -> None:
            raise make()

        with _tx_context(model, profile, [profile.select("l_out-0")], handler) as ctx:
            with bound("TX-FAIL-01"), pytest.raises(retro.TensorCallbackError) as err:
                ctx.decode(TOKENS)
            f = err.value.failure
            expect("TX-FAIL-01", f.type == type_name, f"{type_name} reported as {f.type}")
            expect("TX-FAIL-01", len(f.message) <= 4200, f"{type_name}: a message of {len(f.message)} characters")
            expect("TX-FAIL-01", "handler" in f.traceback, f"{type_name}: the traceback lost the handler")


@pytest.mark.clause("TX-FAIL-02", "TX-FAIL-03", "TX-FAIL-05")
def test_after_a_failure_the_graph_runs_to_the_end_without_the_handler(backend, loaded):
    """The handler raises in the first of 3 micro-batches, at the first of two selected nodes:
    it is never called again, yet every node of every micro-batch was computed (llama.cpp's
    sequence state equals an untouched decode's) and the tokens stay in the cache."""
    model, profile = loaded
    untouched = _plain_state(model, TOKENS)
    handler, calls = _raise_at(0)
    sel = [profile.select("attn_norm-0"), profile.select("l_out-1")]
    with _tx_context(model, profile, sel, handler) as ctx:
        with pytest.raises(retro.TensorCallbackError):
            ctx.decode(TOKENS)
        expect("TX-FAIL-03", len(calls) == 1, f"the handler was called {len(calls)} times")
        expect("TX-FAIL-02", ctx.sequence_state() == untouched, "the rest of the graph was not computed")
        expect("TX-FAIL-05", ctx.sequence_length == len(TOKENS), f"{ctx.sequence_length} positions after the failure")
        expect("TX-FAIL-05", ctx.n_past == len(TOKENS), f"n_past {ctx.n_past} after the failure")


@pytest.mark.clause("TX-FAIL-04", "TX-FAIL-06")
def test_the_first_failure_is_reported_and_sticks(backend, loaded):
    """A decode and a generation whose handler raised report TensorCallbackError describing it;
    every later decode is refused with that first failure, without running or calling the
    handler."""
    model, profile = loaded
    handler, calls = _raise_at(0, lambda: ValueError("the first failure"))
    with _tx_context(model, profile, [profile.select("l_out-0")], handler) as ctx:
        with bound("TX-FAIL-04"), pytest.raises(retro.DecodeError) as err:
            ctx.decode(TOKENS)
        expect("TX-FAIL-04", isinstance(err.value, retro.TensorCallbackError), f"reported as {err.value!r}")
        expect("TX-FAIL-04", "the first failure" in str(err.value), f"reported as {err.value}")
        for _ in range(2):
            with bound("TX-FAIL-06"), pytest.raises(retro.TensorCallbackError) as again:
                ctx.decode([1])
            expect("TX-FAIL-06", "the first failure" in str(again.value), f"then {again.value}")
        expect("TX-FAIL-06", len(calls) == 1, f"the handler ran {len(calls)} times")
        expect("TX-FAIL-06", ctx.sequence_length == len(TOKENS), "a refused decode ran")
    handler, calls = _raise_at(2, lambda: ValueError("in a generation"))
    with _tx_context(model, profile, [profile.select("l_out-0")], handler) as ctx:
        with bound("TX-FAIL-04"), pytest.raises(retro.DecodeError) as err:
            ctx.generate(TOKENS[:3], 6, stop_at_eog=False)
        expect("TX-FAIL-04", isinstance(err.value, retro.TensorCallbackError), f"reported as {err.value!r}")
        expect("TX-FAIL-04", "in a generation" in str(err.value), f"reported {err.value}")
        expect("TX-FAIL-06", len(calls) == 3, f"the handler ran {len(calls)} times in the generation")


# -- profiles --------------------------------------------------------------------------------------


@pytest.mark.clause("TX-PROF-01")
def test_selectors_are_bound_to_a_profile_validated_for_the_model(backend, loaded, tmp_path):
    """Selectors come only from a profile; a profile saved and loaded is accepted for its model;
    one recorded for another pin, architecture or backend is refused before anything native
    changes."""
    model, profile = loaded
    with bound("TX-PROF-01"), pytest.raises(TypeError):
        Selector("l_out-0", "f32", 64, 8, "read-only", True, "tokens", profile)
    other = dataclasses.replace(profile)
    with bound("TX-PROF-01"), pytest.raises(ProfileError):
        TensorTransactions(profile, [other.select("l_out-0", retain=True)])
    loaded_back = Profile.load(profile.save(tmp_path / "profile.json"))
    with _tx_context(model, loaded_back, [loaded_back.select("l_out-0", retain=True)]) as ctx:
        ctx.decode(TOKENS[:4])
    elsewhere = ("Vulkan0",) if profile.backend != ("Vulkan0",) else ("CPU",)
    for field, value in (("pin", "0000000"), ("architecture", "gpt2"), ("backend", elsewhere)):
        foreign = dataclasses.replace(profile, **{field: value})
        tx = TensorTransactions(foreign, [foreign.select("l_out-0", retain=True)])
        with bound("TX-PROF-01"), pytest.raises(ProfileError):
            _context(model, tx).close()
        expect("TX-PROF-01", not tx.taken, f"a profile of another {field} reached native state")


@pytest.mark.clause("TX-PROF-03")
def test_the_borrowing_capture_is_only_made_unsafely(backend, loaded):
    """TensorCapture's constructor refuses; TensorCapture.unsafe_borrow writes the node's rows
    into the caller's array, which equals the retained capture of the same node."""
    model, profile = loaded
    out = np.zeros((4, model.n_embd), np.float32)
    with bound("TX-PROF-03"), pytest.raises(TypeError, match="unsafe_borrow"):
        TensorCapture(profile.select("attn_norm-0"), out)
    capture = TensorCapture.unsafe_borrow(profile.select("attn_norm-0"), out)
    tx = TensorTransactions(profile, [profile.select("l_out-0", retain=True)], captures=[capture])
    with _context(model, tx) as ctx:
        ctx.decode(TOKENS[:4])
    with _tx_context(model, profile, [profile.select("attn_norm-0", retain=True)]) as ctx:
        ctx.decode(TOKENS[:4])
        _, expected = _rows(ctx.drain_captures(), "attn_norm-0")
    expect("TX-PROF-03", np.array_equal(out, expected), "the borrowed capture did not write the rows")


# -- HARNESS-04: an exception at every handler invocation ------------------------------------------


@pytest.mark.clause("HARNESS-04")
def test_a_handler_exception_at_every_invocation_is_contained(backend, loaded, tmp_path, seed):
    """A 3-micro-batch decode with two selected nodes, and a speculative generation whose target
    and draft both have handlers: the handler raises at each of their invocations in turn. Every
    time: TensorCallbackError naming that invocation, no further call, the tokens of the failed
    decode kept, and the captures of earlier decodes committed."""
    model, profile = loaded
    sel = [profile.select("attn_norm-0", retain=True, access="mutable-f32"), profile.select("result_norm")]
    clean, calls = _raise_at(-1)
    with _tx_context(model, profile, sel, clean) as ctx:
        ctx.decode(TOKENS)
    for k in range(len(calls)):
        handler, seen = _raise_at(k, functools.partial(ValueError, f"invocation {k}"))
        with _tx_context(model, profile, sel, handler) as ctx:
            with bound("HARNESS-04"), pytest.raises(retro.TensorCallbackError) as err:
                ctx.decode(TOKENS)
            expect("HARNESS-04", err.value.failure.message == f"invocation {k}", f"at {k}: {err.value.failure}")
            expect(
                "HARNESS-04", len(seen) == k + 1 and ctx.sequence_length == len(TOKENS), f"at {k}: {len(seen)} calls"
            )

    with support.load(
        backend, support.model_file(tmp_path, seed, draft_noise=DRAFT_NOISE), trainable=False
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
            with _context(model, target_tx) as target, _context(draft_model, draft_tx) as draft:
                try:
                    target.generate(TOKENS[:3], 16, stop_at_eog=False, draft=draft, n_draft=3)
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
