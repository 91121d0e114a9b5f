"""A loaded GGUF model."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from . import _checks, _native
from ._handle import NativeHandle
from ._native_logs import forwarding
from .devices import Device
from .devices import devices as list_devices


class Model(NativeHandle):
    """A llama.cpp model. Load with :meth:`Model.load`; close explicitly or use as a context manager.

    Limits of the pinned llama.cpp that training users meet: ``token_embd.weight`` (and
    ``rope_freqs``) are never trained, and the K/V projections get gradients only when a context's
    ``n_ubatch`` equals its ``n_ctx`` (otherwise attention reads K/V from the cache, which has no
    gradient). A trainer also sets the model's training context length to its context's ``n_ctx``.
    """

    _h: _native.Model
    _exit_order = 2

    def __init__(self, handle: _native.Model, path: Path) -> None:
        self._h = handle
        self._opened()
        self.path = path

    @classmethod
    @forwarding
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        devices: Sequence[Device | int] | None = None,
        gpu_layers: int = 0,
        trainable: bool = False,
    ) -> Model:
        """Load a GGUF file.

        devices: the GPU/accelerator devices to offload to (None: all the build has; []: none, CPU
        only); gpu_layers: layers to offload (-1: all); trainable: load writable weights in memory (no mmap), required for
        training: the optimizer updates the weights in place.
        """
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"no model file at {p}")
        if not isinstance(trainable, bool):
            raise TypeError("trainable must be a bool")
        gl = _checks.integer("gpu_layers", gpu_layers, minimum=-1)
        idx: list[int] | None = None
        if devices is not None:
            # the CPU is always used; the list names the devices to offload to ([]: none)
            offload = {d.index: d for d in list_devices() if d.kind != "cpu"}
            idx = []
            for d in devices:
                i = d.index if isinstance(d, Device) else _checks.integer("device", d)
                if i not in offload:
                    raise ValueError(f"no offload device with index {i}; see retro.devices()")
                idx.append(i)
        if _checks.seeded("HARNESS-01.gpu-layers") and idx:
            gl = -1  # seeded defect: the layer count is ignored and every layer is offloaded
        return cls(_native.Model.load(str(p), idx, gl, trainable), p)

    # -- properties ---------------------------------------------------------------------------
    @property
    def trainable(self) -> bool:
        return bool(self._h.trainable)

    @property
    def n_vocab(self) -> int:
        return int(self._h.n_vocab)

    @property
    def n_ctx_train(self) -> int:
        return int(self._h.n_ctx_train)

    @property
    def n_layer(self) -> int:
        return int(self._h.n_layer)

    @property
    def n_embd(self) -> int:
        return int(self._h.n_embd)

    @property
    def architecture(self) -> str:
        """The model's general.architecture (e.g. "llama")."""
        return str(self._h.architecture)

    # -- tokens -------------------------------------------------------------------------------
    @forwarding
    def tokenize(self, text: str, *, add_special: bool = False, parse_special: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("text must be a str")
        return list(self._h.tokenize(text, add_special, parse_special))

    @forwarding
    def detokenize(self, tokens: Sequence[int] | np.ndarray, *, render_special: bool = False) -> str:
        arr = np.asarray(list(tokens) if not isinstance(tokens, np.ndarray) else tokens)
        if arr.size == 0:
            return ""
        ids = _checks.token_array("tokens", arr, self.n_vocab, ndim=1)
        return bytes(self._h.detokenize(ids.tolist(), render_special)).decode("utf-8", errors="replace")

    # -- weights ------------------------------------------------------------------------------
    def tensor_names(self) -> list[str]:
        return list(self._h.tensor_names())

    def tensor_devices(self) -> dict[str, str]:
        """The device each weight lives on (its buffer's device name: "CPU", "RPC0", "CUDA0", ...)."""
        return dict(self._h.tensor_devices())

    def tensor_memory(self) -> dict[str, str]:
        """Whether each weight lives in "host" or "device" memory. A GPU backend may keep the
        weights of the layers it does not offload in host buffers it pins (tensor_devices names the
        GPU for them): this says where the bytes are."""
        return {name: "host" if is_host else "device" for name, (_, is_host) in self._h.tensor_buffers().items()}

    @forwarding
    def tensor(self, name: str) -> np.ndarray:
        """A float32 copy of a weight tensor, outermost dimension first."""
        if not isinstance(name, str):
            raise TypeError("name must be a str")
        return self._h.tensor(name)

    @forwarding
    def parameters(self) -> dict[str, np.ndarray]:
        """float32 copies of every weight tensor, by name: all of one optimizer step's, read while
        no training call on this model runs (one on another thread is waited for)."""
        return dict(self._h.parameters())

    @forwarding
    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the model (with its current weights) as GGUF."""
        p = Path(path)
        if not p.parent.is_dir():
            raise FileNotFoundError(f"no folder {p.parent}")
        self._h.save(str(p))
        if not p.is_file():
            raise OSError(f"the model could not be written to {p}")
        return p

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"n_vocab={self.n_vocab} n_layer={self.n_layer}"
        return f"<retro.Model {self.path.name} {state}>"
