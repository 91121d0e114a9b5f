"""The binding's RPC parts: retro.rpc's argument checks, its server, and a lost server as typed
errors (the training faults are certified by conformance/cases/test_remote_faults.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import retro
import retro.rpc


@pytest.mark.parametrize(
    ("endpoint", "error"),
    [
        ("127.0.0.1", ValueError),
        ("127.0.0.1:0", ValueError),
        (":50052", ValueError),
        ("h:70000", ValueError),
        (5, TypeError),
    ],
)
def test_a_malformed_endpoint_is_refused_before_anything_native(endpoint, error) -> None:
    with pytest.raises(error):
        retro.rpc.connect(endpoint)


@pytest.mark.parametrize("deadline", [-1, 86401, True, "3"])
def test_a_deadline_out_of_range_is_refused(deadline) -> None:
    with pytest.raises(ValueError):
        retro.rpc.set_deadline(deadline)


def test_a_server_that_is_not_running_is_a_backend_error() -> None:
    with pytest.raises(retro.BackendError, match="no RPC server answers"):
        retro.rpc.connect(f"127.0.0.1:{retro.rpc.free_port()}", deadline_s=2)


def test_a_model_on_a_served_device_decodes_as_on_the_cpu_until_the_server_dies(model_path: Path) -> None:
    tokens = np.arange(16, dtype=np.int32)
    with retro.Model.load(model_path, devices=[]) as m, retro.Context(m, n_ubatch=64) as c:
        on_cpu = c.decode(tokens)
    with retro.rpc.Server() as server:
        devices = retro.rpc.connect(server.endpoint, deadline_s=5)
        assert [d.backend for d in devices] == ["RPC"]
        with retro.Model.load(model_path, devices=devices, gpu_layers=-1) as m, retro.Context(m, n_ubatch=64) as c:
            assert set(m.tensor_devices().values()) == {"CPU", devices[0].name}  # the input layer stays
            np.testing.assert_allclose(c.decode(tokens), on_cpu, rtol=1e-5, atol=1e-6)
            server.kill()
            c.reset()
            with pytest.raises(retro.DecodeError):
                c.decode(tokens)
    retro.rpc.set_deadline(retro.rpc.DEFAULT_DEADLINE_S)


def test_numerics_other_than_the_two_are_refused_before_a_server_starts() -> None:
    with pytest.raises(ValueError, match="numerics"):
        retro.rpc.Server(numerics="tf32")
    with pytest.raises(ValueError, match="numerics"):
        retro._native.hooks.set_numerics("bf16")
    assert retro._native.hooks.numerics() == "cpu"


def test_a_server_with_gpu_like_numerics_decodes_as_a_gpu_would(model_path: Path) -> None:
    """The fork's switch (patch 0055) in a server's process: its F32 products take TF32 inputs, so
    the logits move off the CPU's by about 2^-11 of their scale (an H200 measured 4.7e-4 at a
    scale of 0.62 on this model), not by the last bits of a reordered sum; this process computes
    as before."""
    tokens = np.arange(16, dtype=np.int32)
    with retro.Model.load(model_path, devices=[]) as m, retro.Context(m, n_ubatch=64) as c:
        on_cpu = c.decode(tokens).astype(np.float64)
    with retro.rpc.Server(numerics="gpu-like") as server:
        devices = retro.rpc.connect(server.endpoint, deadline_s=5)
        with retro.Model.load(model_path, devices=devices, gpu_layers=-1) as m, retro.Context(m, n_ubatch=64) as c:
            served = c.decode(tokens).astype(np.float64)
    scale = float(np.abs(on_cpu).max())
    moved = float(np.abs(served - on_cpu).max()) / scale
    assert 1e-5 < moved < 5e-3, f"gpu-like logits moved {moved:.3g} of their scale"
    assert retro._native.hooks.numerics() == "cpu"
