"""Side-by-side benchmarks, measured in one run and printed as ratios: ``python -m retro.bench``.

- loop: retro's training loop against upstream's own ``llama_opt_epoch`` on the same library,
  trainer and data, alternating call by call (min and median over repetitions).
- rebuild: where a training micro-batch spends its time (the fork's step timer): rebuilding the
  graph (forward build, backward expansion, allocation) against computing it, on the tiny model
  and a 6-layer, 256-wide one, on the CPU and every other device the build has.
- transactions: decode and generation with tensor transactions against the same context without
  them: one read-only selector with a handler, one retained without a handler, one mutable, and
  every layer's output retained; also while another Python thread keeps the interpreter busy
  (the ask phase and handler-less selectors never take the GIL).
- packed: packed windows against one document per window, on the same documents (mean length 32,
  256-token windows): physical tokens per logical token and logical tokens per second, alternating
  epoch by epoch.
- heads: the dense and the fused cross-entropy head on the same top-k targets (vocab 32768, k 8
  and 64, 256-token micro-batches): host label memory (read back from llama.cpp), each head's
  peak resident memory in a process of its own, and seconds per micro-batch, trainers alternating.
- soak: 10,000 training steps failed at every fault site in turn (a compute fault poisons its
  trainer, so each of those gets a new trainer): resident memory and the fork's live ggml
  contexts, backend buffers and buffer bytes before and after, after a warm-up round.
- load: the training time of each CPU thread policy with 0, 1 and 2 background processes
  spinning on the CPU, against the same policy unloaded; one process per policy (OpenMP reads its
  settings once, at load), taking turns epoch by epoch.
- release (with --release-site DIR, a release build pip-installed there with --target and
  RETRO_SEEDED_DEFECTS=OFF): its training time against this build's, one process each at the
  same thread count, taking turns epoch by epoch: what the seeded-defect switches cost.

Writes JSON with ``--json``. Speed is measured here, never by timed tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _child

if TYPE_CHECKING:
    import retro
    from retro.devices import Device

CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
DEFAULT_POLICY = "retro's default (free cores)"
BASELINE_POLICY = "OpenMP default wait, all cores"  # the default before the free-core policy
#: thread policies: the environment each runs under (on top of the caller's), and its thread count
#: (None: the Context's default, which follows the load). OpenMP's active wait is left out: its
#: idle workers never stop spinning, so it would load the machine while the other policies run.
POLICIES: dict[str, tuple[dict[str, str], int | None]] = {
    DEFAULT_POLICY: ({}, None),
    BASELINE_POLICY: ({}, CORES),
    "OpenMP passive wait, all cores": ({"OMP_WAIT_POLICY": "passive"}, CORES),
    "OpenMP spin 1k, all cores": ({"GOMP_SPINCOUNT": "1000"}, CORES),
    "one thread": ({}, 1),
}
#: targets: under load within LOADED_MAX of its own unloaded time; unloaded within UNLOADED_MAX of
#: the baseline
LOADED_MAX, UNLOADED_MAX = 2.0, 1.05

# one process per policy, answering each line on stdin with the ms per micro-batch of one epoch
WORKLOAD = r"""
import sys, time, numpy as np, retro
path, threads = sys.argv[1], (int(sys.argv[2]) or None)
from retro._native import hooks
with retro.Model.load(path, devices=[], trainable=True) as m, \
        retro.Context(m, n_ctx=256, n_ubatch=64, n_threads=threads) as c:
    stream = np.random.default_rng(0).integers(0, m.n_vocab, size=4 * 256 + 1)
    ds = retro.TokenDataset.from_tokens(stream, width=256)
    with retro.Trainer(c, optimizer=retro.AdamW()) as tr:
        tr.epoch(ds)  # warm-up
        print(f"ready seeded_defects={int(hooks.seeded_defects)}", flush=True)
        for _ in sys.stdin:
            t = time.perf_counter(); n = tr.epoch(ds).train_micro_batches
            print((time.perf_counter() - t) / n, flush=True)
"""

SECTIONS = ("loop", "rebuild", "transactions", "packed", "heads", "soak", "load", "release")

HOG = "import time\nend = time.monotonic() + float(__import__('sys').argv[1])\nwhile time.monotonic() < end: pass\n"


def _tiny_model(folder: Path) -> Path:
    from retro.testing import write_tiny_llama

    return write_tiny_llama(folder / "tiny.gguf")


def loop_overhead(model: Path, *, threads: int, n_ubatch: int, reps: int) -> dict[str, float]:
    """Seconds per epoch of retro's loop and of upstream's, alternating; their ratio."""
    import retro
    from retro.testing import upstream_epoch

    with (
        retro.Model.load(model, devices=[], trainable=True) as m,
        retro.Context(m, n_ctx=256, n_ubatch=n_ubatch, n_threads=threads) as c,
    ):
        stream = np.random.default_rng(1).integers(0, m.n_vocab, size=16 * 256 + 1)
        ds = retro.TokenDataset.from_tokens(stream, width=256)
        with retro.Trainer(c, optimizer=retro.AdamW(lr=1e-4), accumulation=256 // n_ubatch) as tr:
            tr.epoch(ds)
            ours, theirs = [], []
            for _ in range(reps):
                t = time.perf_counter()
                tr.epoch(ds)
                ours.append(time.perf_counter() - t)
                t = time.perf_counter()
                upstream_epoch(tr, ds)
                theirs.append(time.perf_counter() - t)
    return {
        "retro_s_min": min(ours),
        "upstream_s_min": min(theirs),
        "ratio_min": min(ours) / min(theirs),
        "ratio_median": statistics.median(ours) / statistics.median(theirs),
    }


#: the models the rebuild cost is measured on: the tests' tiny model, a 6-layer 256-wide one, and a
#: 12-layer narrow one (the deepest graph per FLOP, where rebuilding weighs most)
REBUILD_MODELS: dict[str, tuple[dict[str, Any], tuple[int, ...]]] = {
    "tiny (2 x 64)": ({}, (64, 256)),
    "6 x 256": ({"n_embd": 256, "n_layer": 6, "n_head": 4, "n_head_kv": 4, "n_ff": 768}, (64, 256)),
    "12 x 64": ({"n_layer": 12}, (32,)),
}
PHASES = ("staging_s", "graph_build_s", "backward_build_s", "alloc_s", "backward_alloc_s", "compute_s")
#: of a step's phases, the rebuild: forward build, backward expansion, allocation
REBUILD = ("graph_build_s", "backward_build_s", "alloc_s")


#: the accumulation periods the rebuild is measured at: where a hit once allocated again (> 1)
REBUILD_ACCUMULATIONS = (1, 2, 4)


def rebuild_cost(
    model: Path, *, device: Device | None, threads: int, n_ubatch: int, reps: int, accumulation: int = 1
) -> dict[str, dict[str, float]]:
    """Per micro-batch, the seconds of each phase of a training step (min over repetitions), the
    rebuild (forward build + backward expansion + allocation) and the whole step, with the
    packed-topology cache off and on: two trainers of one model, their epochs alternating, each
    epoch of 6 training windows and an evaluation tail of 2."""
    import retro
    from retro import _checks

    devices: list[Device] = [] if device is None else [device]
    stream = np.random.default_rng(2).integers(0, 512, size=8 * 256 + 1)
    ds = retro.TokenDataset.from_tokens(stream, width=256)
    per_rep: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    with (
        retro.Model.load(model, devices=devices, gpu_layers=-1, trainable=True) as m,
        retro.Context(m, n_ctx=256, n_ubatch=n_ubatch, n_threads=threads) as c,
    ):
        for rep in range(reps + 1):
            for cache in ("off", "on"):
                # the cache without a gate package: this measurement is part of the gate's evidence
                _checks.waive_topology_gate(cache == "on")
                try:
                    trainer = retro.Trainer(
                        c, optimizer=retro.AdamW(lr=1e-4), accumulation=accumulation, topology_cache=cache == "on"
                    )
                finally:
                    _checks.waive_topology_gate(False)
                with trainer as tr:
                    tr.epoch(ds, val_fraction=0.25)  # the first epoch builds (a miss) and warms up
                    metrics = tr.epoch(ds, val_fraction=0.25)
                if rep:
                    row = {ph: getattr(metrics, ph) / metrics.micro_batches for ph in PHASES}
                    row["rebuild_s"] = sum(row[ph] for ph in REBUILD)
                    row["step_s"] = row["staging_s"] + row["graph_build_s"] + row["backward_alloc_s"] + row["compute_s"]
                    per_rep[cache].append(row)
    out = {cache: {k: min(r[k] for r in rows) for k in rows[0]} for cache, rows in per_rep.items()}
    removed = [1 - on["rebuild_s"] / off["rebuild_s"] for off, on in zip(per_rep["off"], per_rep["on"], strict=True)]
    step = [on["step_s"] / off["step_s"] for off, on in zip(per_rep["off"], per_rep["on"], strict=True)]
    out["ratio"] = {
        "removed_median": statistics.median(removed),
        "removed_min": min(removed),
        "step_on_over_off_median": statistics.median(step),
        "rebuild_over_compute_off_median": statistics.median(r["rebuild_s"] / r["compute_s"] for r in per_rep["off"]),
    }
    return out


def rebuild_table(folder: Path, *, reps: int) -> list[dict[str, object]]:
    """On the CPU and every other device of the build, the RPC backend on a server of its own
    (with as many threads as the CPU rows use): per micro-batch on each, next to the CPU."""
    import contextlib

    import retro
    import retro.rpc

    print(
        "graph rebuild per micro-batch (forward build + backward expansion + allocation), packed-topology cache off and on"
    )
    with contextlib.ExitStack() as stack:
        if retro._native.rpc_built():
            server = stack.enter_context(retro.rpc.Server(threads=CORES))
            retro.rpc.connect(server.endpoint)
        backends: list[tuple[str, Device | None]] = [("CPU", None)]
        backends += [(f"{d.backend} {d.name}", d) for d in retro.devices() if d.kind != "cpu"]
        return _rebuild_rows(folder, backends, reps=reps)


def _rebuild_rows(folder: Path, backends: list[tuple[str, Device | None]], *, reps: int) -> list[dict[str, object]]:
    from retro.testing import TinyLlamaSpec, write_tiny_llama

    rows: list[dict[str, object]] = []
    for label, (spec, ubatches) in REBUILD_MODELS.items():
        path = write_tiny_llama(folder / f"rebuild-{len(rows)}.gguf", TinyLlamaSpec(**spec))
        for backend, device in backends:
            for n_ubatch, accumulation in itertools.product(ubatches, REBUILD_ACCUMULATIONS):
                r = rebuild_cost(
                    path, device=device, threads=CORES, n_ubatch=n_ubatch, reps=reps, accumulation=accumulation
                )
                rows.append(
                    {"model": label, "backend": backend, "n_ubatch": n_ubatch, "accumulation": accumulation, **r}
                )
                off, on, ratio = r["off"], r["on"], r["ratio"]
                print(
                    f"  {label:14} {backend:16} n_ubatch {n_ubatch:3} accumulation {accumulation}: "
                    f"rebuild off {off['rebuild_s'] * 1e3:6.3f} ms "
                    f"(build {off['graph_build_s'] * 1e3:.3f}, backward {off['backward_build_s'] * 1e3:.3f}, "
                    f"alloc {off['alloc_s'] * 1e3:.3f}) = {ratio['rebuild_over_compute_off_median']:.3f} of compute; "
                    f"cache on {on['rebuild_s'] * 1e3:6.3f} ms: removed {ratio['removed_median']:.1%} "
                    f"(min {ratio['removed_min']:.1%}); step on/off {ratio['step_on_over_off_median']:.3f}",
                    flush=True,
                )
    return rows


def _transaction_setups(profile: object, n_layer: int) -> dict[str, tuple[list[object], object]]:
    """(selectors, handler) of each measured configuration, by name."""
    from retro.transactions import Profile

    assert isinstance(profile, Profile)
    mid = f"l_out-{n_layer // 2}"

    def nothing(t: object) -> None:
        pass

    def steer(t: object) -> None:
        t.data += 0.0  # type: ignore[attr-defined]

    return {
        "one read-only selector, handler": ([profile.select(mid)], nothing),
        "one selector retained, no handler": ([profile.select(mid, retain=True)], None),
        "one mutable-f32 selector": ([profile.select(mid, access="mutable-f32")], steer),
        "every layer's output retained": (
            [profile.select(f"l_out-{i}", retain=True) for i in range(n_layer - 1)],
            None,
        ),
    }


def transaction_costs(model: Path, *, threads: int, reps: int, busy_interpreter: bool) -> dict[str, dict[str, float]]:
    """Seconds of a 64-token decode and of a 32-token greedy generation per configuration (min
    and median over repetitions, configurations alternating), and their ratios to no transactions."""
    import threading

    import retro
    from retro.transactions import Profile, TensorTransactions

    stop = threading.Event()

    def spin() -> None:  # a Python thread that wants the GIL all the time
        while not stop.is_set():
            pass

    with retro.Model.load(model, devices=[]) as m:
        profile = Profile.record(m)
        setups: dict[str, tuple[list[object], object]] = {"no transactions": ([], None)}
        setups.update(_transaction_setups(profile, m.n_layer))
        contexts = {}
        for name, (selectors, handler) in setups.items():
            tx = TensorTransactions(profile, selectors, handler, retained_limit=1 << 30) if selectors else None  # type: ignore[arg-type]
            contexts[name] = retro.Context(m, n_ctx=256, n_batch=64, n_ubatch=64, n_threads=threads, transactions=tx)
        prompt = np.random.default_rng(2).integers(0, m.n_vocab, size=64)
        times: dict[str, dict[str, list[float]]] = {n: {"decode": [], "generate": []} for n in setups}
        spinner = threading.Thread(target=spin, daemon=True)
        if busy_interpreter:
            spinner.start()
        try:
            for _ in range(reps + 1):  # the first round warms up
                for name, ctx in contexts.items():
                    ctx.reset()
                    t = time.perf_counter()
                    ctx.decode(prompt)
                    times[name]["decode"].append(time.perf_counter() - t)
                    ctx.reset()
                    t = time.perf_counter()
                    ctx.generate(prompt[:8], 32, stop_at_eog=False)
                    times[name]["generate"].append(time.perf_counter() - t)
                    ctx.drain_captures()
        finally:
            stop.set()
            for ctx in contexts.values():
                ctx.close()
    out: dict[str, dict[str, float]] = {}
    base = times["no transactions"]
    for name, measured in times.items():
        row: dict[str, float] = {}
        for what in ("decode", "generate"):
            runs, ref = measured[what][1:], base[what][1:]
            row[f"{what}_s_min"] = min(runs)
            row[f"{what}_ratio_min"] = min(runs) / min(ref)
            row[f"{what}_ratio_median"] = statistics.median(runs) / statistics.median(ref)
        out[name] = row
    return out


def transaction_table(folder: Path, *, reps: int) -> dict[str, object]:
    from retro.testing import TinyLlamaSpec, write_tiny_llama

    report: dict[str, object] = {}
    for label, (spec, _) in REBUILD_MODELS.items():
        model = write_tiny_llama(folder / f"tx-{len(report)}.gguf", TinyLlamaSpec(**spec))
        for busy in (False, True):
            key = f"{label}{', busy interpreter' if busy else ''}"
            rows = transaction_costs(model, threads=min(CORES, 2), reps=reps, busy_interpreter=busy)
            report[key] = rows
            print(f"tensor transactions, {key}: time / no transactions (min, median)")
            for name, r in rows.items():
                print(
                    f"  {name:36} decode 64 tokens x{r['decode_ratio_min']:.3f} x{r['decode_ratio_median']:.3f}"
                    f" ({r['decode_s_min'] * 1e3:.2f} ms)   generate 32 x{r['generate_ratio_min']:.3f}"
                    f" x{r['generate_ratio_median']:.3f} ({r['generate_s_min'] * 1e3:.1f} ms)",
                    flush=True,
                )
    return report


def _policy_worker(model: Path, policy: str) -> subprocess.Popen[str]:
    extra, threads = POLICIES[policy]
    env = {**os.environ, **extra}
    env.pop("RETRO_THREADS", None)
    return _epoch_worker(model, threads, env, policy)[0]


def _epoch_worker(
    model: Path, threads: int | None, env: dict[str, str], what: str, python: tuple[str, ...] = ()
) -> tuple[subprocess.Popen[str], bool]:
    """A process running WORKLOAD (`python` options before it), once it has said it is ready, and
    whether its build has the seeded-defect switches (its ready line says)."""
    proc = subprocess.Popen(
        _child.python(*python, "-c", WORKLOAD, str(model), str(threads or 0)),
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    ready = proc.stdout.readline().split()
    if not ready or ready[0] != "ready":
        _stop(proc)
        raise RuntimeError(f"the worker of {what!r} failed to start")
    return proc, ready[1] == "seeded_defects=1"


def _stop(worker: subprocess.Popen[str]) -> None:
    """Kill a worker, reap it and close its pipes."""
    worker.kill()
    worker.wait()
    for pipe in (worker.stdin, worker.stdout):
        if pipe is not None:
            pipe.close()


def _epoch_seconds(worker: subprocess.Popen[str]) -> float:
    """Seconds per micro-batch of one more epoch of that worker."""
    assert worker.stdin is not None and worker.stdout is not None
    worker.stdin.write("run\n")
    worker.stdin.flush()
    return float(worker.stdout.readline())


def under_load(model: Path, *, reps: int) -> dict[str, list[float]]:
    """Median seconds per micro-batch of each policy with 0, 1 and 2 processes spinning beside
    it. Policies take turns epoch by epoch (a rotating order), so every ratio compares runs made
    in the same machine state."""
    workers = {policy: _policy_worker(model, policy) for policy in POLICIES}
    times: dict[str, list[float]] = {policy: [] for policy in POLICIES}
    try:
        for hogs in (0, 1, 2):
            spinners = [subprocess.Popen(_child.python("-c", HOG, "900")) for _ in range(hogs)]
            samples: dict[str, list[float]] = {policy: [] for policy in POLICIES}
            try:
                time.sleep(0.3)
                order = list(POLICIES)
                for rep in range(reps):
                    for policy in order[rep % len(order) :] + order[: rep % len(order)]:
                        samples[policy].append(_epoch_seconds(workers[policy]))
                        time.sleep(0.05)  # the last policy's idle workers stop spinning
            finally:
                for sp in spinners:
                    sp.kill()
                    sp.wait()
            for policy, xs in samples.items():
                times[policy].append(statistics.median(xs))
    finally:
        for w in workers.values():
            _stop(w)
    return times


def load_table(model: Path, *, reps: int) -> dict[str, object]:
    """Each policy with 0, 1 and 2 hogs; the default's ratios against the targets."""
    print("under load: ms per micro-batch with 0 / 1 / 2 spinning processes, and loaded / unloaded")
    rows = under_load(model, reps=reps)
    for policy, times in rows.items():
        print(
            f"  {policy:34} {times[0] * 1e3:7.1f} {times[1] * 1e3:8.1f} {times[2] * 1e3:8.1f} ms   "
            f"x{times[1] / times[0]:.2f} x{times[2] / times[0]:.2f}",
            flush=True,
        )
    own = rows[DEFAULT_POLICY]
    loaded_ratio = max(own[1], own[2]) / own[0]
    unloaded_vs_baseline = own[0] / rows[BASELINE_POLICY][0]
    # against the fastest policy measured at each load: how much any other choice would gain
    vs_best = [own[h] / min(t[h] for t in rows.values()) for h in range(3)]
    meets = loaded_ratio <= LOADED_MAX and unloaded_vs_baseline <= UNLOADED_MAX
    print(
        f"  default: loaded/unloaded at most x{loaded_ratio:.2f} (target <= {LOADED_MAX}), "
        f"unloaded vs {BASELINE_POLICY} x{unloaded_vs_baseline:.3f} (target <= {UNLOADED_MAX}): "
        + ("meets the targets" if meets else "MISSES the targets"),
        flush=True,
    )
    print("  default vs the fastest policy at 0 / 1 / 2 busy processes: " + " ".join(f"x{r:.2f}" for r in vs_best))
    verdict = {
        "loaded_ratio_max": loaded_ratio,
        "unloaded_vs_baseline": unloaded_vs_baseline,
        "vs_best_policy": vs_best,
        "meets_targets": meets,
    }
    return {
        "s_per_micro_batch": {p: {"hogs_0": t[0], "hogs_1": t[1], "hogs_2": t[2]} for p, t in rows.items()},
        "default": verdict,
    }


def _documents(n_vocab: int, n: int, mean: int, seed: int = 5) -> list[np.ndarray]:
    """n documents of 2 to 2 * mean - 2 tokens (uniform: mean length `mean`)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, n_vocab, size=int(k), dtype=np.int32) for k in rng.integers(2, 2 * mean - 1, size=n)]


def packed_throughput(model: Path, *, threads: int | None, n_ubatch: int, reps: int) -> dict[str, float]:
    """The same documents packed first-fit into 256-token windows and one per window: physical
    tokens per logical token, and logical tokens per second (median epoch), epochs alternating."""
    import retro

    with retro.Model.load(model, devices=[], trainable=True) as m:
        docs = _documents(m.n_vocab, 256, 32)
        packed = retro.PackedDataset.pack(docs, width=256)
        alone = retro.PackedDataset(
            np.ascontiguousarray(np.stack([np.pad(d, (0, 256 - d.size)) for d in docs])),
            np.ascontiguousarray(
                np.stack([np.r_[np.zeros(d.size, np.int32), np.full(256 - d.size, -1, np.int32)] for d in docs])
            ),
        )
        seq = max(packed.sequences_needed(n_ubatch), 1)
        with (
            retro.Context(m, n_ctx=256, n_ubatch=n_ubatch, n_threads=threads, sequences=seq) as c,
            retro.Trainer(c, optimizer=retro.AdamW(lr=1e-4)) as tr,
        ):
            times: dict[str, list[float]] = {"packed": [], "alone": []}
            metrics = {}
            for rep in range(reps + 1):
                for name, ds in (("packed", packed), ("alone", alone)):
                    t = time.perf_counter()
                    metrics[name] = tr.epoch(ds)
                    if rep:  # the first round warms up
                        times[name].append(time.perf_counter() - t)
    out: dict[str, float] = {}
    for name in times:
        mt = metrics[name]
        out[f"{name}_physical_per_logical"] = mt.physical_tokens / mt.logical_tokens
        out[f"{name}_logical_tokens_per_s"] = mt.logical_tokens / statistics.median(times[name])
    out["speedup"] = out["packed_logical_tokens_per_s"] / out["alone_logical_tokens_per_s"]
    return out


def packed_table(model: Path, *, reps: int) -> list[dict[str, object]]:
    print("packed windows vs one document per window (256 documents, mean 32 tokens, 256-token windows)")
    rows: list[dict[str, object]] = []
    for n_ubatch in (64, 256):
        # the default thread policy (the free cores): a fixed count collapses on a loaded machine
        r = packed_throughput(model, threads=None, n_ubatch=n_ubatch, reps=reps)
        rows.append({"n_ubatch": n_ubatch, **r})
        print(
            f"  n_ubatch {n_ubatch:3}: physical/logical packed {r['packed_physical_per_logical']:.3f}, one per window "
            f"{r['alone_physical_per_logical']:.3f}; logical tokens/s packed {r['packed_logical_tokens_per_s']:.0f}, "
            f"one per window {r['alone_logical_tokens_per_s']:.0f}: x{r['speedup']:.2f}",
            flush=True,
        )
    return rows


HEADS_VOCAB = 32768


def _top_k_windows(n_vocab: int, k: int, n_windows: int = 4, seed: int = 6) -> retro.TopKDataset:
    import retro

    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, n_vocab, size=(n_windows, 256), dtype=np.int32)
    ids = rng.integers(0, n_vocab, size=(n_windows, 256, k), dtype=np.int32)
    weights = (rng.random(size=ids.shape, dtype=np.float32) / k).astype(np.float32)
    return retro.TopKDataset(tokens, ids, weights)


def head_peak(model: Path, head: str, k: int, epochs: int = 3) -> dict[str, float]:
    """One head alone in this process: its label arrays (read back from llama.cpp) and the
    process's peak resident memory after a few epochs; run in a child process per head."""
    import resource

    import retro
    from retro.testing import target_arrays

    ds = _top_k_windows(HEADS_VOCAB, k)
    with (
        retro.Model.load(model, devices=[], trainable=True) as m,
        retro.Context(m, n_ctx=256, n_ubatch=256) as c,
        retro.Trainer(c, optimizer=retro.SGD(lr=1e-3), head=head) as tr,
    ):
        for _ in range(epochs):
            tr.epoch(ds)
        labels = 4 * target_arrays(c).capacity
    # VmHWM: this process image's own peak (ru_maxrss would keep the forking parent's across exec)
    status = Path("/proc/self/status")
    hwm = next((ln for ln in status.read_text().splitlines() if ln.startswith("VmHWM:")), "") if status.exists() else ""
    peak = int(hwm.split()[1]) * 1024 if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"host_label_bytes": labels, "peak_rss_bytes": peak}


def heads_compare(model: Path, k: int, *, reps: int) -> dict[str, float]:
    """The dense and the fused head on the same top-k windows (vocab 32768, 256-token
    micro-batches): seconds per micro-batch (median epoch, trainers alternating), label memory and
    the peak resident memory of a process training with that head alone."""
    import retro

    ds = _top_k_windows(HEADS_VOCAB, k)
    times: dict[str, list[float]] = {"dense": [], "fused": []}
    with retro.Model.load(model, devices=[], trainable=True) as m, retro.Context(m, n_ctx=256, n_ubatch=256) as c:
        for rep in range(reps + 1):
            for head in times:
                with retro.Trainer(c, optimizer=retro.SGD(lr=1e-3), head=head) as tr:
                    t = time.perf_counter()
                    mt = tr.epoch(ds)
                    if rep:  # the first round warms up
                        times[head].append((time.perf_counter() - t) / mt.train_micro_batches)
    out: dict[str, float] = {}
    for head in times:
        code = f"import json, sys; from retro.bench import head_peak; print(json.dumps(head_peak(sys.argv[1], {head!r}, {k})))"
        run = subprocess.run(_child.python("-c", code, str(model)), capture_output=True, text=True, check=True)
        peak = json.loads(run.stdout.strip().splitlines()[-1])
        out[f"{head}_s_per_micro_batch"] = statistics.median(times[head])
        out[f"{head}_host_label_bytes"] = peak["host_label_bytes"]
        out[f"{head}_peak_rss_bytes"] = peak["peak_rss_bytes"]
    out["label_memory_ratio"] = out["fused_host_label_bytes"] / out["dense_host_label_bytes"]
    out["peak_rss_ratio"] = out["fused_peak_rss_bytes"] / out["dense_peak_rss_bytes"]
    out["speedup"] = out["dense_s_per_micro_batch"] / out["fused_s_per_micro_batch"]
    return out


def heads_table(folder: Path, *, reps: int) -> list[dict[str, object]]:
    from retro.testing import TinyLlamaSpec, write_tiny_llama

    model = write_tiny_llama(folder / "vocab32k.gguf", TinyLlamaSpec(n_vocab=HEADS_VOCAB, seed=3))
    print(f"dense vs fused cross-entropy head (top-k targets, vocab {HEADS_VOCAB}, n_ubatch 256)")
    rows: list[dict[str, object]] = []
    for k in (8, 64):
        r = heads_compare(model, k, reps=reps)
        rows.append({"k": k, **r})
        print(
            f"  k {k:2}: host label memory fused/dense {r['label_memory_ratio']:.4f} "
            f"({r['fused_host_label_bytes'] / 2**20:.2f} vs {r['dense_host_label_bytes'] / 2**20:.1f} MiB), "
            f"peak RSS {r['peak_rss_ratio']:.3f} ({r['fused_peak_rss_bytes'] / 2**20:.0f} vs "
            f"{r['dense_peak_rss_bytes'] / 2**20:.0f} MiB); s per micro-batch fused {r['fused_s_per_micro_batch'] * 1e3:.0f} "
            f"ms, dense {r['dense_s_per_micro_batch'] * 1e3:.0f} ms: x{r['speedup']:.2f}",
            flush=True,
        )
    return rows


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _live() -> tuple[int, int, int]:
    """(ggml contexts, backend buffers, bytes in live buffers) alive in this process."""
    from retro import _native

    contexts, buffers = _native.live_allocations()
    return contexts, buffers, sum(b for _, b in _native.live_buffer_bytes())


def _trim_heap() -> None:
    """Hand the C heap's free pages back (glibc keeps them otherwise): what stays resident after
    it is held, not cached."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name and hasattr(ctypes.CDLL(name), "malloc_trim"):
        ctypes.CDLL(name).malloc_trim(0)


@dataclasses.dataclass
class Soak:
    failed_steps: int
    per_site: dict[str, int]
    seconds: float
    rss_growth_bytes: int
    rss_growth_trimmed_bytes: int  # once the C heap handed its free pages back
    live_before: tuple[int, int, int]  # (ggml contexts, backend buffers, buffer bytes)
    live_after: tuple[int, int, int]


def soak(model: Path, *, steps: int) -> Soak:
    """`steps` failed training steps, shared out over the fault sites: each site fails the first
    hit of a fresh arming, round after round, so that every site's failure repeats many times."""
    import retro

    from ._native import hooks  # the fault sites' native door: the library never imports its harness

    per_site = {site: 0 for site in hooks.sites()}
    with (
        retro.Model.load(model, devices=[], trainable=True) as m,
        retro.Context(m, n_ctx=256, n_ubatch=256) as c,
    ):
        one = retro.TokenDataset.from_tokens(np.arange(257) % m.n_vocab, width=256)
        fused = retro.TopKDataset(
            one.tokens, one.labels[:, :, None].copy(), np.ones((*one.labels.shape, 1), dtype=np.float32)
        )

        def fail_once(site: str) -> None:
            head = "fused" if site == "fused_head" else "dense"
            with retro.Trainer(c, head=head) as tr:
                hooks.arm(site, 1, False)
                try:
                    tr.epoch(fused if head == "fused" else one)
                except retro.TrainingError:
                    pass
                finally:
                    hooks.reset()
                if site != "compute":  # the trainer is usable: one good step on it
                    tr.epoch(fused if head == "fused" else one)

        def round_() -> None:
            for site in hooks.sites():
                fail_once(site)
                per_site[site] += 1

        for _ in range(3):  # warm-up: caches, allocator pools and lazily built state settle
            round_()
        per_site = dict.fromkeys(per_site, 0)
        _trim_heap()
        rss0, live0 = _rss_bytes(), _live()
        t = time.perf_counter()
        while sum(per_site.values()) < steps:
            round_()
        seconds = time.perf_counter() - t
        rss1, live1 = _rss_bytes(), _live()
        _trim_heap()
        rss1_trimmed = _rss_bytes()
    return Soak(sum(per_site.values()), per_site, seconds, rss1 - rss0, rss1_trimmed - rss0, live0, live1)


def soak_table(model: Path, *, steps: int = 10_000) -> dict[str, object]:
    print(f"soak: {steps} training steps failed at every fault site in turn")
    r = soak(model, steps=steps)
    (c0, b0, n0), (c1, b1, n1) = r.live_before, r.live_after
    print(
        f"  {r.failed_steps} failed steps in {r.seconds:.0f} s: resident memory "
        f"{r.rss_growth_bytes / 2**20:+.2f} MiB ({r.rss_growth_trimmed_bytes / 2**20:+.2f} MiB once the C heap "
        f"is trimmed); live ggml contexts {c0} -> {c1}, backend buffers {b0} -> {b1}, buffer bytes {n0} -> {n1}",
        flush=True,
    )
    return dataclasses.asdict(r)


def release_compare(model: Path, release_site: Path, *, reps: int) -> dict[str, float]:
    """Seconds per micro-batch of this build and of the release build at release_site, one
    process each at 2 threads, taking turns epoch by epoch. The release one runs under python -S
    (no .pth files: an editable install's import hook never loads) with release_site on its path
    and, beside it, numpy alone (a site-packages folder may hold backports that shadow the
    standard library)."""
    threads = {"RETRO_THREADS": "2", "OMP_NUM_THREADS": "2"}
    with tempfile.TemporaryDirectory() as view:
        site = Path(np.__file__).resolve().parents[1]
        for name in ("numpy", "numpy.libs"):
            if (site / name).exists():
                (Path(view) / name).symlink_to(site / name)
        release_env = {**os.environ, **threads, "PYTHONPATH": os.pathsep.join([str(release_site), view])}
        workers: dict[str, subprocess.Popen[str]] = {}
        try:
            for name, env, python in (
                ("this build", {**os.environ, **threads}, ()),
                ("release", release_env, ("-S",)),
            ):
                workers[name], seeded = _epoch_worker(model, 2, env, name, python)
                if seeded != (name == "this build"):
                    raise RuntimeError(f"{name}: {'a' if seeded else 'no'} build with seeded-defect switches")
            samples: dict[str, list[float]] = {name: [] for name in workers}
            for rep in range(reps):
                for name in list(workers)[rep % 2 :] + list(workers)[: rep % 2]:
                    samples[name].append(_epoch_seconds(workers[name]))
        finally:
            for w in workers.values():
                _stop(w)
    ours, release = samples["this build"], samples["release"]
    return {
        "this_build_s_median": statistics.median(ours),
        "release_s_median": statistics.median(release),
        "ratio_min": min(release) / min(ours),
        "ratio_median": statistics.median(release) / statistics.median(ours),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m retro.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--skip", action="append", default=[], choices=[*SECTIONS])
    ap.add_argument("--only", action="append", default=[], choices=[*SECTIONS], help="run these sections alone")
    ap.add_argument("--release-site", type=Path, default=None, help="a release build installed there (pip --target)")
    args = ap.parse_args(argv)
    if args.only:
        args.skip = [name for name in SECTIONS if name not in args.only]
    report: dict[str, object] = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "platform": platform.platform(),
    }
    with tempfile.TemporaryDirectory() as tmp:
        model = _tiny_model(Path(tmp))
        if "loop" not in args.skip:
            print("loop overhead: retro's epoch / upstream's llama_opt_epoch (same library, trainer, data)")
            rows: list[dict[str, object]] = []
            for threads in (1, 2):
                for n_ubatch in (64, 256):
                    r = loop_overhead(model, threads=threads, n_ubatch=n_ubatch, reps=args.reps)
                    rows.append({"threads": threads, "n_ubatch": n_ubatch, **r})
                    print(
                        f"  {threads} thread(s), n_ubatch {n_ubatch:3}: ratio min {r['ratio_min']:.3f}, "
                        f"median {r['ratio_median']:.3f} ({r['retro_s_min'] * 1e3:.0f} vs {r['upstream_s_min'] * 1e3:.0f} ms)",
                        flush=True,
                    )
            report["loop"] = rows
        if "rebuild" not in args.skip:
            report["rebuild"] = rebuild_table(Path(tmp), reps=args.reps)
        if "transactions" not in args.skip:
            report["transactions"] = transaction_table(Path(tmp), reps=args.reps)
        if "packed" not in args.skip:
            report["packed"] = packed_table(model, reps=args.reps)
        if "heads" not in args.skip:
            report["heads"] = heads_table(Path(tmp), reps=args.reps)
        if "soak" not in args.skip:
            report["soak"] = soak_table(model)
        if "load" not in args.skip:
            report["load"] = load_table(model, reps=args.reps)
        if "release" not in args.skip and args.release_site is not None:
            print("release build / this build: ms per micro-batch, 2 threads (the seeded-defect switches' cost)")
            r = release_compare(model, args.release_site, reps=args.reps)
            print(
                f"  ratio min {r['ratio_min']:.3f}, median {r['ratio_median']:.3f} "
                f"({r['release_s_median'] * 1e3:.1f} vs {r['this_build_s_median'] * 1e3:.1f} ms)",
                flush=True,
            )
            report["release"] = r
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
