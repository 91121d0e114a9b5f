from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import retro
from retro.testing import TinyLlamaSpec, write_tiny_llama

REPO = Path(__file__).resolve().parent.parent

# ggml threads per context: this machine's cores shared out among the xdist workers (more threads
# than free cores makes ggml many times slower); certification children inherit the share
if "RETRO_THREADS" not in os.environ:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    os.environ["RETRO_THREADS"] = str(max(1, _cores // _workers))


@pytest.fixture(scope="session")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("models") / "tiny.gguf", TinyLlamaSpec(seed=0))


@pytest.fixture
def model(model_path: Path):
    with retro.Model.load(model_path, devices=[], trainable=True) as m:
        yield m


@pytest.fixture
def ctx(model: retro.Model):
    with retro.Context(model, n_ctx=256, n_batch=256, n_ubatch=64) as c:
        yield c


@pytest.fixture(autouse=True)
def _no_armed_hooks():
    """Every test starts and ends with no fault armed and no seeded defect on."""
    from retro._native import hooks

    hooks.reset()
    yield
    hooks.reset()
    for defect in hooks.defects():
        hooks.set_defect(defect, False)


def dataset(n_windows: int, width: int = 256, seed: int = 0, n_vocab: int = 512) -> retro.TokenDataset:
    stream = np.random.default_rng(seed).integers(0, n_vocab, size=n_windows * width + 1)
    return retro.TokenDataset.from_tokens(stream, width=width)


def stateful_settings(examples: int, steps: int):
    """hypothesis settings of the stateful tests: derandomized (the same sequences every run, no
    example database) and without deadlines or health checks (a step trains a model)."""
    from hypothesis import HealthCheck, settings

    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
