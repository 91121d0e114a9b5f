"""What conformance checks share: models and contexts on the backend under test, data, and
parameter comparison (bitwise on a backend whose runs repeat to the bit, a tolerance elsewhere)."""

from __future__ import annotations

import contextlib
import gc
import logging
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np

import retro
from retro import _native_logs
from retro._threads import default_threads
from retro.testing import write_tiny_llama

from . import backends, evidence, registry
from .backends import Backend
from .shapes import Shape

# two runs on a backend not known to repeat to the bit (CUDA), as numpy's allclose reads them: the
# bound is on |actual - expected| / (atol + rtol |expected|), the largest over the elements
GPU_RTOL, GPU_ATOL = 1e-4, 1e-6
CLOSE = evidence.Bound(
    "tensors equal on a backend not known to repeat: |a - e| / (1e-6 + 1e-4 |e|)",
    1.0,
    reason="CUDA's run-to-run spread is not measured yet (no GPU run since the first H200 run): numpy's "
    "allclose at rtol 1e-4 until it is; the backends measured to repeat bitwise are held so (backends.REPEATABLE)",
)


def model_file(folder: Path, seed: int, shape: Shape, **overrides: Any) -> Path:
    """The model of `shape`'s profile for `seed` (with `overrides` of its spec), written once into `folder`."""
    path = folder / f"{shape.name}-{seed}-{'-'.join(f'{k}{v}' for k, v in sorted(overrides.items()))}.gguf"
    if not path.exists():
        write_tiny_llama(path, shape.model_spec(seed, **overrides))
    return path


#: weights llama.cpp keeps on the CPU whatever the offload (the input layer: a row lookup)
INPUT_LAYER = frozenset({"token_embd.weight"})
CPU = Backend("cpu", True)  # the oracle


def load(backend: Backend, path: Path, *, trainable: bool = True, gpu_layers: int = -1) -> retro.Model:
    """The model on the backend under test: every layer by default, `gpu_layers` of them when
    given (0: the backend's devices present, the weights on the CPU); the CPU alone for "cpu"."""
    offload = backend.offload_devices
    if registry.seeded("HARNESS-01"):
        offload = []  # seeded defect: the backend under test silently falls back to the CPU
    return retro.Model.load(path, devices=offload, gpu_layers=gpu_layers if offload else 0, trainable=trainable)


def placement(model: retro.Model, backend: Backend) -> tuple[list[tuple[str, str]], int, int]:
    """Where a model is: its weights on no device of the backend (the input layer aside, which
    llama.cpp keeps on the CPU), and how many nodes of a decode's graph the backend computes (the
    device of the buffer the scheduler gave each node's output), of how many."""
    from retro import _native

    wanted = backend.device_names
    placed = {n: d for n, d in model.tensor_devices().items() if n not in INPUT_LAYER}
    nodes = [device for _, _, _, _, device in _native.probe_graph(model._h, 8, 8, 1)]
    return sorted((n, d) for n, d in placed.items() if d not in wanted), sum(d in wanted for d in nodes), len(nodes)


def not_on(model: retro.Model, backend: Backend) -> str:
    """Why the model is not on the backend under test ("" when it is: every weight on its devices,
    most of a decode's nodes computed there). A check in a child interpreter proves with it that
    the backend it was asked for is the one it ran on, not the CPU a missing device falls back to."""
    if not backend.available:
        return f"{backend.name} is not available here ({backend.reason})"
    elsewhere, here, nodes = placement(model, backend)
    if elsewhere:
        return f"weights not on {backend.name}: {elsewhere[:4]}"
    if here * 2 <= nodes:
        return f"{here} of {nodes} nodes of a decode computed on {backend.name}"
    return ""


def raised(fn: Callable[[], object]) -> BaseException | None:
    """What a call raised (None: it returned): the checks of refused inputs judge the exception."""
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the check judges what was raised
        return err
    return None


@contextlib.contextmanager
def native_warnings() -> Iterator[list[str]]:
    """The warning and error lines llama.cpp and ggml log while the block runs: their own record
    of what they had to correct or refuse (forwarded to the `retro.native` logger)."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage().strip())

    logger, keep = logging.getLogger("retro.native"), Keep(logging.WARNING)
    logger.addHandler(keep)
    try:
        yield lines
    finally:
        _native_logs.drain()  # what a call that does not forward its lines left queued
        logger.removeHandler(keep)


def hostile(value: object) -> Any:
    """A value of a type the API does not take, passed on purpose: the check is that it is refused."""
    return value


#: checks run at a fixed CPU thread count, never the load-following default: ggml splits the
#: cross-entropy loss's sum across threads, so a run whose thread count changed with the machine's
#: load reports a loss that differs in the last bits from an oracle run at another count
#: (parameters are bitwise equal either way: measured at 1 and 2 threads)
CHECK_THREADS = default_threads()[0]


def context(
    model: retro.Model,
    shape: Shape,
    *,
    n_ctx: int | None = None,
    n_ubatch: int | None = None,
    n_threads: int | None = None,
    sequences: int = 1,
) -> retro.Context:
    """A training context of `shape`'s profile: n_ctx and n_batch one window unless given, n_ubatch n_ctx unless given."""
    threads = CHECK_THREADS if n_threads is None else n_threads
    n_ctx = shape.window if n_ctx is None else n_ctx
    n_ubatch = n_ctx if n_ubatch is None else n_ubatch
    return retro.Context(model, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ubatch, n_threads=threads, sequences=sequences)


def windows(n_windows: int, width: int, n_vocab: int, seed: int) -> retro.TokenDataset:
    """Random next-token windows: a stream of n_windows * width + 1 tokens, cut without overlap."""
    stream = np.random.default_rng(seed).integers(0, n_vocab, size=n_windows * width + 1)
    return retro.TokenDataset.from_tokens(stream, width=width)


def recording(into: list, what: Callable[[retro.Progress], object] | None = None) -> Callable[[retro.Progress], bool]:
    """A progress callback that never stops the epoch and appends each report (or what(report))."""

    def progress(p: retro.Progress) -> bool:
        into.append(p if what is None else what(p))
        return True

    return progress


def every_micro_batch(n: int) -> range:
    """1..n: the points of a sweep over an epoch of n micro-batches, each one, never a sample
    (HARNESS-03)."""
    return range(1, n if registry.seeded("HARNESS-03") else n + 1)  # seeded defect: the last one left out


def subset(ds: retro.TokenDataset, rows: slice | list[int]) -> retro.TokenDataset:
    return retro.TokenDataset(np.ascontiguousarray(ds.tokens[rows]), np.ascontiguousarray(ds.labels[rows]))


def assert_params_equal(
    actual: dict[str, np.ndarray], expected: dict[str, np.ndarray], backend: Backend, what: str
) -> None:
    assert actual.keys() == expected.keys(), f"{what}: different tensor sets"
    for name in expected:
        a, e = actual[name], expected[name]
        assert a.shape == e.shape, f"{what}: {name} has shape {a.shape}, expected {e.shape}"
        if backends.repeatable(backend.name):  # the same bits, run after run (backends.REPEATABLE)
            bad = np.flatnonzero(a.view(np.uint32) != e.view(np.uint32))
            assert bad.size == 0, (
                f"{what}: {name} differs bitwise in {bad.size} of {a.size} elements "
                f"(first at {bad[0]}: {a.flat[bad[0]]!r} vs {e.flat[bad[0]]!r})"
            )
        else:
            _assert_close(a, e, f"{what}: {name}")


def assert_close(actual: np.ndarray, expected: np.ndarray, backend: Backend, what: str) -> None:
    """Equal bitwise on a backend whose runs repeat to the bit (backends.REPEATABLE), within CLOSE
    elsewhere."""
    if backends.repeatable(backend.name):
        assert np.array_equal(actual, expected), f"{what}: {actual!r} vs {expected!r}"
    else:
        _assert_close(np.asarray(actual), np.asarray(expected), what)


def _assert_close(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape}, expected {expected.shape}"
    ratio = np.abs(actual.astype(np.float64) - expected) / (GPU_ATOL + GPU_RTOL * np.abs(expected.astype(np.float64)))
    worst = float("inf") if np.isnan(ratio).any() else float(ratio.max(initial=0.0))  # a NaN is never close
    limit = evidence.held(CLOSE, what, worst)
    assert worst <= limit, f"{what}: {worst:.3g} times numpy's allclose tolerance (rtol {GPU_RTOL}, atol {GPU_ATOL})"


def released(refs: dict[str, weakref.ref]) -> list[str]:
    """The names whose objects outlive a garbage collection: what something still holds."""
    gc.collect()
    return [name for name, ref in refs.items() if ref() is not None]


def saved(model: retro.Model, path: Path) -> Path:
    """The model's parameters as they are now, in a GGUF file: for an oracle that reloads them."""
    model.save(path)
    return path


def changed(before: dict[str, np.ndarray], after: dict[str, np.ndarray]) -> set[str]:
    return {n for n in before if not np.array_equal(before[n], after[n])}


def file_tensors(path: Path) -> dict[str, np.ndarray]:
    """The f32 tensors of a GGUF file as the gguf package reads them (independent of the binding)."""
    out = {}
    for t in gguf.GGUFReader(path).tensors:
        if t.tensor_type != gguf.GGMLQuantizationType.F32:
            raise TypeError(f"{t.name}: only f32 models are compared")
        out[t.name] = np.array(t.data, dtype=np.float32).reshape([int(n) for n in reversed(t.shape)])
    return out
