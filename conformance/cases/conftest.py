from __future__ import annotations

from pathlib import Path

import pytest

from retro.conformance import support
from retro.transactions import Profile


@pytest.fixture(scope="session")
def seed(request: pytest.FixtureRequest) -> int:
    return int(request.config.getoption("--retro-seed"))


@pytest.fixture(scope="session")
def model_path(tmp_path_factory: pytest.TempPathFactory, seed: int) -> Path:
    """The default tiny llama (vocab 512, n_embd 64, 2 layers, n_ctx 256), written once per run."""
    return support.model_file(tmp_path_factory.mktemp("models"), seed)


@pytest.fixture
def loaded(backend, model_path):
    """The model on the backend under test and its profile (the tensor-transaction checks)."""
    with support.load(backend, model_path, trainable=False) as model:
        yield model, Profile.record(model)
