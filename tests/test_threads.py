"""The CPU thread policy (retro/_threads.py, native/core/thread_governor.cpp): which count each
compute gets. Its speed under load is measured by ``python -m retro.bench``, not here."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import retro
from retro.testing import busy_processes

CORES = len(os.sched_getaffinity(0))


def train_once(c: retro.Context, model: retro.Model) -> None:
    stream = np.random.default_rng(0).integers(0, model.n_vocab, size=256 + 1)
    with retro.Trainer(c, optimizer=retro.SGD(lr=1e-3)) as tr:
        tr.epoch(retro.TokenDataset.from_tokens(stream, width=256))


def test_the_count_follows_the_load_only_when_nobody_fixed_it(
    model: retro.Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RETRO_THREADS")
    with retro.Context(model, n_ubatch=64) as c:
        assert c.adaptive_threads and c.n_threads == min(CORES, 16)
    with retro.Context(model, n_ubatch=64, n_threads=1) as c:
        assert not c.adaptive_threads and c.n_threads == 1
    monkeypatch.setenv("RETRO_THREADS", "3")
    with retro.Context(model, n_ubatch=64) as c:
        assert not c.adaptive_threads and c.n_threads == 3


@pytest.mark.skipif(CORES < 2, reason="needs two cores to see the count fall")
def test_with_every_core_busy_elsewhere_a_compute_gets_one_thread(
    model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RETRO_THREADS")
    with (
        retro.Model.load(model_path, devices=[], trainable=True) as m,
        retro.Context(m, n_ctx=256, n_ubatch=64) as adaptive,
        retro.Context(m, n_ctx=256, n_ubatch=64, n_threads=CORES) as fixed,
    ):
        with busy_processes(CORES):
            adaptive.decode(np.arange(8, dtype=np.int32))
            fixed.decode(np.arange(8, dtype=np.int32))
            assert (adaptive.threads_now, fixed.threads_now) == (1, CORES)
            adaptive.reset()
            train_once(adaptive, m)
            assert adaptive.threads_now == 1


def test_the_benchmark_measures_each_phase(model_path: Path) -> None:
    """The benchmark's pieces run (its figures are docs/benchmarks.md's, not this test's)."""
    from retro import bench

    loop = bench.loop_overhead(model_path, threads=1, n_ubatch=256, reps=1)
    assert loop["retro_s_min"] > 0 and loop["upstream_s_min"] > 0
    phases = bench.rebuild_cost(model_path, device=None, threads=1, n_ubatch=256, reps=1)
    assert all(phases["off"][ph] > 0 for ph in bench.PHASES)
    assert phases["on"]["rebuild_s"] < phases["off"]["rebuild_s"]  # the cache's hits build nothing
