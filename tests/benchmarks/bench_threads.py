"""Side-by-side benchmark: ggml CPU threading variants under the thread layouts tests and CI use.

Each variant is a retro build (the installed one, or a folder made with
`pip install --target DIR -Ccmake.define.RETRO_OPENMP=ON .`); each layout runs the same training
workload in 1 or 2 concurrent processes with a given ggml thread count. Variants alternate within
every repetition, so the ratios come from one run on one machine state.

    python tests/benchmarks/bench_threads.py --variant pool= --variant openmp=/tmp/retro-openmp
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

WORKLOAD = r"""
import json, sys, time, numpy as np, retro
path, threads = sys.argv[1], int(sys.argv[2])
with retro.Model.load(path, devices=[], trainable=True) as m, retro.Context(m, n_ctx=256, n_ubatch=64, n_threads=threads) as c:
    stream = np.random.default_rng(0).integers(0, m.n_vocab, size=2 * 256 + 1)
    ds = retro.TokenDataset.from_tokens(stream, width=256)
    with retro.Trainer(c, optimizer=retro.AdamW()) as tr:
        tr.epoch(ds)  # warm-up
        t = time.perf_counter(); n = tr.epoch(ds).train_micro_batches
        print(json.dumps({"s_per_micro_batch": (time.perf_counter() - t) / n}))
"""

LAYOUTS = [
    ("1 process x 2 threads", 1, 2),
    ("2 processes x 2 threads", 2, 2),
    ("2 processes x 1 thread", 2, 1),
    ("1 process x 4 threads", 1, 4),
]


def env_for(site: str) -> tuple[list[str], dict]:
    if not site:
        return [sys.executable], dict(os.environ)
    paths = [site, sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    return [sys.executable, "-S"], dict(os.environ, PYTHONPATH=os.pathsep.join(paths))


def run_layout(site: str, model: Path, procs: int, threads: int) -> float:
    exe, env = env_for(site)
    ps = [
        subprocess.Popen([*exe, "-c", WORKLOAD, str(model), str(threads)], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(procs)
    ]
    outs = [p.communicate()[0] for p in ps]
    if any(p.returncode for p in ps):
        raise RuntimeError(f"workload failed for {site or 'installed'}")
    return max(json.loads(o)["s_per_micro_batch"] for o in outs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", action="append", required=True, help="NAME=SITE_DIR (empty: the installed build)")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    variants = dict(v.split("=", 1) for v in args.variant)
    from retro.testing import write_tiny_llama

    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_llama(Path(tmp) / "tiny.gguf")
        times = {(name, layout): [] for name in variants for layout, _, _ in LAYOUTS}
        for _ in range(args.repeats):
            for layout, procs, threads in LAYOUTS:
                for name, site in variants.items():
                    times[(name, layout)].append(run_layout(site, model, procs, threads))
                    print(
                        f"  {name:10} {layout:26} {times[(name, layout)][-1] * 1e3:9.2f} ms",
                        file=sys.stderr,
                        flush=True,
                    )
    names = list(variants)
    print(
        f"cores: {len(os.sched_getaffinity(0))}; median ms per micro-batch (64 tokens, AdamW) over {args.repeats} runs"
    )
    print("| layout | " + " | ".join(names) + (f" | {names[1]}/{names[0]} |" if len(names) == 2 else " |"))
    print("|---|" + "---|" * (len(names) + (len(names) == 2)))
    for layout, _, _ in LAYOUTS:
        med = [statistics.median(times[(n, layout)]) * 1e3 for n in names]
        ratio = f" | {med[1] / med[0]:.2f}" if len(names) == 2 else ""
        print(f"| {layout} | " + " | ".join(f"{m:.2f}" for m in med) + ratio + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
