"""Calls on one context from two threads (native/core/call_guard.h): every call that runs on a
context, training included, holds its call guard, so a call from another thread waits for the
running one (every pair of running and concurrent call, on each backend: the conformance check of
TX-OWN-04, conformance/cases/test_tx_own.py) and a call from inside a callback of the running call
is a typed error; the interpreter exits cleanly with threads inside native calls."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "inside",
    ["ctx.close()", "tr.close()", "ctx.decode([1])", "tr.epoch(small)", "tr._h.prepare_state()"],
)
def test_a_callback_calling_into_its_own_running_context_is_refused(model, inside):
    """From a progress callback, a call on the context running it would deadlock (or, unguarded,
    free what the running step uses): it raises InvalidStateError inside the callback, which
    cancels the epoch like any callback exception; reads of the trainer's state still nest."""
    import numpy as np

    import retro
    from retro.errors import InvalidStateError

    with retro.Context(model, n_ctx=256, n_batch=256, n_ubatch=64, n_threads=1) as ctx:
        tr = retro.Trainer(ctx, optimizer=retro.SGD(lr=1e-3))
        stream = np.random.default_rng(1).integers(0, model.n_vocab, size=2 * 256 + 1)
        ds = retro.TokenDataset.from_tokens(stream, width=256)
        small = retro.TokenDataset(np.ascontiguousarray(ds.tokens[:1]), np.ascontiguousarray(ds.labels[:1]))
        seen = []

        def progress(p):
            seen.append((tr.iteration, tr.period_position, tr.poisoned))  # reads nest
            exec(inside, {"ctx": ctx, "tr": tr, "small": small})

        with pytest.raises(InvalidStateError, match="may not call into the context"):
            tr.epoch(ds, progress=progress)
        assert len(seen) == 1
        assert not ctx.closed and not tr.closed
        assert tr.epoch(ds).epoch_complete  # usable afterwards
        tr.close()


EXIT_CHILD = """
import sys, threading, time
import numpy as np
import retro

model = retro.Model.load(sys.argv[1], devices=[], trainable=True)
decoding = retro.Context(model, n_ctx=256, n_batch=64, n_ubatch=16, n_threads=1)
training = retro.Context(model, n_ctx=256, n_batch=256, n_ubatch=64, n_threads=1)
trainer = retro.Trainer(training, optimizer=retro.SGD(lr=0.01))
data = retro.TokenDataset.from_tokens(np.arange(2 * 256 + 1) % 500, width=256)
started = threading.Barrier(3)

# each loop ends on the typed error of its closed object, silently: a daemon thread that prints a
# traceback while the interpreter finalizes can take CPython down with it (the stderr lock)
def decode_forever():
    started.wait()
    try:
        while True:
            decoding.reset()
            decoding.decode(list(range(3, 40)))
    except retro.RetroError:
        return

def train_forever():
    started.wait()
    try:
        while True:
            trainer.epoch(data)
    except retro.RetroError:
        return

for work in (decode_forever, train_forever):
    threading.Thread(target=work, daemon=True).start()
started.wait()
time.sleep(float(sys.argv[2]))
# the interpreter exits with both threads inside native calls
"""


@pytest.mark.parametrize("after", [0.0, 0.05, 0.2])
def test_the_interpreter_exits_cleanly_while_daemon_threads_decode_and_train(model_path, after):
    """retro closes what is open at exit (trainers, contexts, models) and lets the calls of other
    threads return before CPython finalizes: left to finalization, a thread that asked for the GIL
    back was ended by pthread_exit and the process aborted (std::terminate) as it unwound."""
    for _ in range(3):
        child = subprocess.run(
            [sys.executable, "-X", "dev", "-c", EXIT_CHILD, str(model_path), str(after)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "GGML_NO_BACKTRACE": "1"},
        )
        assert child.returncode == 0 and "terminate" not in child.stderr, child.stderr[-2000:]


def test_weights_are_read_and_written_one_step_at_a_time(model):
    """Every read and write of the weights waits for a training call on the model (call_guard.h):
    a snapshot taken from another thread while an epoch runs is the epoch's last step's, never a
    step in between; a checkpoint read there is one step's weights and moments; from inside the
    epoch's own callback reads nest and a write is a typed error."""
    import threading

    import numpy as np

    import retro
    from retro.errors import InvalidStateError

    with retro.Context(model, n_ctx=256, n_batch=256, n_ubatch=64, n_threads=1) as ctx:
        tr = retro.Trainer(ctx, optimizer=retro.AdamW(lr=1e-2))
        stream = np.random.default_rng(2).integers(0, model.n_vocab, size=2 * 256 + 1)
        ds = retro.TokenDataset.from_tokens(stream, width=256)
        inside, read = threading.Event(), threading.Event()
        nested = []

        def progress(p):
            if p.done == 1:
                nested.append(model.parameters())  # a read nests in the call that holds the weights
                with pytest.raises(InvalidStateError, match="may not write the weights"):
                    model._h.set_tensor("output_norm.weight", np.ones_like(nested[0]["output_norm.weight"]))
                inside.set()
            read.wait(timeout=0.3)  # each step lingers: an unguarded read lands between two of them

        epoch = threading.Thread(target=lambda: tr.epoch(ds, progress=progress))
        epoch.start()
        assert inside.wait(timeout=60)
        during = model.parameters()  # waits for the epoch's guard
        read.set()
        epoch.join(timeout=120)
        after = model.parameters()
        assert tr.iteration == 1 + 8 and len(nested) == 1
        assert all(np.array_equal(during[n], after[n]) for n in after), "a snapshot mixed the epoch's steps"
        assert any(not np.array_equal(nested[0][n], after[n]) for n in after)
        checkpoint = tr.checkpoint()
        assert checkpoint.iteration == 9 and set(checkpoint.moments) <= set(checkpoint.parameters)
        tr.restore(checkpoint)
        assert all(np.array_equal(model.parameters()[n], after[n]) for n in after)
        tr.close()
