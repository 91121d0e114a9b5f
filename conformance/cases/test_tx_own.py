"""Tensor transactions (seed 004), TX-OWN: ownership and lifetime: the state llama.cpp calls back is
the one the context owns, freed in order, bracketing every internal decode. Each is observed from
outside the binding: llama.cpp's own record of the callback's user data and its destructor, the
sequence state llama.cpp serializes, the logits it returns, numpy references, and the handler's own
log. Shared helpers: _transactions.py."""

from __future__ import annotations

import gc
import itertools
import os
import subprocess
import sys
import threading
import time
import weakref

import numpy as np
import pytest

import retro
from retro import _native
from retro.conformance import support
from retro.conformance.cases._transactions import (
    CHILD_SCRIPT,
    DRAFT_NOISE,
    TOKENS,
    committed_positions,
    plain_context,
    rows_of,
    tx_context,
)
from retro.conformance.evidence import bound, expect
from retro.transactions import TensorTransactions, Transaction


@pytest.mark.clause("TX-OWN-01", "TX-OWN-02")
def test_llama_calls_back_the_state_the_context_owns(backend, loaded):
    """The state is built at its address before the context exists; llama.cpp holds that address
    as its eval-callback user data (read back from llama.cpp); the context owns the state at that
    same address, and what the callback records is what the context reports."""
    model, profile = loaded
    tx = TensorTransactions(profile, [profile.select("l_out-0", retain=True)])
    before = tx.address
    with plain_context(model, tx) as ctx:
        installed = ctx._h.eval_callback_user_data
        expect("TX-OWN-01", installed == before, f"llama.cpp holds {installed:#x}, the state was at {before:#x}")
        owned = ctx._h.transactions_address
        expect("TX-OWN-02", owned == installed, f"the context owns {owned:#x}, llama.cpp calls {installed:#x}")
        ctx.decode(TOKENS)
        positions, _ = rows_of(ctx.drain_captures(), "l_out-0")
        expect("TX-OWN-02", positions.tolist() == list(range(len(TOKENS))), "the context saw no capture of its decode")


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
            [*python, "-X", "dev", "-c", CHILD_SCRIPT, mode, str(model_path), backend.name, defects],
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
    with plain_context(model, tx) as ctx:
        with bound("TX-OWN-04"), pytest.raises(retro.InvalidStateError):
            plain_context(model, tx).close()
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

    with tx_context(model, profile, [profile.select("l_out-0")], reenter) as own:
        with pytest.raises(retro.TensorCallbackError) as err:
            own.decode(TOKENS[:4])
        expect(
            "TX-OWN-04",
            err.value.failure.type == "retro.errors.InvalidStateError",
            f"a handler calling its own context: {err.value.failure}",
        )


@pytest.mark.clause("TX-OWN-05")
def test_the_hooks_bracket_every_internal_decode(backend, loaded, tmp_path, seed):
    """A generation (one decode per token) and a speculative generation (a draft model proposes,
    the target checks in one decode) make their decodes inside one call: each of the target's
    decodes is bracketed, so every position the target's KV cache holds was captured by a
    committed decode, and there are as many committed decodes as llama_decode calls."""
    model, profile = loaded
    sel = [profile.select("attn_norm-0", retain=True)]
    with tx_context(model, profile, sel) as ctx:
        g = ctx.generate(TOKENS[:3], 6, stop_at_eog=False)
        covered = committed_positions(ctx.drain_captures(), "attn_norm-0")
        held = ctx.sequence_length
        expect("TX-OWN-05", len(covered) == g.decodes, f"{len(covered)} committed decodes of {g.decodes}")
        positions = sorted(p for ps in covered.values() for p in ps)
        expect("TX-OWN-05", positions == list(range(held)), f"captured positions {positions}, cache holds {held}")
    draft_path = support.model_file(tmp_path, seed, draft_noise=DRAFT_NOISE)
    with support.load(backend, draft_path, trainable=False) as draft_model, plain_context(draft_model) as draft:
        with tx_context(model, profile, sel) as ctx:
            g = ctx.generate(TOKENS[:3], 12, stop_at_eog=False, draft=draft, n_draft=3)
            covered = committed_positions(ctx.drain_captures(), "attn_norm-0")
            expect("TX-OWN-05", 0 < g.accepted < g.drafted, f"{g.accepted} of {g.drafted} drafted tokens kept")
            expect("TX-OWN-05", len(covered) == g.decodes, f"{len(covered)} committed decodes of {g.decodes}")
            seen = {p for ps in covered.values() for p in ps}
            missing = sorted(set(range(ctx.sequence_length)) - seen)
            expect("TX-OWN-05", not missing, f"positions decoded outside a transaction: {missing}")
        with plain_context(model) as plain:
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

    with tx_context(model, profile, [profile.select("l_out-0")], handler) as ctx:
        with pytest.raises(retro.TensorCallbackError) as err:
            ctx.decode(TOKENS)
        expect("TX-OWN-06", err.value.__cause__ is None, "the handler's exception is chained to the error")
        del err
    gc.collect()
    expect("TX-OWN-06", all(r() is None for r in refs), "the handler's exception or frame objects are still alive")

    def keep(t: Transaction) -> None:
        kept.append(t.data)

    with tx_context(model, profile, [profile.select("l_out-0", retain=True, access="mutable-f32")], keep) as ctx:
        ctx.decode(TOKENS[:4])
        first = ctx.drain_captures()[0].data.copy()
        kept[0][:] = 1e6  # after the decode returned
        ctx.reset()
        ctx.decode(TOKENS[:4])
        again = ctx.drain_captures()[0].data
        expect("TX-OWN-06", np.array_equal(first, again), "a handler's kept array reached the context afterwards")
        expect("TX-OWN-06", kept[0].base is None and kept[0].flags.owndata, "the handler's array is a view")
