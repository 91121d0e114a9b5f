"""What the tensor-transaction checks (test_tx_*.py, one file per family of seed 004) share."""

from __future__ import annotations

import contextlib
import dataclasses
import textwrap
from collections.abc import Callable, Iterator

import numpy as np
import pytest

import retro
from retro.conformance import support
from retro.conformance.evidence import succeeds
from retro.conformance.shapes import Shape
from retro.transactions import Profile, Selector, TensorTransactions, Transaction

DRAFT_NOISE = 1.0  # the draft: the model with noise in its last FFN, so it agrees in part


def decode_tokens(shape: Shape) -> list[int]:
    """The tokens of a decode of several micro-batches: two whole ones and a half one."""
    m = shape.decode_micro_batch
    return list(range(3, 3 + 2 * m + m // 2))


def micro_batches(shape: Shape) -> list[tuple[int, int]]:
    """(first row, rows) of each micro-batch of a decode of decode_tokens(shape)."""
    m = shape.decode_micro_batch
    return [(0, m), (m, m), (2 * m, m // 2)]


def plain_context(
    model: retro.Model, shape: Shape, tx: TensorTransactions | None = None, *, n_ubatch: int | None = None
) -> retro.Context:
    return retro.Context(
        model,
        n_ctx=shape.window,
        n_batch=shape.decode_batch,
        n_ubatch=shape.decode_micro_batch if n_ubatch is None else n_ubatch,
        n_threads=support.CHECK_THREADS,
        transactions=tx,
    )


@contextlib.contextmanager
def tx_context(
    model: retro.Model, shape: Shape, profile: Profile, selectors: list[Selector], handler=None, **kwargs
) -> Iterator[retro.Context]:
    n_ubatch = kwargs.pop("n_ubatch", None)
    tx = TensorTransactions(profile, selectors, handler, **kwargs)
    with plain_context(model, shape, tx, n_ubatch=n_ubatch) as ctx:
        yield ctx


def plain_state(model: retro.Model, shape: Shape, tokens: list[int]) -> bytes:
    """llama.cpp's sequence state after a decode without transactions: what an untouched graph computes."""
    with plain_context(model, shape) as ctx:
        ctx.decode(tokens)
        return ctx.sequence_state()


def raise_at(k: int, exc: Callable[[], BaseException] = lambda: ValueError("handler failed")):
    """A handler that logs its calls and raises at call k (0-based)."""
    calls: list[Transaction] = []

    def handler(t: Transaction) -> None:
        calls.append(t)
        if len(calls) == k + 1:
            raise exc()

    return handler, calls


def decode_ok(clause: str, ctx: retro.Context, tokens: list[int]) -> np.ndarray | None:
    """Decode, bound to `clause`: a decode that fails in any way (a failed transaction, an error
    raised handing the handler its copy) is a failed assertion of that clause. The logits, or None
    where the clause was not enforced and its failure recorded."""
    return succeeds(clause, "the decode", lambda: ctx.decode(tokens))


def foreign_profile(profile: Profile, name: str, **changes) -> Profile:
    """The profile with one node's record changed, as a stale or foreign profile would present it."""
    nodes = dict(profile.nodes)
    nodes[name] = dataclasses.replace(nodes[name], **changes)
    return dataclasses.replace(profile, nodes=nodes)


def rows_of(captures, name: str) -> tuple[np.ndarray, np.ndarray]:
    picked = [c for c in captures if c.name == name]
    return np.concatenate([c.positions for c in picked]), np.concatenate([c.data for c in picked])


CHILD_SCRIPT = textwrap.dedent(
    """
    import gc, os, sys, threading, time
    import retro, retro._native as native
    from retro.conformance import backends, support
    from retro.transactions import Profile, TensorTransactions

    mode, path, backend_name, defects = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    n_ctx, n_batch, n_ubatch, n_tokens = map(int, sys.argv[5:9])  # the shape profile's (child_sizes)
    for defect in filter(None, defects.split(",")):  # the seeded defect the parent runs under
        native.hooks.set_defect(defect, True)
    backend = backends.discover()[backend_name]

    in_handler = threading.Event()

    class Handler:
        def __call__(self, t):
            in_handler.set()
            time.sleep(0.01)
        def __del__(self, write=os.write):
            # released with the callback state: after llama.cpp's destructor line (~llama_context),
            # which the native log mirror writes to the same descriptor as it is logged
            write(1, b"state-released\\n")

    model = support.load(backend, __import__("pathlib").Path(path), trainable=False)
    if why := support.not_on(model, backend):  # the backend asked for, not the CPU a missing one falls back to
        sys.exit(f"not on {backend_name}: {why}")
    profile = Profile.record(model)
    ctx = retro.Context(model, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_threads=1,
                        transactions=TensorTransactions(profile, [profile.select("l_out-0")], Handler()))
    ctx.decode(list(range(3, 3 + n_tokens)))
    native.hooks.mirror_logs(1)  # from here on, every native log line to stdout, in event order
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
                    ctx.decode(list(range(3, 3 + n_tokens)))
                except retro.RetroError:
                    return
        in_handler.clear()
        threading.Thread(target=decode_forever, daemon=True).start()
        in_handler.wait()
    elif mode in ("mid-call", "past-wait"):  # ... while another thread waits inside a call no close can end
        import socket, retro.rpc, retro._handle
        peer = socket.create_server(("127.0.0.1", 0))  # it listens and never answers the handshake
        # "mid-call": the call returns within exit's wait, which waits for it; "past-wait": it
        # outlasts exit's wait (1 s here), and exit leaves without it
        deadline_s = 2.0 if mode == "mid-call" else 30.0
        if mode == "past-wait":
            retro._handle.EXIT_WAIT_S = 1.0
        def handshake():
            try:
                retro.rpc.connect(f"127.0.0.1:{peer.getsockname()[1]}", deadline_s=deadline_s)
            except retro.RetroError:
                pass
        threading.Thread(target=handshake, daemon=True).start()
        while native.calls_in_flight() == 0:
            time.sleep(0.001)
    # "exit", "mid-use", "mid-call" and "past-wait": left to interpreter shutdown
    """
)


def child_sizes(shape: Shape) -> list[str]:
    """CHILD_SCRIPT's arguments after its first four: the sizes of its context and decode."""
    return [str(n) for n in (shape.window, shape.decode_batch, shape.decode_micro_batch, len(decode_tokens(shape)))]


def committed_positions(captures, name: str) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for c in captures:
        if c.name == name:
            out.setdefault(c.decode, []).extend(c.positions.tolist())
    return out


def fails_closed(ctx: retro.Context, calls: list, tokens: list[int]) -> str:
    """Decode: it must fail on the layout, without the handler ever seeing the node."""
    with pytest.raises(retro.TensorCallbackError) as err:
        ctx.decode(tokens)
    assert err.value.failure.kind == "layout", f"failed as {err.value.failure}"
    assert not calls, f"the handler saw {len(calls)} mismatched copies"
    return err.value.failure.message


def steer(vector: np.ndarray, *, poison_last: float | None = None, then_raise: bool = False):
    """A handler adding `vector` to each row; then writing `poison_last` (a non-finite value) into
    the last element, or raising."""

    def handler(t: Transaction) -> None:
        t.data += vector
        if poison_last is not None:
            t.data[-1, -1] = poison_last
        if then_raise:
            raise RuntimeError("after editing")

    return handler


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("str() raises")


class CustomBase(BaseException):
    pass


class Outer:
    """A namespace: its exception's qualified name is Outer.Nested, its plain name Nested alone."""

    class Nested(Exception):
        pass


RAISED: list[tuple[str, Callable[[], BaseException]]] = [
    ("builtins.ValueError", lambda: ValueError("plain")),
    ("builtins.KeyboardInterrupt", KeyboardInterrupt),
    ("builtins.SystemExit", lambda: SystemExit(3)),
    (f"{__name__}.CustomBase", lambda: CustomBase("a BaseException")),
    (f"{__name__}.Unprintable", Unprintable),
    ("builtins.MemoryError", lambda: MemoryError("x" * (1 << 20))),
    (f"{__name__}.Outer.Nested", lambda: Outer.Nested("a nested class")),
]
