"""Tensor transactions (seed 004), TX-OWN: ownership and lifetime: the state llama.cpp calls back is
the one the context owns, freed in order, bracketing every internal decode. Each is observed from
outside the binding: llama.cpp's own record of the callback's user data and its destructor, the
sequence state llama.cpp serializes, the logits it returns, numpy references, and the handler's own
log. Shared helpers: _transactions.py."""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import os
import subprocess
import textwrap
import threading
import time
import weakref

import numpy as np
import pytest

import retro
import retro.rpc
from retro import _child, _native
from retro.conformance import backends, support
from retro.conformance.cases._transactions import (
    CHILD_SCRIPT,
    DRAFT_NOISE,
    child_sizes,
    committed_positions,
    decode_ok,
    decode_tokens,
    plain_context,
    rows_of,
    tx_context,
)
from retro.conformance.evidence import bound, expect, on_path, succeeds
from retro.conformance.shapes import Shape
from retro.transactions import TensorTransactions, Transaction
from retro.unsafe import TensorCapture


@pytest.mark.clause("TX-OWN-01", "TX-OWN-02")
def test_llama_calls_back_the_state_the_context_owns(backend, loaded, shape: Shape):
    """The state is built at its address before the context exists; llama.cpp holds that address
    as its eval-callback user data (read back from llama.cpp); the context owns the state at that
    same address, and what the callback records is what the context reports. The state installed is
    the complete one: its handler is called and its retention limit holds."""
    model, profile = loaded
    tokens, m = decode_tokens(shape), shape.decode_micro_batch
    tx = TensorTransactions(profile, [profile.select("l_out-0", retain=True)])
    before = tx.address
    with plain_context(model, shape, tx) as ctx:
        installed = ctx._h.eval_callback_user_data
        expect("TX-OWN-01", installed == before, f"llama.cpp holds {installed:#x}, the state was at {before:#x}")
        owned = ctx._h.transactions_address
        expect("TX-OWN-02", owned == installed, f"the context owns {owned:#x}, llama.cpp calls {installed:#x}")
        ctx.decode(tokens)
        positions, _ = rows_of(ctx.drain_captures(), "l_out-0")
        expect("TX-OWN-02", positions.tolist() == list(range(len(tokens))), "the context saw no capture of its decode")
        # the parameters' view of the state still names the address the context took it to
        expect(
            "TX-OWN-01", tx.address == installed, f"the parameters name {tx.address:#x}, llama.cpp calls {installed:#x}"
        )
    # the state is complete: the handler it was made with is the one llama.cpp's callback calls,
    # and the retention limit it was made with holds its decodes (room for one decode of a micro-batch)
    seen: list[str] = []
    sel = [profile.select("l_out-0", retain=True, max_rows=m), profile.select("attn_norm-0")]
    made = TensorTransactions(profile, sel, lambda t: seen.append(t.name), retained_limit=m * model.n_embd * 4)
    with plain_context(model, shape, made) as ctx:
        ctx.decode(tokens[:m])
        expect("TX-OWN-01", "attn_norm-0" in seen, f"the installed state's handler saw {seen}")
        with bound("TX-OWN-01"), pytest.raises(retro.CaptureLimitError):
            ctx.decode(tokens[m : 2 * m])  # a second undrained decode: past the limit the state was made with
    # a state of borrowed captures alone (no selector of its own) is installed all the same, and
    # llama.cpp's callback writes the caller's array through it
    out = np.zeros((len(tokens), model.n_embd), np.float32)
    only = TensorTransactions(profile, [], captures=[TensorCapture.unsafe_borrow(profile.select("attn_norm-0"), out)])
    with plain_context(model, shape, only) as ctx:
        installed = ctx._h.eval_callback_user_data
        expect("TX-OWN-01", installed == only.address, f"borrowed captures alone: llama.cpp holds {installed:#x}")
        ctx.decode(tokens)
    expect("TX-OWN-01", bool(np.any(out != 0)), "borrowed captures alone: the callback never wrote the array")


@pytest.mark.clause("TX-OWN-03")
def test_the_native_context_is_freed_before_the_callback_state(backend, model_path, shape: Shape):
    """In a child interpreter under -X dev, llama.cpp's own destructor line (written to stdout as it
    is logged, by the native log mirror) comes before the line the handler's finalizer writes when
    the callback state lets it go, whichever thread drains the log queue: closed, collected as
    garbage, left to interpreter shutdown, left there while another thread is inside a decode, and
    left there while another thread waits inside a native call that no close ends (an RPC handshake
    with a peer that never answers: once returning within exit's wait, once outlasting it), the
    native context is always freed first, and the child exits cleanly (no exception swallowed on the
    way), and within exit's wait when the call outlasts it."""
    env = dict(os.environ)
    defects = ",".join(d for d in _native.hooks.defects() if _native.hooks.defect_on(d))
    # the waiting call is an RPC handshake: a build without the RPC backend has none to wait in
    waits = ("mid-call", "past-wait") if _native.rpc_built() else ()
    for mode in ("close", "gc", "exit", "mid-use", *waits):
        started = time.monotonic()
        run = subprocess.run(
            _child.python(
                "-X", "dev", "-c", CHILD_SCRIPT, mode, str(model_path), backend.name, defects, *child_sizes(shape)
            ),
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        # a clean exit: no crash, and no exception that an exit handler or a finalizer swallowed
        # (Python prints those as "Exception ignored" and exits 0)
        unclean = ("Fatal Python error", "terminate called", "ptrace", "Aborted", "Exception ignored")
        crashed = [m for m in unclean if m in run.stderr]
        expect("TX-OWN-03", run.returncode == 0 and not crashed, f"{mode}: exit {run.returncode}: {run.stderr[-600:]}")
        # a call that outlasts exit's wait (1 s; the call's own deadline is 30 s) does not hold the exit
        took = time.monotonic() - started
        expect("TX-OWN-03", mode != "past-wait" or took < 15, f"{mode}: the exit waited {took:.0f} s for the call")
        # the child's stdout, in the order things happened: llama.cpp's log lines as it logs them,
        # and the handler's line when the callback state lets it go
        events = [line for line in run.stdout.splitlines() if "~llama_context" in line or line == "state-released"]
        expect("TX-OWN-03", events.count("state-released") == 1, f"{mode}: the handler was released {events}")
        expect(
            "TX-OWN-03",
            bool(events) and events[-1] == "state-released" and "~llama_context" in "".join(events[:-1]),
            f"{mode}: state-freed-first {events}",
        )


@pytest.mark.clause("TX-OWN-04")
def test_a_handler_belongs_to_one_context_and_runs_inside_its_decodes(backend, loaded, shape: Shape):
    """A second context cannot take the same transactions (and the first is unharmed); the
    handler runs on the decoding thread while the decode is in progress; two threads decoding one
    context are served one after the other, never at once; a handler calling into its own
    context is refused."""
    model, profile = loaded
    one = decode_tokens(shape)[: shape.decode_micro_batch]  # a decode of one micro-batch: one handler call
    spans: list[tuple[float, float, int]] = []
    inside = threading.local()

    def handler(t: Transaction) -> None:
        start = time.monotonic()
        expect("TX-OWN-04", getattr(inside, "decoding", False), "the handler ran outside its decode call")
        time.sleep(0.01)
        spans.append((start, time.monotonic(), threading.get_ident()))

    tx = TensorTransactions(profile, [profile.select("l_out-0")], handler)
    with plain_context(model, shape, tx) as ctx:
        with bound("TX-OWN-04"), pytest.raises(retro.InvalidStateError):
            plain_context(model, shape, tx).close()
        expect("TX-OWN-04", tx.taken, "the transactions were released")

        def decode_three() -> None:
            inside.decoding = True
            for _ in range(3):
                ctx.reset()
                ctx.decode(one)
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

    with tx_context(model, shape, profile, [profile.select("l_out-0")], reenter) as own:
        with pytest.raises(retro.TensorCallbackError) as err:
            own.decode(one)
        expect(
            "TX-OWN-04",
            err.value.failure.type == "retro.errors.InvalidStateError",
            f"a handler calling its own context: {err.value.failure}",
        )


#: the running call, parked inside its real work while the other calls are made from the main
#: thread: a training call at its second compute (a stall of the fault hook there, its guard and
#: graph taken, one micro-batch already run), a generation in its second decode's handler
RUNNING = {
    "epoch": "tr.epoch(ds)",
    "micro_batch": (
        "for _ in range(6): tr._h.micro_batch(ds.tokens[0, :micro_batch], ds.labels[0, :micro_batch], 0, True)"
    ),
    "upstream_epoch": "retro.testing.upstream_epoch(tr, ds)",
    "generate": "ctx.generate([1, 2, 3], 40, stop_at_eog=False)",
}
#: every call a user makes on a context or its trainer, made while the running call is parked
CONCURRENT = {
    "context.close": "ctx.close()",
    "trainer.close": "tr.close()",
    "decode": "ctx.reset(); ctx.decode([1, 2, 3])",
    "generate": "ctx.reset(); ctx.generate([1, 2, 3], 4)",
    "drain": "ctx.drain_captures()",
    "epoch": "tr.epoch(small)",
    "checkpoint": "tr.checkpoint() if tr.period_position == 0 else None",
    "prepare_state": "tr._h.prepare_state()",
    "reset": "ctx.reset()",
}
PARK_S = 0.3
#: the longest a child may take: four times the slowest intact child measured (22.5 s, an epoch on
#: Vulkan's lavapipe), and under the shortest case timeout a certification is run with (120 s, the
#: mutation runs): a child that hangs (two threads in one RPC exchange) is this check's finding,
#: not a case killed from outside with its seeded defect read as escaped
CHILD_TIMEOUT_S = 90.0

SERIALIZED_CHILD = textwrap.dedent(
    """
    import json, pathlib, sys, threading, time
    import numpy as np
    import retro, retro.testing, retro._native as native
    from retro import fault_injection as fi
    from retro.conformance import backends, support
    from retro.transactions import Profile, TensorTransactions

    running, path, backend_name, defects, park_s = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5])
    running_call, concurrent = json.loads(sys.argv[6]), json.loads(sys.argv[7])
    window, micro_batch = int(sys.argv[8]), int(sys.argv[9])  # the shape profile's
    for defect in filter(None, defects.split(",")):  # the seeded defect the parent runs under
        native.hooks.set_defect(defect, True)
    backend = backends.discover()[backend_name]
    model = support.load(backend, pathlib.Path(path))
    if why := support.not_on(model, backend):  # the backend asked for, not the CPU a missing one falls back to
        sys.exit(f"not on {backend_name}: {why}")
    profile = Profile.record(model)
    stream = np.random.default_rng(0).integers(0, model.n_vocab, size=4 * window + 1)
    ds = retro.TokenDataset.from_tokens(stream, width=window)
    small = retro.TokenDataset(np.ascontiguousarray(ds.tokens[:1]), np.ascontiguousarray(ds.labels[:1]))
    handled, in_handler = [0], threading.Event()

    def handler(t):
        handled[0] += 1
        if running == "generate" and handled[0] == 2:  # the generation's second decode
            in_handler.set()
            time.sleep(park_s)
            in_handler.clear()

    def parked():
        return fi.stalling() or in_handler.is_set()

    for name, call in concurrent.items():
        print(json.dumps({"starting": name}), flush=True)
        n_ubatch = window if running == "upstream_epoch" else micro_batch
        ctx = retro.Context(model, n_ctx=window, n_batch=window, n_ubatch=n_ubatch,
                            n_threads=1, transactions=TensorTransactions(profile, [profile.select("l_out-0")], handler))
        tr = retro.Trainer(ctx, optimizer=retro.SGD(lr=1e-3))
        fi.reset()
        handled[0] = 0
        if running != "generate":
            fi.stall("compute", 2, park_s)
        outcome = {}

        def run():
            try:
                exec(running_call, {"retro": retro, "tr": tr, "ctx": ctx, "ds": ds, "micro_batch": micro_batch})
                outcome["running"] = "ok"
            except retro.RetroError as e:
                outcome["running"] = type(e).__name__

        worker = threading.Thread(target=run)
        worker.start()
        deadline = time.monotonic() + 60
        while not parked() and worker.is_alive() and time.monotonic() < deadline:
            time.sleep(0.001)
        was_parked = parked()
        try:
            exec(call, {"retro": retro, "tr": tr, "ctx": ctx, "small": small})
            outcome["concurrent"] = "ok"
        except retro.RetroError as e:
            outcome["concurrent"] = type(e).__name__
        returned_while_parked = parked()
        worker.join()
        fi.reset()
        print(json.dumps({"pair": name, "parked": was_parked, "returned_while_parked": returned_while_parked, **outcome}),
              flush=True)
        tr.close()
        ctx.close()
    """
)


def _serialized_child(
    running: str, model_path, shape: Shape, backend: str, defects: str, env: dict[str, str]
) -> tuple[int | None, str, str]:
    """The child's exit status (None: it hung, and was killed after CHILD_TIMEOUT_S), its output
    and its error output."""
    args = [running, str(model_path), backend, defects, str(PARK_S), json.dumps(RUNNING[running])]
    sizes = [str(shape.window), str(shape.micro_batch)]  # the child cannot see the fixture
    try:
        done = subprocess.run(
            _child.python("-c", SERIALIZED_CHILD, *args, json.dumps(CONCURRENT), *sizes),
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_S,
            env=env,
        )
    except subprocess.TimeoutExpired as hung:

        def text(out: str | bytes | None) -> str:
            return out.decode(errors="replace") if isinstance(out, bytes) else out or ""

        return None, text(hung.stdout), text(hung.stderr)
    return done.returncode, done.stdout, done.stderr


@pytest.mark.clause("TX-OWN-04")
@pytest.mark.parametrize("running", sorted(RUNNING))
def test_every_call_waits_for_the_call_running_on_its_context(backend, model_path, running, shape: Shape):
    """Every call on a context is serialized, training included: while a call from one thread is
    parked inside its real work (a training call at its second compute, a generation inside its
    second decode), each call a user can make on the context or its trainer, from a second thread,
    returns only after the running call has gone on: none runs inside it. Each pair runs in a child
    interpreter, so that a crash (a close that freed the scheduler under the running compute) is
    its exit status, with the pair it was making."""
    defects = ",".join(d for d in _native.hooks.defects() if _native.hooks.defect_on(d))
    with contextlib.ExitStack() as stack:
        env = {**os.environ, "GGML_NO_BACKTRACE": "1"}
        if backend.name == "rpc":
            # a server of its own: two threads talking over one link at once (the seeded defect)
            # can send the server commands that stop it, and the run's other checks use the shared one
            server = retro.rpc.Server(numerics=backends.rpc_numerics())
            env[backends.RPC_SERVERS_ENV] = stack.enter_context(server).endpoint
        status, stdout, stderr = _serialized_child(running, model_path, shape, backend.name, defects, env)
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{") and line.endswith("}")]
    pairs = {r["pair"]: r for r in lines if "pair" in r}
    last = next((r["starting"] for r in reversed(lines) if "starting" in r), None)
    ended = f"hung (killed after {CHILD_TIMEOUT_S:g} s)" if status is None else f"died (exit {status})"
    expect(
        "TX-OWN-04",
        status == 0 and len(pairs) == len(CONCURRENT),
        f"the child {ended} during {running} x {last}: {stderr[-800:]}",
    )
    loops = running == "micro_batch"  # a loop of calls: a close may land between two of them
    for name, r in pairs.items():
        expect("TX-OWN-04", r["parked"], f"{running} was never parked inside its work (x {name})")
        expect(
            "TX-OWN-04",
            not r["returned_while_parked"],
            f"{name} from another thread returned ({r['concurrent']}) while {running} was parked inside its work",
        )
        closes = name in ("context.close", "trainer.close")
        allowed = ("ok", "InvalidStateError") if closes and loops else ("ok",)
        expect("TX-OWN-04", r["running"] in allowed, f"the running {running} ended with {r['running']} (x {name})")
        # waited, then ran; a call on a closed context or trainer is refused, typed. "reset, then
        # decode" is two calls: a micro-batch of the loop may land between them and leave its
        # training sequence where the decode's positions collide (a typed DecodeError)
        interleaved = ("DecodeError",) if loops and name in ("decode", "generate") else ()
        expect(
            "TX-OWN-04",
            r["concurrent"] in ("ok", "InvalidStateError", *interleaved),
            f"{name} during {running}: {r['concurrent']}",
        )
    on_path(f"running={running}")


@pytest.mark.clause("TX-OWN-05")
def test_the_hooks_bracket_every_internal_decode(backend, loaded, tmp_path, seed, shape: Shape):
    """A generation (one decode per token) and a speculative generation (a draft model proposes,
    the target checks in one decode) make their decodes inside one call: each of the target's
    decodes is bracketed, so every position the target's KV cache holds was captured by a
    committed decode, and there are as many committed decodes as llama_decode calls, holding every
    drafted token. The drafting decodes, made inside the draft context, are bracketed by the
    draft's own transactions. The plain generation starts from text, as a user's does: its prompt
    is the model's tokenization."""
    model, profile = loaded
    sel = [profile.select("attn_norm-0", retain=True)]
    with tx_context(model, shape, profile, sel) as ctx:
        # a decode the hooks do not bracket fails the generation: the clause's failure, not the check's
        g = succeeds(
            "TX-OWN-05", "the generation", lambda: ctx.generate(model.tokenize("hello world"), 6, stop_at_eog=False)
        )
        assert g is not None  # None only where TX-OWN-05 is not enforced, and this check cites no other
        covered = committed_positions(ctx.drain_captures(), "attn_norm-0")
        held = ctx.sequence_length
        expect("TX-OWN-05", len(covered) == g.decodes, f"{len(covered)} committed decodes of {g.decodes}")
        positions = sorted(p for ps in covered.values() for p in ps)
        expect("TX-OWN-05", positions == list(range(held)), f"captured positions {positions}, cache holds {held}")
    draft_path = support.model_file(tmp_path, seed, shape, draft_noise=DRAFT_NOISE)
    with (
        support.load(backend, draft_path, trainable=False) as draft_model,
        tx_context(draft_model, shape, profile, sel) as draft,
    ):
        with tx_context(model, shape, profile, sel) as ctx:
            prompt = decode_tokens(shape)[:3]
            g = succeeds(
                "TX-OWN-05",
                "the speculative generation",
                lambda: ctx.generate(prompt, 12, stop_at_eog=False, draft=draft, n_draft=3),
            )
            assert g is not None
            covered = committed_positions(ctx.drain_captures(), "attn_norm-0")
            drafting = committed_positions(draft.drain_captures(), "attn_norm-0")
            expect("TX-OWN-05", 0 < g.accepted < g.drafted, f"{g.accepted} of {g.drafted} drafted tokens kept")
            expect("TX-OWN-05", len(covered) == g.decodes, f"{len(covered)} committed decodes of {g.decodes}")
            seen = {p for ps in covered.values() for p in ps}
            missing = sorted(set(range(ctx.sequence_length)) - seen)
            expect("TX-OWN-05", not missing, f"positions decoded outside a transaction: {missing}")
            # after the prompt's decode, each of the target's decodes checks the last kept token and
            # the draft's proposal after it: the rows the transactions saw hold every drafted token
            rows = sum(len(ps) for ps in covered.values())
            expect(
                "TX-OWN-05",
                rows == len(prompt) + (g.decodes - 1) + g.drafted,
                f"the target's {g.decodes} decodes (the first of a {len(prompt)}-token prompt) computed {rows} rows "
                f"for {g.drafted} drafted tokens",
            )
            # the drafting itself: the draft decodes the prompt, then once for each token it proposes
            # (greedy drafting is autoregressive), each decode inside the draft's own transactions
            expect(
                "TX-OWN-05",
                len(drafting) == 1 + g.drafted,
                f"{len(drafting)} committed decodes of the draft context for {g.drafted} drafted tokens",
            )
            seen = {p for ps in drafting.values() for p in ps}
            missing = sorted(set(range(draft.sequence_length)) - seen)
            expect("TX-OWN-05", not missing, f"draft positions decoded outside a transaction: {missing}")
        with plain_context(model, shape) as plain:
            expect(
                "TX-OWN-05",
                plain.generate(prompt, 12, stop_at_eog=False).tokens == g.tokens,
                "speculative generation gave other tokens than greedy generation",
            )


@pytest.mark.clause("TX-OWN-06")
def test_no_python_object_outlives_its_handler_call(backend, loaded, shape: Shape):
    """After a handler raised, neither its exception object, nor anything its frames held, nor
    the error raised to the caller keeps them: all are collectable. The array a handler kept is
    its own: writing to it after the decode changes nothing the context computes."""
    model, profile = loaded
    tokens, m = decode_tokens(shape), shape.decode_micro_batch

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

    with tx_context(model, shape, profile, [profile.select("l_out-0")], handler) as ctx:
        with pytest.raises(retro.TensorCallbackError) as err:
            ctx.decode(tokens)
        expect("TX-OWN-06", err.value.__cause__ is None, "the handler's exception is chained to the error")
        del err
    gc.collect()
    expect("TX-OWN-06", all(r() is None for r in refs), "the handler's exception or frame objects are still alive")

    kept_positions: list[np.ndarray] = []

    def keep(t: Transaction) -> None:
        kept.append(t.data)
        kept_positions.append(t.positions)

    with tx_context(model, shape, profile, [profile.select("l_out-0", retain=True, access="mutable-f32")], keep) as ctx:
        decode_ok("TX-OWN-06", ctx, tokens[:m])  # the handler is given an array of its own, or fails here
        with bound("TX-OWN-06"):  # and so is the drain: an array it cannot hand over is the clause's
            try:
                first = ctx.drain_captures()[0].data.copy()
            except Exception as exc:  # noqa: BLE001 - the clause promised the capture as an array of its own
                pytest.fail(f"the kept capture could not be drained: {type(exc).__name__}: {exc}")
        kept[0][:] = 1e6  # after the decode returned
        ctx.reset()
        ctx.decode(tokens[:m])
        again = ctx.drain_captures()[0].data
        expect("TX-OWN-06", np.array_equal(first, again), "a handler's kept array reached the context afterwards")
        expect("TX-OWN-06", kept[0].base is None and kept[0].flags.owndata, "the handler's array is a view")
        # its positions are its own too: later decodes leave what it kept as it was
        expect(
            "TX-OWN-06",
            kept_positions[0].base is None and kept_positions[0].flags.owndata,
            "the handler's positions are a view of native storage",
        )
        ctx.decode(tokens[m : 2 * m])
        expect("TX-OWN-06", kept_positions[0].tolist() == list(range(m)), f"kept positions became {kept_positions[0]}")
