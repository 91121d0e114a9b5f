"""ggml's RPC backend: a device served by another process over TCP.

``Server`` runs ``python -m retro.rpc`` (this process's CPU served on 127.0.0.1) in a child
process: a real remote device with its own buffers and transport, which can be killed, stopped
and restarted like a server on another machine. ``connect`` makes a server's devices usable by
:meth:`retro.Model.load`.

A lost server (killed, stopped past the deadline, reset) fails the link for good (fork patches
0017/0018): the next training step raises :class:`retro.ComputeError` and poisons the trainer,
a decode raises :class:`retro.DecodeError`. Models and contexts created after the server is back
connect again.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from types import TracebackType
from typing import IO

from . import _checks, _child, _native
from .devices import Device, devices
from .errors import BackendError

LOOPBACK = "127.0.0.1"
#: how long a send or receive may wait for a server before the link is declared lost
DEFAULT_DEADLINE_S = 30.0


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """'host:port' -> (host, port), checked before anything native sees it."""
    if not isinstance(endpoint, str):
        raise TypeError("endpoint must be a str 'host:port'")
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"endpoint must be 'host:port' with a port in 1..65535, got {endpoint!r}")
    return host, int(port)


def set_deadline(seconds: float) -> None:
    """Bound each send and receive of the RPC connections made from now on (0: wait for ever).
    Longer than the longest compute a server may take: a reply is due only after it."""
    if isinstance(seconds, bool) or not (isinstance(seconds, (int, float)) and 0 <= seconds <= 86400):
        raise ValueError("the deadline must be a number of seconds in [0, 86400]")
    _native.rpc_set_timeout_ms(int(seconds * 1000))


def connect(endpoint: str, *, deadline_s: float = DEFAULT_DEADLINE_S) -> list[Device]:
    """Register the devices of the server at `endpoint` and return them; `deadline_s` is passed to
    :func:`set_deadline` first."""
    parse_endpoint(endpoint)
    # seeded defect: a deadline shorter than a slow server's step, which takes a stall for a loss
    set_deadline(1.0 if _checks.seeded("FAIL-07.deadline") else deadline_s)
    if not _native.rpc_built():
        raise BackendError("this build has no RPC backend (RETRO_RPC=OFF)")
    if _native.rpc_connect(endpoint) == 0:
        raise BackendError(f"no RPC server answers at {endpoint}")
    return [d for d in devices() if d.backend == "RPC" and d.description == endpoint]


#: how a server's CPU computes matrix products, forward and backward: as upstream, or as CUDA does on
#: an H100/H200 (by the product's row count: TF32 inputs for 4 to 16 rows, truncated as its tensor
#: cores take F32 data or, "-nearest", rounded; the F32 side against the F16 KV cache in F16; a warp's
#: summation order; a test hook of the fork, absent from a release build), so that a check's bounds
#: can be proved against a GPU's numerics where no GPU is
NUMERICS = ("cpu", "gpu-like", "gpu-like-nearest")


def _numerics(numerics: str) -> str:
    if numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {', '.join(NUMERICS)}, got {numerics!r}")
    if numerics != "cpu" and not _native.hooks.seeded_defects:
        raise ValueError(f"numerics {numerics!r} is a test hook, and this build has none (RETRO_SEEDED_DEFECTS=OFF)")
    return numerics


def free_port(host: str = LOOPBACK) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _mapped_bytes(pid: int) -> int:
    """The address space process `pid` maps now (VmSize)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmSize for process {pid}")


class Server:
    """An RPC server in a child process on 127.0.0.1, serving that process's CPU."""

    def __init__(
        self, *, port: int | None = None, threads: int = 1, start_timeout_s: float = 60.0, numerics: str = "cpu"
    ) -> None:
        self.port = free_port() if port is None else _checks.integer("port", port, minimum=1, maximum=65535)
        self.threads = _checks.integer("threads", threads, minimum=1, maximum=512)
        self.numerics = _numerics(numerics)
        self.start_timeout_s = start_timeout_s
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None  # the server's stderr

    @property
    def endpoint(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def start(self) -> Server:
        if self.running:
            raise RuntimeError("the server is already running")
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - open while the server runs; kill() closes it
        self.process = subprocess.Popen(
            _child.python(
                "-m", "retro.rpc", "--port", str(self.port), "--threads", str(self.threads), "--numerics", self.numerics
            ),
            stdout=subprocess.DEVNULL,
            stderr=self._log,
            # glibc maps every allocation of 128 KiB or more on its own (no threshold that grows
            # with use): a device buffer then always takes new address space, so a memory cap
            # (limit_memory) fails it for real rather than letting it reuse freed heap
            env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 << 10)},
        )
        end = time.monotonic() + self.start_timeout_s
        while time.monotonic() < end:
            if self.process.poll() is not None:
                self._log.seek(0)
                tail = self._log.read().decode(errors="replace").strip().splitlines()[-5:]
                raise BackendError(
                    f"the RPC server on {self.endpoint} exited with {self.process.returncode}: " + " | ".join(tail)
                )
            with contextlib.suppress(OSError), socket.create_connection((LOOPBACK, self.port), timeout=1):
                return self
            time.sleep(0.05)
        self.kill()
        raise BackendError(f"the RPC server on {self.endpoint} did not listen within {self.start_timeout_s} s")

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL: the device dies with whatever it held."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def stop(self) -> None:
        """SIGSTOP: the server stays connected and answers nothing."""
        if self.running:
            assert self.process is not None
            os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.running:
            assert self.process is not None
            os.kill(self.process.pid, signal.SIGCONT)

    def limit_memory(self, extra_bytes: int | None) -> None:
        """Cap the server's address space (RLIMIT_AS, as ``ulimit -v`` would) at what it maps now
        plus `extra_bytes` (None: no cap): the remote device's next allocation that does not fit
        fails for real, as on a device whose memory is full. Linux only."""
        if not self.running:
            raise RuntimeError("the server is not running")
        assert self.process is not None
        if not hasattr(resource, "prlimit"):
            raise NotImplementedError("capping another process's memory needs Linux (prlimit)")
        # the soft limit only: it is the one enforced, and lowering the hard one could not be undone;
        # no cap means the hard limit (which the caller's own cap, inherited, may have set)
        _, hard = resource.prlimit(self.process.pid, resource.RLIMIT_AS)
        soft = hard
        if extra_bytes is not None:
            cap = _mapped_bytes(self.process.pid) + _checks.integer("extra_bytes", extra_bytes, maximum=2**62)
            soft = cap if hard == resource.RLIM_INFINITY else min(cap, hard)
        resource.prlimit(self.process.pid, resource.RLIMIT_AS, (soft, hard))

    def restart(self) -> Server:
        self.kill()
        return self.start()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.resume()
        self.kill()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m retro.rpc", description="Serve this process's CPU over ggml RPC.")
    ap.add_argument("--host", default=LOOPBACK)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--numerics", choices=NUMERICS, default="cpu", help="how matrix products are computed (NUMERICS)")
    args = ap.parse_args(argv)
    endpoint = f"{args.host}:{args.port}"
    parse_endpoint(endpoint)
    _native.hooks.set_numerics(_numerics(args.numerics))
    _native.rpc_serve(endpoint, _checks.integer("threads", args.threads, minimum=1, maximum=512))
    return 1  # rpc_serve returns only by raising


if __name__ == "__main__":
    sys.exit(main())
