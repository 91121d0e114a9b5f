"""HARNESS-01: every clause is checked on the backend under test, and really there. The model of
every check lives on that backend's device, most nodes of its graphs are computed there, what it computes agrees with the same computation on
the CPU (the oracle, compared by NMSE as llama.cpp's test-backend-ops does) with none, part or all
of the model offloaded, and a backend without a device reads "not available"."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import numpy as np
import pytest

import retro
import retro.rpc
from retro import _child
from retro.conformance import backends, cli, support
from retro.conformance.evidence import Bound, against_oracle, bound, expect, nmse, on_path
from retro.conformance.plugin import not_supported
from retro.conformance.shapes import Shape
from retro.devices import BACKENDS

#: NMSE against the CPU: kernels may reorder float sums, never more (an RPC server with the CPU's
#: numerics runs the CPU's own kernels: 0). AdamW divides each gradient
#: by its own running magnitude, so rounding differences in small gradients grow into the
#: parameters, and the trained model's logits inherit them; what each measured, intact and under
#: the seeded defects, is in the report's bound table
TOLERANCE = {
    "loss": Bound(
        "HARNESS-01 train loss NMSE",
        9e-12,
        cpu=0.0,
        measured={"rpc": (1.5e-15, "")},  # the GPU-like server: 1.9e-16 (lavapipe 9.7e-13)
    ),
    "parameters": Bound(
        "HARNESS-01 parameters NMSE after 8 AdamW steps", 1e-5, cpu=0.0, measured={"rpc": (3e-8, "")}
    ),  # GPU-like: 3.5e-9 (lavapipe 3.6e-6)
    "logits": Bound("HARNESS-01 decode logits NMSE", 1e-5, cpu=0.0, measured={"rpc": (3e-9, "")}),  # 3.5e-10
    "moments": Bound(
        "HARNESS-01 AdamW moments NMSE",
        9e-5,
        cpu=0.0,
        measured={"rpc": (3e-8, "")},  # the GPU-like server: 3.1e-9 (lavapipe 9.6e-6)
    ),
}


#: where the weights are, with the backend's devices present: none offloaded, one layer, all
PLACEMENTS = {"no offload": 0, "partial offload": 1, "full offload": -1}


def _train_and_decode(backend: backends.Backend, path, shape: Shape, ds, gpu_layers: int = -1):
    """Two AdamW epochs and a decode: losses, parameters, AdamW moments and logits."""
    with (
        support.load(backend, path, gpu_layers=gpu_layers) as model,
        support.context(model, shape, n_ubatch=shape.micro_batch) as ctx,
    ):
        with retro.Trainer(ctx, optimizer=retro.AdamW(lr=1e-3), accumulation=2) as tr:
            losses = [tr.epoch(ds).train_loss for _ in range(2)]
            moments = tr.checkpoint().moments
        params = model.parameters()
        ctx.reset()
        logits = ctx.decode(ds.tokens[0, : shape.window // 8])
    return np.array(losses), params, logits, moments


def _agrees_with_cpu(placement: str, got, on_cpu) -> None:
    """Losses, parameters, logits and AdamW moments of _train_and_decode against the CPU's, by NMSE."""
    losses, params, logits, moments = got
    against_oracle("HARNESS-01", f"{placement}: train loss per epoch", losses, on_cpu[0], TOLERANCE["loss"])
    for name in sorted(on_cpu[1]):
        against_oracle(
            "HARNESS-01",
            f"{placement}: {name} after 8 AdamW steps",
            params[name],
            on_cpu[1][name],
            TOLERANCE["parameters"],
        )
    decoded = f"{placement}: logits of a {len(on_cpu[2])}-token decode"
    against_oracle("HARNESS-01", decoded, logits, on_cpu[2], TOLERANCE["logits"])
    for name in sorted(on_cpu[3]):
        for which, actual, expected in zip("mv", moments[name], on_cpu[3][name], strict=True):
            against_oracle(
                "HARNESS-01", f"{placement}: AdamW {which} of {name}", actual, expected, TOLERANCE["moments"]
            )


@pytest.mark.clause("HARNESS-01")
@pytest.mark.drives(*(f"gpu_layers={n}" for n in PLACEMENTS.values()))
def test_the_backend_under_test_holds_the_model_and_agrees_with_the_cpu(backend, model_path, shape, seed):
    with support.load(backend, model_path) as model:
        elsewhere, computed_here, nodes = support.placement(model, backend)
    wanted = backend.device_names
    with bound("HARNESS-01"):
        assert not elsewhere, f"weights not on {backend.name} ({', '.join(sorted(wanted))}): {elsewhere[:4]}"
    expect(
        "HARNESS-01",
        computed_here * 2 > nodes,
        f"{computed_here} of {nodes} nodes of a decode computed on {backend.name}",
    )

    # an absent backend is not available: the same build with this backend's devices gone
    built = set(retro.build_info()["backends"]) | {"cpu"}
    listed = [d.__dict__ for d in retro.devices()]
    present = backends.classify(built, listed)[backend.name]
    gone = backends.classify(built, [d for d in listed if d["name"] not in wanted])[backend.name]
    expect("HARNESS-01", present.available, f"{backend.name} has devices but reads not available")
    expect("HARNESS-01", not gone.available, f"{backend.name} without a device reads available")
    # and so does every backend with a device listed, by the registry's name of the device's
    # backend (ggml's listing; a device's own name, RPC[host:port] or Vulkan0, is not its backend)
    for registry_name, device_name in (("RPC", "RPC[127.0.0.1:50052]"), ("Vulkan", "Vulkan0"), ("CUDA", "CUDA0")):
        name = BACKENDS[registry_name]
        with_it = [*listed, {**listed[0], "name": device_name, "backend": registry_name}]
        expect(
            "HARNESS-01",
            backends.classify(built | {name}, with_it)[name].available,
            f"a {registry_name} device listed as {device_name} leaves {name} not available",
        )

    # the comparator every backend is held to the CPU by reads a known disagreement as what it is:
    # values 0.1 % off, an NMSE of 1e-6 (one that shrank every error would pass any backend)
    values = np.linspace(-3.0, 5.0, 1000)
    known = nmse(values * (1 + 1e-3), values)
    expect("HARNESS-01", math.isclose(known, 1e-6, rel_tol=1e-6), f"values 0.1 % off read as an NMSE of {known:.3g}")
    if backend.name == "cpu":
        return  # the CPU is the oracle
    # where each placement's bytes are: a GPU backend names its device for the host buffers it
    # pins, so the device a weight's buffer names cannot tell no offload from full offload
    for placement, gpu_layers in PLACEMENTS.items():
        with support.load(backend, model_path, gpu_layers=gpu_layers) as placed_model:
            memory = {n: m for n, m in placed_model.tensor_memory().items() if n not in support.INPUT_LAYER}
        on_device = sum(m == "device" for m in memory.values())
        held = {"no offload": on_device == 0, "partial offload": 0 < on_device < len(memory)}
        expect(
            "HARNESS-01",
            held.get(placement, on_device == len(memory)),
            f"{placement} (gpu_layers {gpu_layers}): {on_device} of {len(memory)} weights in device memory",
        )
    ds = support.windows(8, shape.window, shape.spec.n_vocab, seed)
    on_cpu = _train_and_decode(support.CPU, model_path, shape, ds)
    for placement, gpu_layers in PLACEMENTS.items():
        _agrees_with_cpu(placement, _train_and_decode(backend, model_path, shape, ds, gpu_layers), on_cpu)
        on_path(f"gpu_layers={gpu_layers}")


@pytest.mark.clause("HARNESS-01")
@pytest.mark.drives("rpc_servers=2")
def test_a_model_split_over_two_servers_agrees_with_the_cpu(backend, model_path, shape, seed):
    """The RPC backend as users scale it: the layers split over the run's server and a second one
    (each link carrying its own share of every compute), trained and decoded as on the CPU."""
    if backend.name != "rpc":
        not_supported("a model split over two servers is a topology of the RPC backend")
    with retro.rpc.Server(numerics=backends.rpc_numerics()) as second:
        devices = [*backend.offload_devices, *(d.index for d in retro.rpc.connect(second.endpoint))]
        split = backends.Backend("rpc", True, devices=tuple(d.__dict__ for d in retro.devices() if d.index in devices))
        with support.load(split, model_path, trainable=False) as model:
            placed = {n: d for n, d in model.tensor_devices().items() if n not in support.INPUT_LAYER}
        per_device = {d: sum(v == d for v in placed.values()) for d in sorted(set(placed.values()))}
        expect(
            "HARNESS-01",
            set(per_device) == set(split.device_names) and len(per_device) == 2,
            f"the weights are not split over the two servers' devices: {per_device}",
        )
        ds = support.windows(8, shape.window, shape.spec.n_vocab, seed)
        got = _train_and_decode(split, model_path, shape, ds)
    _agrees_with_cpu("two servers", got, _train_and_decode(support.CPU, model_path, shape, ds))
    on_path("rpc_servers=2")
    _serves_as_its_help_says()


@pytest.mark.clause("HARNESS-01")
def test_a_certification_lists_a_requested_backend_it_lacks(backend, tmp_path):
    """A certification asked for a backend this machine lacks (beside the CPU) lists it in its
    package as not available, with the reason, in each selected clause's row: it never drops out of
    results.json. A canary run of one case keeps it short."""
    absent = next((n for n, b in backends.discover().items() if not b.available and n != "rpc"), None)
    if absent is None:
        not_supported("every GPU backend this project builds is available on this machine")
    out = tmp_path / "out"
    canaries = Path(cli.__file__).parent / "canaries"
    cli.main(
        ["certify", "--cases", str(canaries), "--backend", f"cpu,{absent}", "-k", "test_passes", "--clauses",
         "HARNESS-06", "--out", str(out), "-j", "1", "-q", "--case-timeout", "120"]
    )  # fmt: skip
    written = json.loads((out / "results.json").read_text(encoding="utf-8"))
    listed = written["backends"].get(absent, {})
    expect(
        "HARNESS-01",
        listed.get("status") == "not available" and bool(listed.get("reason")),
        f"{absent}, asked for and absent, is listed as {listed or 'nothing'}",
    )
    rows = {c: written["clauses"][c].get(absent) for c in written["selected"]}
    expect(
        "HARNESS-01",
        set(rows.values()) == {"not available"},
        f"{absent}'s clause rows read {sorted(set(map(str, rows.values())))}",
    )


def _serves_as_its_help_says() -> None:
    """The command a user starts each further server with says how to start it and what it serves,
    and refuses a thread count it cannot serve with before it listens."""
    run = _child.python("-m", "retro.rpc")
    helped = subprocess.run([*run, "--help"], capture_output=True, text=True, timeout=120)
    text = " ".join(helped.stdout.split())
    expect(
        "HARNESS-01",
        helped.returncode == 0
        and text.startswith("usage: python -m retro.rpc ")
        and "Serve this process's CPU" in text,
        f"python -m retro.rpc --help: exit {helped.returncode}, {text[:300]!r}",
    )
    refused = subprocess.run(
        [*run, "--port", str(retro.rpc.free_port()), "--threads", "0"], capture_output=True, text=True, timeout=120
    )
    expect(
        "HARNESS-01",
        refused.returncode != 0 and "threads must be >= 1" in refused.stderr,
        f"python -m retro.rpc --threads 0: exit {refused.returncode}, {refused.stderr[-300:]!r}",
    )
