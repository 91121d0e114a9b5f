"""Baseline clauses every contract presupposes: BASE-01 (each optimizer step applies exactly its
own accumulation period), BASE-02 (determinism), BASE-03 (read-back and save/reload)."""

from __future__ import annotations

import hashlib
import os
import statistics
import threading
import time
from dataclasses import dataclass

import numpy as np
import pytest

import retro
from retro.conformance import support
from retro.conformance.evidence import Bound, bound, expect, measure, on_path, within
from retro.conformance.shapes import Shape
from retro.testing import busy_processes, reference, runnable_elsewhere, upstream_epoch


def _train(backend, shape: Shape, path, ds, *, optimizer, accumulation, split=None):
    """Parameters after training a fresh load on ds, in one call or split into calls at `split`."""
    with support.load(backend, path) as model, support.context(model, shape) as ctx:
        with retro.Trainer(ctx, optimizer=optimizer, accumulation=accumulation) as tr:
            parts = (
                [ds] if split is None else [support.subset(ds, slice(0, split)), support.subset(ds, slice(split, None))]
            )
            steps = sum(tr.epoch(p).optimizer_steps for p in parts)
        return model.parameters(), steps


@pytest.mark.clause("BASE-01")
@pytest.mark.parametrize("accumulation", [1, 2])
def test_each_step_applies_only_its_own_period(backend, model_path, seed, shape, accumulation):
    """SGD steps taken in one call equal the same steps each taken by a fresh optimizer (whose
    accumulators are certainly zero) from the parameters the previous step left, and equal the
    same steps split over two calls."""
    periods = 3
    sgd = retro.SGD(lr=0.05)
    with support.load(backend, model_path, trainable=False) as probe:
        ds = support.windows(periods * accumulation, shape.window, probe.n_vocab, seed)

    in_one_call, steps = _train(backend, shape, model_path, ds, optimizer=sgd, accumulation=accumulation)
    expect("BASE-01", steps == periods, f"{steps} optimizer steps for {periods} periods")

    # reference: period by period, each with a new trainer on the parameters the last one left
    with support.load(backend, model_path) as model, support.context(model, shape) as ctx:
        before = model.parameters()
        for p in range(periods):
            with retro.Trainer(ctx, optimizer=sgd, accumulation=accumulation) as tr:
                m = tr.epoch(support.subset(ds, slice(p * accumulation, (p + 1) * accumulation)))
                expect("BASE-01", m.optimizer_steps == 1, f"period {p}: {m.optimizer_steps} steps")
        reference = model.parameters()
    expect("BASE-01", support.changed(before, reference), "training changed no parameter")
    with bound("BASE-01"):
        support.assert_params_equal(
            in_one_call, reference, backend, f"{periods} SGD steps in one call vs one fresh optimizer per step"
        )
    split, _ = _train(backend, shape, model_path, ds, optimizer=sgd, accumulation=accumulation, split=accumulation)
    with bound("BASE-01"):
        support.assert_params_equal(split, in_one_call, backend, "steps split over two calls vs one call")
    on_path(f"accumulation={accumulation}")


@pytest.mark.clause("BASE-01")
@pytest.mark.parametrize("accumulation", [3, 8])
def test_training_does_not_depend_on_the_evaluation_set(backend, model_path, seed, shape, accumulation):
    """Three epochs over the same training windows, with and without an evaluation tail, give the
    same parameters, also when the accumulation period does not divide the training micro-batches
    (the period then stays open across the evaluation and the next call)."""
    with support.load(backend, model_path, trainable=False) as probe:
        ds = support.windows(3, shape.window, probe.n_vocab, seed + 4)
    per_epoch = 2 * shape.parts  # the two training windows, in micro-batches
    runs = []
    for data, frac in ((ds, 1 / 3), (support.subset(ds, slice(0, 2)), 0.0)):
        with (
            support.load(backend, model_path) as model,
            support.context(model, shape, n_ubatch=shape.micro_batch) as ctx,
        ):
            with retro.Trainer(ctx, optimizer=retro.AdamW(lr=1e-3), accumulation=accumulation) as tr:
                for _ in range(3):
                    m = tr.epoch(data, val_fraction=frac)
                    expect(
                        "BASE-01",
                        m.train_micro_batches == per_epoch,
                        f"{m.train_micro_batches} training micro-batches",
                    )
                runs.append((model.parameters(), tr.period_position))
    (with_eval, pos_eval), (without, pos_plain) = runs
    expect(
        "BASE-01",
        pos_eval == pos_plain == (3 * per_epoch) % accumulation,
        f"period position {pos_eval} with an eval set, {pos_plain} without, expected {(3 * per_epoch) % accumulation}",
    )
    with bound("BASE-01"):
        support.assert_params_equal(with_eval, without, backend, "trained with an eval tail vs without")
    on_path(f"accumulation={accumulation}")


# not BASE-01: upstream's loop runs on the same patched library, so a missing accumulator reset
# moves both loops alike and this comparison cannot see it (the checks above can)
@pytest.mark.clause("BASE-02")
@pytest.mark.parametrize("micro_batch, accumulation", [("part", 4), ("window", 1), ("part", 2)])
def test_the_loop_equals_upstreams_own_loop(backend, model_path, seed, shape, micro_batch, accumulation):
    """The oracle: retro's loop and upstream's llama_opt_epoch, on the same library, data and
    optimizer settings, end with the same parameters (bitwise on CPU), losses and accuracies."""
    with support.load(backend, model_path, trainable=False) as probe:
        ds = support.windows(4, shape.window, probe.n_vocab, seed + 5)
    n_ubatch = shape.window if micro_batch == "window" else shape.micro_batch
    runs = []
    for loop in ("retro", "upstream"):
        with support.load(backend, model_path) as model, support.context(model, shape, n_ubatch=n_ubatch) as ctx:
            with retro.Trainer(ctx, optimizer=retro.AdamW(lr=1e-3), accumulation=accumulation) as tr:
                if loop == "retro":
                    metrics = [tr.epoch(ds, val_fraction=0.25) for _ in range(2)]
                else:
                    metrics = [upstream_epoch(tr, ds, val_fraction=0.25) for _ in range(2)]
                steps = sum(m.optimizer_steps for m in metrics)
            runs.append(
                (
                    model.parameters(),
                    [(m.train_loss, m.eval_loss, m.train_accuracy, m.eval_accuracy) for m in metrics],
                    steps,
                )
            )
    (ours, our_losses, our_steps), (theirs, their_losses, their_steps) = runs
    expect("BASE-02", our_steps == their_steps, f"{our_steps} optimizer steps, upstream took {their_steps}")
    with bound("BASE-02"):
        support.assert_params_equal(ours, theirs, backend, "retro's loop vs upstream's llama_opt_epoch")
    with bound("BASE-02"):
        support.assert_close(
            np.array(our_losses, dtype=float),
            np.array(their_losses, dtype=float),
            backend,
            "train/eval losses and accuracies vs upstream's",
        )
    on_path(f"micro_batch={micro_batch}", f"accumulation={accumulation}")


@pytest.mark.clause("BASE-02")
def test_same_state_data_and_options_give_same_parameters(backend, model_path, seed, shape):
    """Two runs from the same file, data and options end with the same parameters and losses."""
    with support.load(backend, model_path, trainable=False) as probe:
        ds = support.windows(4, shape.window, probe.n_vocab, seed + 1)
    runs = []
    for _ in range(2):
        with support.load(backend, model_path) as model, support.context(model, shape) as ctx:
            with retro.Trainer(ctx, optimizer=retro.AdamW(lr=1e-3), accumulation=2) as tr:
                losses = [tr.epoch(ds, val_fraction=0.25).train_loss for _ in range(2)]
            runs.append((model.parameters(), losses))
    (p1, l1), (p2, l2) = runs
    with bound("BASE-02"):
        support.assert_params_equal(p2, p1, backend, "second run vs first run")
        support.assert_close(np.array(l2), np.array(l1), backend, "losses of equal runs")


@pytest.mark.clause("BASE-02")
@pytest.mark.parametrize("threads", ["fixed", "adaptive"])
def test_the_thread_count_changes_no_parameter(backend, model_path, seed, shape, threads, monkeypatch):
    """Training with every core busy elsewhere, at a fixed count of every core or at the count that
    follows the load (the default when neither n_threads nor RETRO_THREADS names one: each compute
    gets the cores no other task holds), ends with the parameters of an idle run at one thread."""
    with support.load(backend, model_path, trainable=False) as probe:
        ds = support.windows(4, shape.window, probe.n_vocab, seed + 7)
        ceiling = min(len(os.sched_getaffinity(0)), 16)

    def train(n_threads, counts):
        with support.load(backend, model_path) as model:
            ctx = retro.Context(
                model, n_ctx=shape.window, n_batch=shape.window, n_ubatch=shape.micro_batch, n_threads=n_threads
            )
            with ctx, retro.Trainer(ctx, optimizer=retro.AdamW(lr=1e-3), accumulation=2) as tr:
                tr.epoch(ds, progress=support.recording(counts, lambda _: ctx.threads_now))
                return model.parameters(), ctx.adaptive_threads

    alone, _ = train(1, [])
    counts: list[int] = []
    if threads == "adaptive":
        monkeypatch.delenv("RETRO_THREADS", raising=False)  # certification fixes the count; a user's run does not
    with busy_processes(seconds=60):  # every usable core
        loaded, adaptive = train(None if threads == "adaptive" else ceiling, counts)
    measure("threads", path=threads, ceiling=ceiling, counts=",".join(map(str, counts)))
    # the path ran: the count followed the load (fell below the ceiling), or stayed where it was fixed
    if threads == "adaptive":
        expect(
            "BASE-02",
            adaptive and (ceiling == 1 or min(counts) < ceiling),
            f"no micro-batch gave up a thread: {counts}",
        )
    else:
        expect("BASE-02", not adaptive and set(counts) == {ceiling}, f"a fixed count of {ceiling} moved: {counts}")
    with bound("BASE-02"):
        support.assert_params_equal(loaded, alone, backend, f"every core busy at threads={threads} vs idle at one")
    on_path(f"threads={threads}")


#: threads of the checking process kept busy: more than a machine running the certification runs
#: elsewhere, so that a reading that took them for others' stands out
OWN_BUSY = 8


def _runnable() -> tuple[int, int]:
    """(this process's runnable threads, the machine's runnable tasks), read here in Python from
    /proc/self/task (state R) and /proc/loadavg (its running/total field)."""
    own = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/stat", encoding="ascii", errors="replace") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended between the listing and the read
        own += stat[stat.rfind(")") + 2 : stat.rfind(")") + 3] == "R"
    with open("/proc/loadavg", encoding="ascii") as f:
        machine = int(f.read().split()[3].split("/")[0])
    return own, machine


@pytest.mark.clause("BASE-02")
@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="the governor reads /proc (Linux)")
@pytest.mark.parametrize("threads", ["own-busy"])
def test_the_load_following_count_does_not_take_its_own_threads_for_load(backend, threads):
    """The load-following count gives up a thread for each task runnable outside the process; the
    process's own busy threads (ggml's, spinning at a barrier, or a caller's) are not such tasks, or
    a busy process would starve itself of threads; and the tasks of others are, or it would keep
    threads others need. With eight threads of this process hashing and eight processes spinning
    elsewhere, the governor's reading of the tasks runnable elsewhere, taken between two readings
    of /proc made here (this process's runnable threads, the machine's runnable tasks), stays within
    half of eight of what those readings leave for others (a parallel check's load is others' too),
    either way, by the median of forty samples."""
    stop = threading.Event()

    def spin() -> None:
        block = bytes(1 << 20)  # hashlib hashes a block this size without the GIL
        while not stop.is_set():
            hashlib.sha256(block).digest()

    spinners = [threading.Thread(target=spin, daemon=True) for _ in range(OWN_BUSY)]
    for s in spinners:
        s.start()
    samples = []  # (own runnable, governor's elsewhere, elsewhere as read here)
    try:
        with busy_processes(OWN_BUSY, seconds=60):
            time.sleep(0.2)
            for _ in range(40):
                own, machine = _runnable()
                governor = runnable_elsewhere()
                own_after, machine_after = _runnable()
                samples.append((max(own, own_after), governor, min(machine, machine_after) - max(own, own_after)))
                time.sleep(0.005)
    finally:
        stop.set()
        for s in spinners:
            s.join()
    measure("threads", path=threads, samples=";".join(",".join(map(str, s)) for s in samples))
    expect("BASE-02", max(s[0] for s in samples) >= OWN_BUSY // 2, f"own busy threads not seen runnable: {samples}")
    expect(
        "BASE-02",
        statistics.median(elsewhere for *_, elsewhere in samples) >= OWN_BUSY // 2,
        f"the processes spinning elsewhere were not seen runnable: {samples}",
    )
    # by the median of the forty: one sample read while the other worker's threads came or went
    # must neither fail the intact run nor let a defect through
    excess = statistics.median(governor - max(elsewhere, 0) for _, governor, elsewhere in samples)
    expect("BASE-02", all(governor >= 0 for _, governor, _ in samples), f"a negative reading: {samples}")
    expect(
        "BASE-02",
        abs(excess) < OWN_BUSY // 2,
        f"the governor read {excess:+g} runnable tasks elsewhere against what ran there, by the median: "
        f"{'it took this process own busy threads for others' if excess > 0 else 'it missed the others'} "
        f"(own, governor, elsewhere): {samples}",
    )
    on_path(f"threads={threads}")


@pytest.mark.clause("BASE-03")
def test_parameters_read_back_equal_the_saved_model(backend, model_path, seed, shape, tmp_path):
    """After training, the parameters read through the binding equal the tensors of the saved GGUF
    (read by the gguf package, not the binding), and reloading that file reads back the same."""
    with support.load(backend, model_path) as model, support.context(model, shape) as ctx:
        ds = support.windows(2, shape.window, model.n_vocab, seed + 2)
        with retro.Trainer(ctx, optimizer=retro.AdamW(lr=1e-3)) as tr:
            tr.epoch(ds)
        read_back = model.parameters()
        saved = model.save(tmp_path / "trained.gguf")
    with bound("BASE-03"):
        support.assert_params_equal(
            read_back, support.file_tensors(saved), backend, "binding read-back vs the saved file"
        )
    with support.load(backend, saved) as reloaded, bound("BASE-03"):
        support.assert_params_equal(reloaded.parameters(), read_back, backend, "reloaded vs before saving")


#: AdamW's second moment against its first, as the update computes both (float32 squares)
ADAMW_SECOND_MOMENT = Bound("BASE-03 AdamW v vs (1 - b2) g^2, relative", 5e-6)
#: a step's parameters read back against numpy's update of the weights read before it (float32
#: rounding of the update, on weights of order 1)
STEP_READ_BACK = Bound(
    "BASE-03 step read back vs numpy's update, absolute",
    5e-7,
    cpu=5e-8,
    reason="lavapipe and the GPU-like server measure 6.0e-8, an ulp of a weight in [0.5, 1), where a GPU's "
    "AdamW divides and takes the root its own way: 8 ulps",
)


@pytest.mark.clause("BASE-03")
def test_optimizer_state_read_back_matches_the_step_taken(backend, model_path, seed, shape):
    """After one AdamW step from zero moments, with none of the options at its default, the
    moments and parameters read back satisfy the AdamW update as ggml computes it (numpy):
    m = (1-b1) g, v = (1-b2) g^2, w1 = w0 (1 - lr wd) - lr (m / (1 - b1)) / (sqrt(v / (1 - b2)) + eps)."""
    opt = retro.AdamW(lr=2e-3, beta1=0.8, beta2=0.95, eps=1e-4, weight_decay=0.25)
    with support.load(backend, model_path) as model, support.context(model, shape) as ctx:
        ds = support.windows(1, shape.window, model.n_vocab, seed + 3)
        w0 = model.parameters()
        with retro.Trainer(ctx, optimizer=opt) as tr:
            expect("BASE-03", tr.moments("output.weight") is None, "moments exist before the first step")
            expect("BASE-03", tr.epoch(ds).optimizer_steps == 1 and tr.iteration == 2, "one step, cursor 2")
            w1 = model.parameters()
            moments = {n: tr.moments(n) for n in w0}
    # w0 read back must be the file's tensors (read by the gguf package), or the relation proves nothing
    with bound("BASE-03"):
        support.assert_params_equal(w0, support.file_tensors(model_path), backend, "read-back vs the model file")
    trained = {n: mv for n, mv in moments.items() if mv is not None}
    expect("BASE-03", "token_embd.weight" not in trained, "token_embd.weight has moments")  # never trained upstream
    expect(
        "BASE-03",
        {"output.weight", "blk.0.attn_k.weight", f"blk.{shape.spec.n_layer - 1}.ffn_down.weight"} <= trained.keys(),
        f"moments missing: {sorted(trained)}",
    )
    for name, (m, v) in trained.items():
        with bound("BASE-03"):
            assert m.shape == w0[name].shape and v.shape == w0[name].shape, f"{name}: moment shapes"
            assert np.any(m != 0), f"{name}: all-zero first moment after a step"
        g = m / (1 - opt.beta1)
        second = (1 - opt.beta2) * g * g
        off = float(np.max(np.abs(v - second) / np.maximum(np.abs(second), 1e-30)))
        within("BASE-03", ADAMW_SECOND_MOMENT, f"{name}: v vs (1 - b2) g^2", off, "relative error")
        step = opt.lr * (m / (1 - opt.beta1)) / (np.sqrt(v / (1 - opt.beta2)) + opt.eps)
        decayed = w0[name] * (1 - opt.lr * opt.weight_decay)
        off = float(np.max(np.abs(w1[name] - (decayed - step))))
        within("BASE-03", STEP_READ_BACK, f"{name}: AdamW w1 vs numpy's", off, "absolute error")


@pytest.mark.clause("BASE-03")
def test_an_sgd_step_read_back_matches_numpy(backend, model_path, seed, shape):
    """One SGD step over an accumulation period of 2, with weight decay: the accumulated gradient
    read back (the mean over the period; the loss is scaled by 1/period) and the parameters satisfy
    w1 = w0 (1 - lr wd) - lr g, computed in numpy."""
    opt = retro.SGD(lr=0.05, weight_decay=0.5)
    # a window in two halves: the period of 2 is that one window
    with support.load(backend, model_path) as model, support.context(model, shape, n_ubatch=shape.window // 2) as ctx:
        ds = support.windows(1, shape.window, model.n_vocab, seed + 6)
        w0 = model.parameters()
        with retro.Trainer(ctx, optimizer=opt, accumulation=2) as tr:
            expect("BASE-03", tr.epoch(ds).optimizer_steps == 1, "one step expected")
            w1 = model.parameters()
            grads = {n: tr.gradient_accumulator(n) for n in w0}
    with bound("BASE-03"):  # w0 read back must be the file's tensors, or the relation proves nothing
        support.assert_params_equal(w0, support.file_tensors(model_path), backend, "read-back vs the model file")
    trained = {n: g for n, g in grads.items() if g is not None}
    last_ffn = f"blk.{shape.spec.n_layer - 1}.ffn_down.weight"  # the last layer's
    expect("BASE-03", {"output.weight", last_ffn} <= trained.keys(), f"accumulators: {sorted(trained)}")
    # (K and V get no gradient unless n_ubatch == n_ctx: a known limit of the pinned llama.cpp)
    expect("BASE-03", np.any(trained["output.weight"] != 0), "output.weight: zero gradient")
    for name, g in trained.items():
        expected = w0[name] * (1 - opt.lr * opt.weight_decay) - opt.lr * g
        off = float(np.max(np.abs(w1[name] - expected)))
        within("BASE-03", STEP_READ_BACK, f"{name}: SGD w1 vs numpy's", off, "absolute error")


#: per weight, the gradient accumulated over a period (read back) against numpy's, as
#: ||accumulated - numpy|| / ||numpy||: float32 compute against float64 in whole windows; in
#: micro-batches the KV cache holds the keys and values in f16 as well. A GPU's kernels reorder
#: float sums (and may use lower-precision products): their limit is wider than the CPU's.
GRADIENT_REL = {
    # lavapipe 5.3e-4; the GPU-like server 5.3e-7 (256 rows: F32 products, as cuBLAS's Sgemm)
    "whole windows": Bound(
        "BASE-01 gradient vs numpy in whole windows, relative", 5e-3, cpu=1e-5, measured={"rpc": (5e-6, "")}
    ),
    # lavapipe 1.4e-3; the GPU-like server 3.6e-4, the CPU's: the F16 KV cache rounds alike on both
    "micro-batches": Bound(
        "BASE-01 gradient vs numpy in micro-batches (f16 KV cache), relative",
        5e-3,
        cpu=2e-3,
        measured={"rpc": (2e-3, "")},
    ),
}
#: a step moves each weight by lr times its accumulated gradient: with lr 1 the CPU's w - lr * g
#: is numpy's to the bit
STEP_APPLIED = Bound(
    "BASE-01 step applied vs lr times the accumulator, absolute",
    1e-6,
    cpu=0.0,
    reason="a GPU may contract w - lr * g into one fused multiply-add, one rounding fewer than numpy's: up "
    "to an ulp of a weight of order 1 (1.2e-7; lavapipe and the GPU-like server measure 0), 8 ulps",
)


def _steps_against_numpy(backend, shape: Shape, model_path, seed, kind, head, n_ubatch, clauses):
    """Two SGD steps of an accumulation period of the profile's oracle_period windows each (2 at
    the tiny profile), one call per period: the
    gradient each step applied must be the mean of its period's gradients as numpy computes them
    (in float64, from the weights the step started from), asserted for `clauses`, and the step
    must move every weight by lr times it; each step is judged before the next is taken. In
    micro-batches shorter than the window (n_ubatch < n_ctx) the pinned llama.cpp trains through
    the KV cache, through which no gradient flows (the K and V projections get none): numpy's
    gradient is then taken with K and V held constant. The first step starts from the file's
    weights (BASE-03). Where the profile cannot afford numpy's whole gradient, its windows are the
    profile's oracle_window tokens and the gradients held to numpy's are the head's
    (reference.HEAD)."""
    lr, period = 1.0, shape.oracle_period
    heads = reference.read_heads(model_path)
    rng = np.random.default_rng(seed + 50)
    with support.load(backend, model_path) as model, support.context(model, shape, n_ubatch=n_ubatch) as ctx:
        n_vocab, n_ctx = model.n_vocab, ctx.n_ctx
        width = n_ctx if shape.whole_gradient or n_ubatch == n_ctx else shape.oracle_window
        targets = reference.random_targets(kind, 2 * period, width, n_vocab, rng)
        w0 = model.parameters()
        with bound("BASE-03"):  # the first step's start, read back, must be the file's tensors
            support.assert_params_equal(w0, support.file_tensors(model_path), backend, "read-back vs the model file")
        step = _Step(shape, f"{kind} targets, {head} head, n_ubatch {n_ubatch}", heads, n_ubatch < n_ctx, clauses)
        accumulation = period * (width // n_ubatch)
        with retro.Trainer(ctx, optimizer=retro.SGD(lr=lr), accumulation=accumulation, head=head) as tr:
            before = w0
            for i in range(2):
                windows = range(i * period, (i + 1) * period)
                tr.epoch(targets.dataset(slice(windows.start, windows.stop)))
                after = model.parameters()
                step.judge(
                    i, targets, windows, n_vocab, lr, before, after, {n: tr.gradient_accumulator(n) for n in after}
                )
                before = after
    on_path(f"kind={kind}")


@dataclass(frozen=True)
class _Step:
    """How _steps_against_numpy judges one step against numpy's gradient of its period."""

    shape: Shape
    what: str
    heads: dict
    cached_kv: bool  # micro-batches shorter than the context: K and V through the KV cache
    clauses: tuple[str, ...]

    def judge(self, i, targets, windows, n_vocab, lr, before, after, accumulators) -> None:
        # numpy's head gradient reads the float32 weights as float64 where it uses them
        start = {n: a.astype(np.float64) for n, a in before.items()} if self.shape.whole_gradient else before
        if self.shape.whole_gradient:
            grads = [
                reference.gradient(
                    start, targets.tokens[j], targets.rows(j, n_vocab), **self.heads, cached_kv=self.cached_kv
                )
                for j in windows
            ]
        else:
            grads = [
                reference.head_gradient(start, targets.tokens[j], targets.rows(j, n_vocab), **self.heads)
                for j in windows
            ]
        gradient = GRADIENT_REL["micro-batches" if self.cached_kv else "whole windows"]
        for name in sorted(before):
            moved = bool(np.any(before[name] != after[name]))
            if name in support.INPUT_LAYER:  # never trained by the pinned llama.cpp
                expect("BASE-01", not moved, f"step {i + 1}: {name} was trained")
                continue
            if name not in grads[0]:  # numpy's head gradient alone: the other weights unjudged
                continue
            want: np.ndarray = np.mean([g[name] for g in grads], axis=0)
            acc = accumulators[name]
            if not np.any(want):  # K and V through the KV cache: no gradient, no step
                for clause in self.clauses:
                    expect(
                        clause, not moved and (acc is None or not np.any(acc)), f"{self.what}: {name} got a gradient"
                    )
                continue
            with bound("BASE-03"):
                assert acc is not None, f"step {i + 1}: {name} has no gradient accumulator"
            if acc is None:
                continue
            off = float(np.max(np.abs(after[name] - (before[name] - lr * acc))))
            parts = {name: (acc, want)}
            if name == "output.weight":
                # the rows of the classes no target of the period names: their gradient is the
                # softmax's alone, which a target's own row buries under its label
                unnamed = np.setdiff1d(np.arange(n_vocab), targets.ids[windows.start : windows.stop])
                parts["output.weight, unnamed classes"] = (acc[unnamed], want[unnamed])
            for label, (got, expected) in parts.items():
                rel = float(np.linalg.norm(got - expected) / np.linalg.norm(expected))
                for clause in self.clauses:
                    within(
                        clause,
                        gradient,
                        f"{self.what}, step {i + 1}: {label}'s gradient",
                        rel,
                        "relative error from numpy's",
                    )
            for clause in self.clauses:
                within(
                    clause,
                    STEP_APPLIED,
                    f"{self.what}, step {i + 1}: {name} moved",
                    off,
                    "off lr times its gradient by",
                )


#: the paths of the numpy oracle's check, (kind, head, micro_batch); the weighted ones in parts run
#: at a real vocabulary too (the realistic profile: numpy's gradient of the head alone)
NUMPY_STEPS = [
    pytest.param(
        kind,
        head,
        micro_batch,
        marks=[pytest.mark.shapes("tiny", "realistic")] if (kind, micro_batch) == ("weighted", "part") else [],
    )
    for micro_batch in ("window", "part")
    for head in ("dense", "fused")
    for kind in ("token", "weighted")
]


@pytest.mark.clause("BASE-01", "BASE-03")
@pytest.mark.parametrize("kind, head, micro_batch", NUMPY_STEPS)
def test_each_step_applies_the_gradient_numpy_computes(backend, model_path, seed, shape, kind, head, micro_batch):
    """Each step applies its own period's gradient, as an oracle that shares nothing with ggml
    computes it (retro.testing.reference: the llama forward pass in numpy, differentiated by
    autograd), for token and weighted targets (weights 0, 0.5, 1 and 2) on both heads, in whole
    windows and in micro-batches of part of one; on every backend against numpy itself, not
    through the CPU. A wrong backward kernel or expansion, which every comparison of retro with
    retro, with upstream's loop or with the CPU would share, shows here. At a real tokenizer's
    vocabulary and width (the realistic profile), where the cross-entropy's and the products'
    kernels take their other paths, the head's gradient in closed form."""
    n_ubatch = shape.window if micro_batch == "window" else shape.micro_batch
    _steps_against_numpy(backend, shape, model_path, seed, kind, head, n_ubatch, ("BASE-01",))
    on_path(f"micro_batch={micro_batch}", f"head={head}", f"kind={kind}")


@pytest.mark.clause("BASE-01", "BASE-03", "HOST-08")
@pytest.mark.drives("kind=top-k")
@pytest.mark.parametrize("micro_batch", ["window", "part"])
@pytest.mark.parametrize("head", ["dense", "fused"])
def test_a_top_k_step_applies_the_gradient_of_the_summed_rows(backend, model_path, seed, shape, head, micro_batch):
    """Top-k targets (k 4) that repeat an id at every position, with rows summing to 1, to less
    and masked: each step applies numpy's gradient over the rows with the repeated ids' weights
    summed, on both heads (HOST-08), and that gradient is its own period's (BASE-01); in
    micro-batches of part of a window too, where each reads its own stretch of the k targets."""
    n_ubatch = shape.window if micro_batch == "window" else shape.micro_batch
    _steps_against_numpy(backend, shape, model_path, seed, "top-k", head, n_ubatch, ("BASE-01", "HOST-08"))
    on_path(f"micro_batch={micro_batch}", f"head={head}")
