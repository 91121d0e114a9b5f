"""A release build (RETRO_SEEDED_DEFECTS=OFF) carries no seeded-defect switch and computes what the
certifying build computes.

The switches exist so that certification can prove each check fails on the defect it is for; a
user's library has no use for them in its hot loop. Built without them, every switch is the
constant false at compile time: no switch function, no switch table, no defect ID is left in the
libraries, nor the log mirror the checks read events from, the certification refuses such a build (it could prove nothing), and a training run
gives bitwise the parameters, logits and metrics of the default build. Its speed beside the
default build's is measured by `python -m retro.bench`, not here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from site_view import build_into, site_view_env

from conftest import REPO
from retro._native import hooks

# trains the tiny model on the dense and the fused head with accumulation and evaluation, decodes,
# and prints a digest of what came out: run the same in both builds
WORKLOAD = r"""
import hashlib, json, sys
import numpy as np
import retro
import retro.fault_injection as fi
from retro._native import hooks
from retro.testing import TinyLlamaSpec, write_tiny_llama

path = write_tiny_llama(sys.argv[1], TinyLlamaSpec(seed=3))
digest = hashlib.sha256()
stream = np.random.default_rng(7).integers(0, 512, size=6 * 128 + 1)
data = retro.TokenDataset.from_tokens(stream, width=128)
metrics = []
for head in ("dense", "fused"):
    with retro.Model.load(path, devices=[], trainable=True) as model:
        with retro.Context(model, n_ctx=128, n_batch=128, n_ubatch=32) as ctx:
            with retro.Trainer(ctx, optimizer=retro.AdamW(lr=1e-3), accumulation=2, head=head) as tr:
                for _ in range(2):
                    m = tr.epoch(data, val_fraction=1 / 3)
                    metrics.append([m.train_loss, m.eval_loss, m.optimizer_steps, m.train_accuracy])
                for name, value in sorted(tr.parameters().items()):
                    digest.update(name.encode())
                    digest.update(np.ascontiguousarray(value).tobytes())
            digest.update(np.ascontiguousarray(ctx.decode(list(range(1, 17)))).tobytes())
digest.update(json.dumps(metrics).encode())
try:  # the test door's log mirror is a test hook too
    hooks.mirror_logs(-1)
    mirror = True
except ValueError:
    mirror = False
try:  # so are a GPU's numerics on the CPU (fork patch 0055)
    hooks.set_numerics("gpu-like")
    numerics = hooks.numerics() == "gpu-like"
    hooks.set_numerics("cpu")
except ValueError:
    numerics = False
with retro.Model.load(path, devices=[], trainable=True) as model, retro.Context(model, n_ctx=128) as ctx:
    try:  # the cache without its gate is the test door's too: a release build has the gate alone
        with fi.ungated_topology_cache():
            retro.Trainer(ctx, optimizer=retro.SGD(lr=0.1), topology_cache=True).close()
        forced = True
    except ValueError:
        forced = False
print(json.dumps({"mirror": mirror, "forced": forced, "numerics": numerics, "digest": digest.hexdigest(), "metrics": metrics, "seeded_defects": hooks.seeded_defects,
                  "defects": len(hooks.defects()), "info": retro.build_info()["seeded_defects"]}))
"""


def _defect_ids() -> list[str]:
    return [d["id"] for d in tomllib.loads((REPO / "conformance" / "mutants.toml").read_text())["defect"]]


def _run(cmd: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=cwd)


@pytest.mark.slow
def test_a_release_build_has_no_switch_and_computes_bitwise_the_same(tmp_path):
    target = tmp_path / "release"
    build_into(target, REPO / "build" / "release", "RETRO_SEEDED_DEFECTS=OFF")

    # no switch function, exported or called, and no defect ID in any library of the release build
    libraries = sorted(p for p in (target / "retro").glob("*.so*") if p.is_file())
    assert any(p.name.startswith("libggml-base") for p in libraries), libraries
    ids = _defect_ids()
    assert len(ids) == len(hooks.defects()) > 0
    dotted = [i.encode() for i in ids if "." in i]  # IDs no other text of the library spells
    for lib in libraries:
        symbols = subprocess.run(["nm", "-D", str(lib)], capture_output=True, text=True, check=True).stdout
        assert "retro_defect_" not in symbols, f"{lib.name} still exports or calls a seeded-defect switch"
        assert "retro_numerics" not in symbols, f"{lib.name} still exports or calls the GPU-numerics switch"
        blob = lib.read_bytes()
        left = [i.decode() for i in dotted if i in blob]
        assert not left, f"{lib.name} still holds seeded-defect IDs: {left[:5]}"

    # the same workload in the release build and in this (certifying) build, each in its own interpreter
    threads = {"RETRO_THREADS": "2", "OMP_NUM_THREADS": "2"}
    release_env = dict(site_view_env(target, tmp_path / "site-view"), **threads)
    release = _run([sys.executable, "-S", "-c", WORKLOAD, str(tmp_path / "r.gguf")], release_env, tmp_path)
    assert release.returncode == 0, release.stderr[-3000:]
    default = _run([sys.executable, "-c", WORKLOAD, str(tmp_path / "d.gguf")], dict(os.environ, **threads), tmp_path)
    assert default.returncode == 0, default.stderr[-3000:]
    got, want = json.loads(release.stdout), json.loads(default.stdout)
    assert (got["seeded_defects"], got["defects"], got["info"], got["mirror"], got["forced"], got["numerics"]) == (
        False,
        0,
        False,
        False,
        False,
        False,
    )
    assert (want["seeded_defects"], want["info"], want["mirror"], want["forced"], want["numerics"]) == (True,) * 5
    assert want["defects"] == len(ids)
    assert got["metrics"] == want["metrics"]
    assert got["digest"] == want["digest"], "the release build trained other parameters or logits"
    assert (tmp_path / "r.gguf").read_bytes() == (tmp_path / "d.gguf").read_bytes(), "the two runs began apart"

    # certification refuses the release build, and says why, before it runs anything
    refused = _run(
        [sys.executable, "-S", "-m", "retro.conformance.cli", "certify", "--out", str(tmp_path / "out")],
        release_env,
        tmp_path,
    )
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    assert "RETRO_SEEDED_DEFECTS=OFF" in refused.stderr
    assert not (tmp_path / "out").exists()

    # the benchmark that compares their speed runs on it (speed is read there, never asserted here)
    from retro import bench

    figures = bench.release_compare(tmp_path / "d.gguf", target, reps=2)
    assert figures["release_s_median"] > 0 and figures["this_build_s_median"] > 0
