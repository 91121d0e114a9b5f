"""A backend's first use, made before its checks run: the kernels a driver compiles on first use
are compiled here, once, into its own cache, and not inside a check.

Mesa's lavapipe compiles every Vulkan pipeline through LLVM when it is first used and keeps the
result in its shader cache: from a cold cache a tiny model's first decode took 55 s and its first
epoch 79 s on two cores, 0.2 s and 0.6 s once cached. A check that starts a child interpreter with a
deadline (TX-OWN-03, TX-OWN-04) could run into that compile on a fresh machine and fail for want of
time, not of a contract. The warm-up runs in a child interpreter of its own, as the checks do, with
the run's environment; what it computes is not evidence, and its time is recorded in the run
(`warm_up_s`). Run as ``python -m retro.conformance.warm_up BACKEND FOLDER [SHAPES]`` (--shape's
value; the default profile when left out)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import retro
from retro import _child

from . import shapes, support
from .backends import discover
from .shapes import Shape


def _workload(backend_name: str, folder: Path, shape: Shape) -> None:
    """The operations of the checks at the sizes they use: a device may pick (and compile) a kernel
    per size, such as Vulkan's matrix-vector kernel per column count up to 8. Decodes of 1 to 9
    and 16 tokens, a micro-batch and a window, a generation, and training on each head with an
    evaluation tail at a micro-batch and a window, and on packed documents, on the profile's model."""
    backend = discover()[backend_name]
    folder.mkdir(parents=True, exist_ok=True)
    path = support.model_file(folder, 0, shape)
    window = shape.window
    with support.load(backend, path) as model:
        dense = support.windows(2, window, model.n_vocab, 0)
        for n_ubatch in (shape.micro_batch, window):
            with support.context(model, shape, n_ubatch=n_ubatch) as ctx:
                for n in (*range(1, 10), 16, shape.micro_batch, window):
                    ctx.reset()
                    ctx.decode(np.arange(n, dtype=np.int32) % model.n_vocab)
                ctx.reset()
                ctx.generate([1, 2, 3], 4)
                ctx.reset()
                for head in ("dense", "fused"):
                    with retro.Trainer(ctx, optimizer=retro.AdamW(lr=1e-3), head=head) as trainer:
                        trainer.epoch(dense, val_fraction=0.5)
        with support.context(model, shape, n_ubatch=shape.micro_batch, sequences=4) as ctx:
            tokens = np.arange(window * 3 // 2, dtype=np.int32) % model.n_vocab
            cuts = (window * 3 // 8, window * 15 // 16)  # three documents over two windows
            packed = retro.PackedDataset.pack(
                [tokens[: cuts[0]], tokens[cuts[0] : cuts[1]], tokens[cuts[1] :]], width=window
            )
            with retro.Trainer(ctx, optimizer=retro.SGD(lr=1e-3)) as trainer:
                trainer.epoch(packed)


def warm(backend_name: str, folder: Path, shape_names: str, env: dict[str, str], timeout_s: float) -> tuple[float, str]:
    """Run the workload at each profile of `shape_names` (--shape's value) on the backend in a child interpreter, killed after timeout_s (a hung
    driver must not hold the run): its wall time in seconds, and how it failed ("" when it did
    not). A failure is not a verdict: the checks meet the same fault and report it as theirs; the
    caller says that the kernels were left to them."""
    start = time.monotonic()
    try:
        done = subprocess.run(
            _child.python("-m", "retro.conformance.warm_up", backend_name, str(folder), shape_names),
            env=env,
            capture_output=True,
            text=True,
            errors="replace",
            check=False,
            timeout=timeout_s,
        )
        failure = "" if done.returncode == 0 else f"exit {done.returncode}: {done.stderr.strip()[-400:]}"
    except subprocess.TimeoutExpired:
        failure = f"killed after {timeout_s:g} s"
    return round(time.monotonic() - start, 1), failure


if __name__ == "__main__":
    for profile in shapes.parse(sys.argv[3] if len(sys.argv) > 3 else None):
        _workload(sys.argv[1], Path(sys.argv[2]), profile)
