"""Every public entry point called with arguments drawn at random (wrong types, out of range,
non-finite, huge, empty, odd dtypes and shapes): a typed error (TypeError, ValueError, OverflowError
past a native limit, KeyError for a name not there, or a retro.RetroError) before anything native
changes, or a call that works, never a crash. After each refusal the object is still usable and
its state is what it was.

A longer, randomized run: RETRO_FUZZ_EXAMPLES=2000 pytest tests/test_hostile_arguments.py"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import retro

TYPED = (TypeError, ValueError, OverflowError, KeyError, retro.RetroError)

_dtypes = st.sampled_from(
    [
        np.int8,
        np.int16,
        np.int32,
        np.int64,
        np.uint8,
        np.uint32,
        np.uint64,
        np.float16,
        np.float32,
        np.float64,
        np.bool_,
    ]
)
_arrays = hnp.arrays(_dtypes, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=6))
_edge_ints = st.sampled_from(
    [-(2**63) - 1, -(2**31), -1, 0, 1, 2, 3, 63, 64, 65, 255, 256, 257, 511, 512, 2**31, 2**63, 2**64]
)
#: anything a caller might pass by mistake
hostile = st.one_of(
    st.none(),
    st.booleans(),
    _edge_ints,
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.binary(max_size=4),
    st.lists(st.integers(-(2**40), 2**40), max_size=6),
    st.lists(st.floats(allow_nan=True), max_size=4),
    _arrays,
    st.just(object()),
)


def _settings(examples: int = 60):
    wider = os.environ.get("RETRO_FUZZ_EXAMPLES")
    return settings(
        max_examples=int(wider) if wider else examples,
        deadline=None,
        derandomize=not wider,  # CI draws the same calls every run
        database=None,
        suppress_health_check=list(HealthCheck),
    )


def _call(fn, *args, **kwargs):
    """fn(*args, **kwargs): its result, or None after a typed error; any other error fails."""
    try:
        return fn(*args, **kwargs)
    except TYPED:
        return None


@_settings(80)
@given(
    kwargs=st.fixed_dictionaries(
        {},
        optional={
            "n_ctx": hostile | st.integers(1, 1024),
            "n_batch": hostile | st.integers(1, 1024),
            "n_ubatch": hostile | st.integers(1, 1024),
            "n_threads": hostile | st.integers(1, 4),
            "sequences": hostile | st.integers(1, 8),
        },
    )
)
def test_context_creation(model, kwargs):
    ctx = _call(retro.Context, model, **kwargs)
    if ctx is not None:
        with ctx:
            assert ctx.decode([1]).shape == (1, model.n_vocab)


@_settings(120)
@given(tokens=hostile)
def test_decode(ctx, tokens):
    ctx.reset()
    ctx.decode([1, 2, 3])
    if _call(ctx.decode, tokens) is None:
        assert ctx.n_past == 3, "a refused decode changed the context"
        assert ctx.decode([4]).shape[0] == 1


@_settings(80)
@given(
    prompt=hostile | st.lists(st.integers(0, 511), min_size=1, max_size=4),
    max_new=hostile | st.integers(0, 8),
    kwargs=st.fixed_dictionaries(
        {}, optional={"temperature": hostile, "seed": hostile, "stop_at_eog": hostile, "n_draft": hostile}
    ),
)
def test_generate(ctx, prompt, max_new, kwargs):
    ctx.reset()
    ctx.decode([1, 2, 3])
    if _call(ctx.generate, prompt, max_new, **kwargs) is None:
        assert ctx.n_past == 3, "a refused generation changed the context"


@_settings(120)
@given(
    kind=st.sampled_from(["from_tokens", "token", "weighted", "top_k", "packed", "pack"]),
    a=hostile,
    b=hostile,
    c=hostile,
)
def test_dataset_construction(kind, a, b, c):
    build = {
        "from_tokens": lambda: retro.TokenDataset.from_tokens(a, width=b, stride=c),
        "token": lambda: retro.TokenDataset(a, b),
        "weighted": lambda: retro.WeightedDataset(a, b, c),
        "top_k": lambda: retro.TopKDataset(a, b, c),
        "packed": lambda: retro.PackedDataset(a, b, c),
        "pack": lambda: retro.PackedDataset.pack(a, width=b, weights=c),
    }[kind]
    _call(build)


@pytest.fixture(scope="module")
def trained_context(model_path):
    with retro.Model.load(model_path, devices=[], trainable=True) as m:
        with retro.Context(m, n_ctx=64, n_batch=64, n_ubatch=64) as c:
            yield c


@_settings(60)
@given(
    kwargs=st.fixed_dictionaries(
        {},
        optional={
            "accumulation": hostile,
            "duty_cycle": hostile,
            "horizon": hostile,
            "head": hostile | st.sampled_from(["dense", "fused"]),
            "topology_cache": hostile,
        },
    ),
    epoch_kwargs=st.fixed_dictionaries({}, optional={"val_fraction": hostile, "progress": hostile}),
)
def test_trainer_and_epoch(trained_context, kwargs, epoch_kwargs):
    data = retro.TokenDataset.from_tokens(np.arange(3 * 64 + 1) % 512, width=64)
    trainer = _call(retro.Trainer, trained_context, **kwargs)
    if trainer is None:
        return
    with trainer:
        before = trainer.iteration
        if _call(trainer.epoch, data, **epoch_kwargs) is None:
            assert trainer.iteration == before, "a refused epoch stepped the optimizer"
        trainer.epoch(data, val_fraction=0.0)


@_settings(60)
@given(name=hostile | st.sampled_from(["output.weight", "blk.9.attn_q.weight", "", "output.weight\x00"]))
def test_model_tensor(model, name):
    tensor = _call(model.tensor, name)
    if tensor is not None:
        assert name in model.tensor_names()
