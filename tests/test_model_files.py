"""Model files a user did not make: damaged, truncated or out of range. Each gets a typed error
(or loads and works), never a crash: the regressions found so far, then a fuzzing run over the
tiny model's metadata, run in a child process so that a crash is a finding, not a lost worker.

A longer, randomized run: RETRO_FUZZ_EXAMPLES=200 pytest tests/test_model_files.py"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import retro
from retro.testing import TinyLlamaSpec, write_tiny_llama

gguf = pytest.importorskip("gguf")

PROBE = Path(__file__).with_name("model_file_probe.py")
# the file every damaged one starts from: made at import, since the strategies read its layout
_BASE_DIR = tempfile.mkdtemp(prefix="retro-model-files-")
atexit.register(shutil.rmtree, _BASE_DIR, True)
BASE = write_tiny_llama(Path(_BASE_DIR) / "tiny.gguf", TinyLlamaSpec(seed=0))


def _edited(
    dest: Path, fields: dict[str, float] | None = None, tensors: dict[tuple[str, str], int] | None = None
) -> Path:
    """A copy of the tiny model with scalar metadata `fields` and tensor-info entries rewritten in
    place ((tensor name, "type" | "offset" | "ne0") -> value)."""
    fields, tensors = fields or {}, tensors or {}
    shutil.copy(BASE, dest)
    reader = gguf.GGUFReader(dest, "r+")
    for name, value in fields.items():
        field = reader.fields[name]
        part = field.parts[field.data[0]]
        part[...] = np.array(value).astype(part.dtype)
    by_name = {t.name: t for t in reader.tensors}
    for (tensor, what), value in tensors.items():
        parts = by_name[tensor].field.parts
        part = parts[{"ne0": 3, "type": -2, "offset": -1}[what]]
        part[...] = np.array(value).astype(part.dtype)
    del reader  # flushes the memory map
    return dest


# -- regressions: each of these aborted the process once -----------------------------------------
@pytest.mark.parametrize(
    "field, value",
    [
        ("llama.block_count", 0),  # GGML_ASSERT in load_hparams (fork patch 0044)
        ("llama.block_count", 100_000),
        ("llama.attention.layer_norm_rms_epsilon", -1.0),  # GGML_ASSERT(eps >= 0) at the first decode
        ("llama.attention.layer_norm_rms_epsilon", float("nan")),
    ],
)
def test_hyperparameters_out_of_range_fail_the_load(tmp_path, field, value):
    path = _edited(tmp_path / "m.gguf", fields={field: value})
    with pytest.raises(retro.ModelLoadError, match="invalid hyperparameters"):
        retro.Model.load(path, devices=[])


def test_text_that_is_not_utf8_reaches_python_as_text(tmp_path, caplog):
    """A file's strings need not be UTF-8; the library quotes them in its log lines and error
    messages. Each reaches Python with the bad bytes replaced (U+FFFD), never as a
    UnicodeDecodeError in place of the call's own outcome."""
    path = _edited(tmp_path / "m.gguf")
    reader = gguf.GGUFReader(path)
    field = reader.fields["general.name"]
    offset = field.offset + sum(p.nbytes for p in field.parts[: field.data[0]])
    del reader
    data = bytearray(path.read_bytes())
    data[offset] = 0xFF  # the first byte of the model's name
    path.write_bytes(bytes(data))
    with caplog.at_level("DEBUG", logger="retro.native"), retro.Model.load(path, devices=[]) as m:
        assert m.n_vocab == 512
    assert any("\ufffd" in r.getMessage() for r in caplog.records), "the name's log line never arrived"


@pytest.mark.parametrize(
    "weight_type", [gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.BF16], ids=["q4_0", "bf16"]
)
def test_a_weight_no_backend_can_train_fails_the_step_before_compute(tmp_path, weight_type):
    """The output layer stored as q4_0 or bf16 loads and decodes, but the CPU has no OUT_PROD for
    its gradient: every training entry point raises UnsupportedOpError naming the op, before
    anything is allocated, and the trainer and context stay usable (fork patches 0042, 0043)."""
    from retro._native import live_allocations
    from retro.testing.oracle import upstream_epoch

    path = _edited(tmp_path / "m.gguf", tensors={("output.weight", "type"): int(weight_type)})
    with retro.Model.load(path, devices=[], trainable=True) as m:
        n_ctx = m.n_ctx_train
        with retro.Context(m, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx) as ctx:
            data = retro.TokenDataset.from_tokens(np.arange(2 * n_ctx + 1) % m.n_vocab, width=n_ctx)
            trainer = retro.Trainer(ctx)
            iteration = trainer.iteration
            attempts = [
                lambda: trainer.epoch(data, val_fraction=0.0),
                lambda: trainer.preflight(data),
                lambda: upstream_epoch(trainer, data),
                lambda: trainer.epoch(data, val_fraction=0.0),
            ]
            live = []
            for attempt in attempts:
                with pytest.raises(
                    retro.UnsupportedOpError, match=r"supports OUT_PROD .*q4_0|supports OUT_PROD .*bf16"
                ):
                    attempt()
                live.append(live_allocations())
            assert live[0] == live[-1], "a refused step leaves nothing allocated behind"
            assert trainer.iteration == iteration, "no step ran"
            ctx.reset()
            ctx.decode([1, 2, 3])


# -- fuzzing ---------------------------------------------------------------------------------
def _scalar_fields() -> dict[str, np.dtype]:
    reader = gguf.GGUFReader(BASE)
    out = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or len(field.data) != 1:
            continue
        part = field.parts[field.data[0]]
        if part.dtype.kind in "iuf" and part.size == 1:
            out[name] = part.dtype
    return out


FIELDS = _scalar_fields()
TENSORS = [t.name for t in gguf.GGUFReader(BASE).tensors]
METADATA_BYTES = int(gguf.GGUFReader(BASE).data_offset)

_edge_ints = st.sampled_from([0, 1, 2, 3, 7, 63, 64, 255, 256, 511, 512, 65535, 2**31 - 1, 2**31, 2**32 - 1])
_edge_floats = st.sampled_from([0.0, -0.0, -1.0, 1e-30, 1e30, float("nan"), float("inf"), float("-inf")])


@st.composite
def _field_edit(draw):
    name = draw(st.sampled_from(sorted(FIELDS)))
    dtype = FIELDS[name]
    if dtype.kind == "f":
        value = draw(_edge_floats | st.floats(width=32))
    else:
        info = np.iinfo(dtype)
        value = draw(_edge_ints.filter(lambda v: info.min <= v <= info.max) | st.integers(int(info.min), int(info.max)))
    return ("field", name, value)


_tensor_edit = st.tuples(
    st.just("tensor"),
    st.sampled_from(TENSORS),
    st.sampled_from(["type", "offset", "ne0"]),
    _edge_ints | st.integers(0, 2**40),
)
_byte_edit = st.tuples(st.just("byte"), st.integers(0, METADATA_BYTES - 1), st.integers(0, 255))
_truncation = st.tuples(st.just("truncate"), st.integers(0, METADATA_BYTES + 4096))
_damage = st.lists(st.one_of(_field_edit(), _tensor_edit, _byte_edit, _truncation), min_size=1, max_size=3)


def _damaged(dest: Path, damage: list[tuple]) -> Path:
    fields = {e[1]: e[2] for e in damage if e[0] == "field"}
    tensors = {(e[1], e[2]): e[3] for e in damage if e[0] == "tensor"}
    _edited(dest, fields=fields, tensors=tensors)
    data = bytearray(dest.read_bytes())
    for e in damage:
        if e[0] == "byte":
            data[e[1]] = e[2]
    for e in damage:
        if e[0] == "truncate":
            del data[e[1] :]
    dest.write_bytes(bytes(data))
    return dest


FILES_PER_EXAMPLE = 12


@settings(
    max_examples=int(os.environ.get("RETRO_FUZZ_EXAMPLES", "3")),
    derandomize="RETRO_FUZZ_EXAMPLES" not in os.environ,  # CI draws the same files every run
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(batch=st.lists(_damage, min_size=FILES_PER_EXAMPLE, max_size=FILES_PER_EXAMPLE))
def test_damaged_model_files_get_typed_errors_never_a_crash(tmp_path_factory, batch):
    folder = tmp_path_factory.mktemp("damaged")
    paths = [_damaged(folder / f"{i}.gguf", damage) for i, damage in enumerate(batch)]
    env = {**os.environ, "RETRO_THREADS": os.environ.get("RETRO_THREADS", "1")}
    run = subprocess.run(
        [sys.executable, str(PROBE), *map(str, paths)], capture_output=True, text=True, timeout=600, env=env
    )
    records = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    begun = [r["begin"] for r in records if "begin" in r]
    if run.returncode != 0:
        last = begun[-1] if begun else None
        pytest.fail(
            f"the probe died (exit {run.returncode}) on file {last}, damaged by {batch[last] if last is not None else '?'}:\n"
            + "\n".join(run.stderr.splitlines()[-15:])
        )
    untyped = [(batch[r["file"]], r["outcome"]) for r in records if r.get("outcome", "").startswith("untyped")]
    assert not untyped, f"errors that are not retro's: {untyped}"
    assert len([r for r in records if "outcome" in r]) == len(paths)
