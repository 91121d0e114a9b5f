"""Which backends this machine and this build can certify.

A backend is available when the build has it and a device of it is present. An absent backend is
"not available" (never "pass"), with the reason. Discovery runs in a child interpreter
(``discover_isolated``), so the orchestrating process never loads a GPU runtime. The RPC backend's
device is a server the harness starts on 127.0.0.1; a child learns its endpoint from RPC_SERVERS_ENV.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field

from retro import _child
from retro.devices import BACKENDS, backend_name

from . import registry

#: the backends this project builds, by our names (retro.devices.BACKENDS)
KNOWN = tuple(BACKENDS.values())
#: comma-separated host:port of the RPC servers a certification child connects to
RPC_SERVERS_ENV = "RETRO_CONFORMANCE_RPC_SERVERS"
#: how those servers' CPU computes F32 matrix products (retro.rpc.NUMERICS): "gpu-like" certifies
#: the RPC backend as a GPU, its bounds those of a GPU's kernels (certify --numerics)
RPC_NUMERICS_ENV = "RETRO_CONFORMANCE_RPC_NUMERICS"
#: how long a link to those servers waits for a reply (retro.rpc.set_deadline): the slowest step of
#: the run's shape profiles (shapes.Shape.step_deadline_s), the binding's default when unset
RPC_DEADLINE_ENV = "RETRO_CONFORMANCE_RPC_DEADLINE_S"


def rpc_numerics() -> str:
    """The numerics of this run's RPC servers; a server a check starts for itself computes alike."""
    return os.environ.get(RPC_NUMERICS_ENV, "cpu")


#: backends on which two runs of one computation give the same bits, with what showed it: two runs on
#: one of them (a determinism check, a result against the same result reached another way on the
#: same backend) are compared bitwise (support.assert_params_equal). Any other backend is compared
#: within support.CLOSE until its run-to-run spread is measured.
REPEATABLE = {
    "cpu": "ggml's CPU kernels split rows across threads, never a sum: BASE-02 holds them bitwise",
    "rpc": "the server is ggml's CPU backend, with the CPU's numerics or the GPU-like rounding (a "
    "function of its inputs); the worst same-backend comparison of each of 72 cases at b08cb0a: 0",
    "vulkan": "ggml-vulkan's shaders reduce in a fixed order, without atomics; the worst same-backend "
    "comparison of each of 69 cases of the certification at b08cb0a on lavapipe: 0",
}


#: backends whose kernels are compiled before they are used (the warm-up, warm_up.py, would compile
#: nothing there), with why
PRECOMPILED = {
    "cpu": "ggml's CPU kernels are compiled with the library",
    "rpc": "the server is ggml's CPU backend: its kernels are the CPU's, compiled with it",
}


def repeatable(name: str) -> bool:
    """Whether two runs on backend `name` are held to the same bits (REPEATABLE)."""
    return name in REPEATABLE


def cpu_numerics(name: str) -> bool:
    """Whether backend `name` computes with the CPU's own kernels and numerics: the CPU, and the
    RPC backend (whose server is ggml's CPU backend) unless its servers compute like a GPU."""
    return name == "cpu" or (name == "rpc" and rpc_numerics() == "cpu")


@dataclass(frozen=True)
class Backend:
    name: str
    available: bool
    reason: str = ""
    devices: tuple[dict, ...] = field(default_factory=tuple)

    @property
    def offload_devices(self) -> list[int] | None:
        """Device indices to load a model on: [] keeps it on the CPU."""
        if self.name == "cpu":
            return []
        return [d["index"] for d in self.devices]

    @property
    def device_names(self) -> set[str]:
        return {d["name"] for d in self.devices}

    @property
    def description(self) -> str:
        return "; ".join(d["description"] for d in self.devices)

    def to_json(self) -> dict:
        return {
            "status": "available" if self.available else "not available",
            "reason": self.reason,
            "device": self.description,
            "devices": [{k: d[k] for k in ("name", "description", "memory_total")} for d in self.devices],
        }

    @classmethod
    def from_json(cls, name: str, data: dict) -> Backend:
        return cls(name, data["available"], data["reason"], tuple(data["devices"]))


def classify(built: set[str], devices: list[dict]) -> dict[str, Backend]:
    """Each known backend from what the build compiled and the devices listed (dicts of
    retro.Device's fields): available only with a device of it."""
    found: dict[str, list[dict]] = {}
    for d in devices:
        # seeded defect HARNESS-01.device-name: grouped by the device's own name
        found.setdefault(
            backend_name(d["name" if registry.seeded("HARNESS-01.device-name") else "backend"]), []
        ).append(d)
    out = {}
    for name in KNOWN:
        if found.get(name) or (
            registry.seeded("HARNESS-01.absent") and name in built
        ):  # seeded defect: compiled = available
            out[name] = Backend(name, True, devices=tuple(found.get(name, ())))
        elif name in built:
            why = "no RPC server was given" if name == "rpc" else "no device of it is present"
            out[name] = Backend(name, False, f"compiled into this build, but {why}")
        else:
            out[name] = Backend(name, False, "not compiled into this build")
    return out


def discover() -> dict[str, Backend]:
    """This process's view: connects to the RPC servers named in RPC_SERVERS_ENV first."""
    import retro
    import retro.rpc

    built = set(retro.build_info().get("backends", [])) | {"cpu"}
    unreachable = []
    deadline_s = float(os.environ.get(RPC_DEADLINE_ENV, retro.rpc.DEFAULT_DEADLINE_S))
    for endpoint in filter(None, os.environ.get(RPC_SERVERS_ENV, "").split(",")):
        try:
            retro.rpc.connect(endpoint, deadline_s=deadline_s)
        except retro.BackendError as err:
            unreachable.append(str(err))
    out = classify(built, [d.__dict__ for d in retro.devices()])
    if unreachable and not out["rpc"].available:
        out["rpc"] = Backend("rpc", False, "; ".join(unreachable))
    return out


def discover_isolated(env: dict[str, str] | None = None) -> dict[str, Backend]:
    """discover() in a child interpreter (its GPU runtimes and connections die with it)."""
    done = subprocess.run(
        _child.python("-m", "retro.conformance.backends"),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode:
        raise RuntimeError(f"backend discovery failed:\n{done.stderr[-4000:]}")
    data = json.loads(done.stdout.strip().splitlines()[-1])
    return {name: Backend.from_json(name, b) for name, b in data.items()}


def parse_selection(text: str | None) -> list[str]:
    """'cpu', 'cuda,vulkan' or 'all' to backend names; unknown names are an error."""
    if not text:
        return ["cpu"]
    names = [t.strip().lower() for t in text.split(",") if t.strip()]
    if "all" in names:
        return list(KNOWN)
    bad = [n for n in names if n not in KNOWN]
    if bad:
        raise ValueError(f"unknown backend(s) {bad}; known: {', '.join(KNOWN)} or all")
    return list(dict.fromkeys(names))


if __name__ == "__main__":
    found = discover()
    print(
        json.dumps({n: {"available": b.available, "reason": b.reason, "devices": b.devices} for n, b in found.items()})
    )
