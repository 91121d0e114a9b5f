"""The binding's RPC parts: retro.rpc's argument checks, its server, and a lost server as typed
errors (the training faults are certified by conformance/cases/test_remote_faults.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import retro
import retro.rpc
from retro.transactions import Profile, TensorTransactions

#: the probe of the first CUDA run (an H200): the output product's largest difference from float64
#: numpy (the logits against the captured result_norm times output.weight), on TinyLlamaSpec()'s
#: F32 weights and the tensor-transaction checks' tokens 3..12 in micro-batches of 4, at a logit
#: scale of 0.6; the CPU's is 6e-8
H200_PROBE = 4.7e-4


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


def test_numerics_other_than_the_named_ones_are_refused_before_a_server_starts() -> None:
    with pytest.raises(ValueError, match="numerics"):
        retro.rpc.Server(numerics="tf32")
    with pytest.raises(ValueError, match="numerics"):
        retro._native.hooks.set_numerics("gpu-like-truncated")
    with pytest.raises(ValueError, match="numerics"):
        retro._native.hooks.set_numerics("bf16")
    assert retro._native.hooks.numerics() == "cpu"


def test_a_server_with_gpu_like_numerics_decodes_as_a_gpu_would(model_path: Path) -> None:
    """The fork's switch (patch 0055) in a server's process: its products of 16 rows take TF32
    inputs, so the logits move off the CPU's by about 2^-10 of their scale, not by the last bits of
    a reordered sum; this process computes as before."""
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


def _output_product_error(model_path: Path, devices: list, **load) -> float:
    """The H200 probe on these devices: max |logits - result_norm . output.weight^T| in float64."""
    with retro.Model.load(model_path, devices=devices, **load) as m:
        profile = Profile.record(m)
        tx = TensorTransactions(profile, [profile.select("result_norm", retain=True)], None)
        w = m.tensor("output.weight").astype(np.float64)
        with retro.Context(m, n_ctx=256, n_batch=64, n_ubatch=4, n_threads=1, transactions=tx) as c:
            logits = c.decode(list(range(3, 13))).astype(np.float64)
            norm = np.concatenate([x.data for x in c.drain_captures() if x.name == "result_norm"])
    return float(np.abs(logits - norm.astype(np.float64) @ w.T).max())


def test_gpu_like_numerics_reproduce_the_h200_probe_within_twice(model_path: Path) -> None:
    """At 4 rows CUDA's product runs on tensor cores at TF32, truncated as mma takes F32 registers:
    the switch puts the output product as far from float64 as the H200 put it, within a factor of 2
    (measured: 4.4e-4); rounded to nearest, about half as far (2.0e-4); the CPU's own error is 4
    orders below either."""
    cpu = _output_product_error(model_path, [])
    served = {}
    for numerics in ("gpu-like", "gpu-like-nearest"):
        with retro.rpc.Server(numerics=numerics) as server:
            served[numerics] = _output_product_error(
                model_path, retro.rpc.connect(server.endpoint, deadline_s=5), gpu_layers=-1
            )
    assert cpu < 1e-6, cpu
    assert H200_PROBE / 2 <= served["gpu-like"] <= 2 * H200_PROBE, served
    assert 1e-5 < served["gpu-like-nearest"] < served["gpu-like"], served
    retro.rpc.set_deadline(retro.rpc.DEFAULT_DEADLINE_S)
