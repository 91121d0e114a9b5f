"""Side-by-side benchmarks, measured in one run and printed as ratios: ``python -m retro.bench``.

- loop: retro's training loop against upstream's own ``llama_opt_epoch`` on the same library,
  trainer and data, alternating call by call (min and median over repetitions).
- load: the training time of each CPU thread policy with 0, 1 and 2 background processes
  spinning on the CPU, against the same policy unloaded, each policy in fresh processes (OpenMP
  reads its settings once, at load).

Writes JSON with ``--json``. Speed is measured here, never by timed tests.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

#: thread policies: the environment each runs under (on top of the caller's), and its thread count
POLICIES: dict[str, tuple[dict[str, str], int | None]] = {
    "OpenMP active wait, all cores": ({"OMP_WAIT_POLICY": "active"}, None),
    "OpenMP default wait, all cores": ({}, None),
    "OpenMP passive wait, all cores": ({"OMP_WAIT_POLICY": "passive"}, None),
    "OpenMP spin 100k, all cores": ({"GOMP_SPINCOUNT": "100000"}, None),
    "OpenMP spin 10k, all cores": ({"GOMP_SPINCOUNT": "10000"}, None),
    "OpenMP spin 1k, all cores": ({"GOMP_SPINCOUNT": "1000"}, None),
    "one thread": ({}, 1),
}

WORKLOAD = r"""
import json, sys, time, numpy as np, retro
path, threads, reps = sys.argv[1], (int(sys.argv[2]) or None), int(sys.argv[3])
with retro.Model.load(path, devices=[], trainable=True) as m, \
        retro.Context(m, n_ctx=256, n_ubatch=64, n_threads=threads) as c:
    stream = np.random.default_rng(0).integers(0, m.n_vocab, size=2 * 256 + 1)
    ds = retro.TokenDataset.from_tokens(stream, width=256)
    with retro.Trainer(c, optimizer=retro.AdamW()) as tr:
        tr.epoch(ds)  # warm-up
        out = []
        for _ in range(reps):
            t = time.perf_counter(); n = tr.epoch(ds).train_micro_batches
            out.append((time.perf_counter() - t) / n)
print(json.dumps(out))
"""

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


def under_load(model: Path, *, hogs: int, policy: str, reps: int) -> float:
    """Median seconds per micro-batch of `policy` while `hogs` processes spin."""
    extra, threads = POLICIES[policy]
    spinners = [subprocess.Popen([sys.executable, "-c", HOG, "600"]) for _ in range(hogs)]
    try:
        time.sleep(0.2 if hogs else 0)
        env = {**os.environ, **extra}
        env.pop("RETRO_THREADS", None)
        run = subprocess.run(
            [sys.executable, "-c", WORKLOAD, str(model), str(threads or 0), str(reps)],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        if run.returncode:
            raise RuntimeError(run.stderr[-2000:])
        return float(statistics.median(json.loads(run.stdout)))
    finally:
        for s in spinners:
            s.kill()
            s.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m retro.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--skip", action="append", default=[], choices=["loop", "load"])
    args = ap.parse_args(argv)
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
        if "load" not in args.skip:
            print("under load: ms per micro-batch with 0 / 1 / 2 spinning processes, and loaded / unloaded")
            load_rows: list[dict[str, object]] = []
            for policy in POLICIES:
                times = [under_load(model, hogs=h, policy=policy, reps=args.reps) for h in (0, 1, 2)]
                load_rows.append(
                    {
                        "policy": policy,
                        "s_per_micro_batch": times,
                        "ratio_1_hog": times[1] / times[0],
                        "ratio_2_hogs": times[2] / times[0],
                    }
                )
                print(
                    f"  {policy:32} {times[0] * 1e3:7.1f} {times[1] * 1e3:8.1f} {times[2] * 1e3:8.1f} ms   "
                    f"x{times[1] / times[0]:.2f} x{times[2] / times[0]:.2f}",
                    flush=True,
                )
            report["load"] = load_rows
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
