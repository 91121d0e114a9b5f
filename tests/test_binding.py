"""The binding: devices, model, context, decode, errors, logging, build information."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

import retro
from conftest import REPO


def test_build_info_names_the_pin_and_the_patch_series():
    import hashlib

    info = retro.build_info()
    assert info["llama_cpp_commit"] == "0c1e57098"
    assert info["sdist"] == "llama-cpp-python==0.3.36"
    patches = sorted((REPO / "vendor" / "patches").glob("*.patch"))
    assert info["patches"] == [p.name for p in patches]
    digest = hashlib.sha256()
    for p in patches:
        digest.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    assert info["patch_series_sha256"] == digest.hexdigest()
    assert "cpu" in info["backends"]


def test_devices_list_the_cpu_first():
    devs = retro.devices()
    assert devs[0].kind == "cpu" and devs[0].backend == "CPU"
    assert all(d.memory_total >= 0 for d in devs)


def test_a_devices_backend_is_read_from_ggmls_registry():
    """Every listed device maps to a backend of ours through its registry's name (retro.devices.BACKENDS,
    the one table of them); a device name no device has matches none of ours."""
    from retro.devices import BACKENDS, backend_name, backends_of

    listed = retro.devices()
    assert {d.backend for d in listed} <= set(BACKENDS)
    assert backends_of(d.name for d in listed) == [
        "cpu",
        *dict.fromkeys(BACKENDS[d.backend] for d in listed if d.backend != "CPU"),
    ]
    assert backends_of(["Metal0"]) == ["cpu", "metal0"]
    assert backend_name("SYCL") == "sycl"


def test_missing_and_corrupt_files_raise_typed_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        retro.Model.load(tmp_path / "absent.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(retro.ModelLoadError) as err:
        retro.Model.load(bad, devices=[])
    assert "backend diagnostic" in str(err.value)


@pytest.mark.parametrize(
    "kwargs, exc",
    [
        (dict(gpu_layers=-2), ValueError),
        (dict(gpu_layers=2**31), OverflowError),
        (dict(gpu_layers=1.5), TypeError),
        (dict(trainable=1), TypeError),
        (dict(devices=[99]), ValueError),
        (dict(devices=[0]), ValueError),
    ],
)
def test_load_arguments_are_validated(model_path, kwargs, exc):
    with pytest.raises(exc):
        retro.Model.load(model_path, **kwargs)


def test_decode_returns_logits_and_is_deterministic(model):
    with retro.Context(model, n_ctx=256, n_batch=64) as ctx:
        tokens = model.tokenize("hello world")
        a = ctx.decode(tokens)
        assert a.shape == (len(tokens), model.n_vocab) and a.dtype == np.float32
        assert np.isfinite(a).all()
        assert ctx.n_past == len(tokens)
        ctx.reset()
        b = ctx.decode(np.array(tokens, dtype=np.int64))
        assert np.array_equal(a, b)
        # continuing the sequence: the last token's logits given the prefix equal the one-shot run
        ctx.reset()
        ctx.decode(tokens[:-1])
        c = ctx.decode(tokens[-1:])
        np.testing.assert_allclose(c[0], a[-1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "tokens, exc",
    [
        ([], ValueError),
        ([512], ValueError),
        ([-1], ValueError),
        ([[1, 2]], ValueError),
        (np.array([1.0, 2.0]), TypeError),
        (list(range(65)), ValueError),
    ],
)
def test_bad_decode_input_is_rejected_before_native_state_changes(model, tokens, exc):
    with retro.Context(model, n_ctx=256, n_batch=64) as ctx:
        ctx.decode([1, 2, 3])
        with pytest.raises(exc):
            ctx.decode(tokens)
        assert ctx.n_past == 3


def test_decode_past_the_context_is_rejected(model):
    with retro.Context(model, n_ctx=256, n_batch=256) as ctx:
        ctx.decode(np.zeros(200, dtype=np.int32))
        with pytest.raises(ValueError, match="exceed n_ctx"):
            ctx.decode(np.zeros(100, dtype=np.int32))
        assert ctx.n_past == 200


def test_closed_objects_raise_invalid_state(model_path):
    m = retro.Model.load(model_path, devices=[])
    ctx = retro.Context(m)
    ctx.close()
    with pytest.raises(retro.InvalidStateError):
        ctx.decode([1])
    m.close()
    with pytest.raises(retro.InvalidStateError):
        m.tokenize("x")
    with pytest.raises(ValueError):
        retro.Context(m)


def test_a_model_is_never_freed_under_its_contexts(model_path):
    """Dropping the model object keeps the weights alive for its contexts; closing it while a
    context is open is refused."""
    m = retro.Model.load(model_path, devices=[])
    ctx = retro.Context(m)
    with pytest.raises(retro.InvalidStateError, match="open contexts"):
        m.close()
    assert not m.closed
    del m
    assert ctx.decode([1, 2]).shape == (2, 512)
    model = ctx.model
    ctx.close()
    model.close()
    assert model.closed


def test_context_arguments_are_validated(model):
    with pytest.raises(ValueError):
        retro.Context(model, n_ctx=256, n_batch=32, n_ubatch=64)
    with pytest.raises(OverflowError):
        retro.Context(model, n_ctx=2**31)
    with pytest.raises(TypeError):
        retro.Context(model, n_ctx="256")
    with pytest.raises(TypeError):
        retro.Context(object())


def test_native_log_lines_reach_python_logging(model_path, caplog):
    with caplog.at_level(logging.DEBUG, logger="retro.native"):
        with retro.Model.load(model_path, devices=[]) as m, retro.Context(m):
            pass
    assert any(r.name == "retro.native" for r in caplog.records)
    assert all("\n" not in r.getMessage() for r in caplog.records if r.name == "retro.native")


def test_the_log_mirror_writes_each_line_as_it_is_logged_and_the_queue_keeps_it(model_path, caplog):
    """The test door's mirror (hooks.mirror_logs) writes every native line to its descriptor while
    the call is still running; the queue still hands the same lines to Python logging."""
    from retro import _native_logs
    from retro._native import hooks

    _native_logs.drain()  # what earlier calls left queued
    read, write = os.pipe()
    try:
        hooks.mirror_logs(write)
        with caplog.at_level(logging.DEBUG, logger="retro.native"):
            with retro.Model.load(model_path, devices=[]) as m, retro.Context(m):
                pass
            _native_logs.drain()  # what the last call logged after its own drain
    finally:
        hooks.mirror_logs(-1)
        os.close(write)
    with os.fdopen(read, encoding="utf-8") as f:
        mirrored = f.read().splitlines()
    queued = [r.getMessage() for r in caplog.records if r.name == "retro.native"]
    assert any("~llama_context" in line for line in mirrored)
    assert mirrored == queued


def test_decode_works_after_training_with_a_full_window_micro_batch(model):
    """n_ubatch == n_ctx switches training graphs to bypass the KV cache; a decode afterwards
    must not inherit that (upstream aborted in llama-graph.cpp)."""
    from conftest import dataset

    with retro.Context(model, n_ctx=256, n_batch=256, n_ubatch=256) as ctx:
        before = ctx.decode([5, 6, 7])
        ctx.reset()
        with retro.Trainer(ctx, optimizer=retro.SGD(lr=0.1)) as tr:
            tr.epoch(dataset(1))
        after = ctx.decode([5, 6, 7])
        assert after.shape == before.shape and not np.array_equal(after, before)


def test_missing_cpu_features_are_named(tmp_path, monkeypatch):
    from retro import _cpu

    monkeypatch.setattr(_cpu.platform, "machine", lambda: "x86_64")
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse sse2 avx fma\n")
    assert _cpu.missing_features(str(info)) == ["avx2", "f16c"]
    info.write_text("flags\t\t: avx2 fma f16c\n")
    assert _cpu.missing_features(str(info)) == []
    monkeypatch.setattr(_cpu.platform, "machine", lambda: "aarch64")
    assert _cpu.missing_features(str(tmp_path / "absent")) == []


def test_every_error_class_is_exported():
    import retro.errors

    for name in retro.errors.__all__:
        assert getattr(retro, name) is getattr(retro.errors, name)
    assert {c.__name__ for c in retro.errors.RetroError.__subclasses__()} <= set(retro.errors.__all__)
