from __future__ import annotations

from pathlib import Path

import pytest

from retro.conformance import support
from retro.conformance.shapes import Shape
from retro.transactions import Profile


@pytest.fixture(scope="session")
def seed(request: pytest.FixtureRequest) -> int:
    return int(request.config.getoption("--retro-seed"))


@pytest.fixture(scope="session")
def models_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture
def model_path(models_folder: Path, seed: int, shape: Shape) -> Path:
    """The model of the case's shape profile (shapes.py), written once per run (model_file keeps it)."""
    return support.model_file(models_folder, seed, shape)


@pytest.fixture
def loaded(backend, model_path):
    """The model on the backend under test and its profile (the tensor-transaction checks)."""
    with support.load(backend, model_path, trainable=False) as model:
        yield model, Profile.record(model)
