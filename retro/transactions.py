"""Tensor transactions: read or edit named graph nodes while a context decodes, without ever
letting a handler crash the interpreter or corrupt the context.

A :class:`Profile` records, for one llama.cpp pin, model architecture and backend, the nodes a
decode's graph computes (names, element types, row widths). Selectors are made from a profile
(:meth:`Profile.select`) and given to :class:`TensorTransactions`, which a :class:`retro.Context`
takes when it is created. In every decode of that context, the caller's and those a generation
makes internally, each selected node is checked against its selector once it is computed (exact
name, type, two-dimensional contiguous layout, row width, row bound, one row per logical row of
the submitted batch) and copied; the handler gets the copy. A ``mutable-f32`` selector's copy is
written back once, after the handler returned, and only when every value is finite. Retained
selectors keep their copies, committed per decode, until :meth:`retro.Context.drain_captures`.

A handler that raises, or a node that does not match, fails the decode with
:class:`retro.TensorCallbackError` after the decode ran to its end: the context is causally
advanced (its KV cache holds the decode's tokens; nothing is rolled back) and the failure is
sticky, refusing every later decode. Nothing is matched by prefix, coerced or inferred.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import _checks, _native
from ._failure import TransactionFailure
from ._selector import _ACCESS, _DTYPES, _ROWS, _SELECTOR_TOKEN, Access, DType, RowKind, Selector
from .model import Model
from .unsafe import TensorCapture

__all__ = [
    "Capture",
    "Generation",
    "NodeLayout",
    "Profile",
    "ProfileError",
    "Selector",
    "TensorTransactions",
    "Transaction",
    "TransactionFailure",
]


MAX_SELECTORS = 64
MAX_NAME_LENGTH = 63  # GGML_MAX_NAME - 1
MAX_ROWS = 1 << 20
MAX_ROW_ELEMENTS = 1 << 24
DEFAULT_RETAINED_LIMIT = 256 << 20
# the probe decodes: rows that follow the token count are per-token rows, rows that follow the
# output count are per-output rows, in both
_PROBES = ((3, 1), (5, 2))


class ProfileError(ValueError):
    """A profile or selector does not fit: refused before any native state changes."""


@dataclass(frozen=True)
class NodeLayout:
    """A graph node as a profile recorded it."""

    name: str
    dtype: str  # ggml's type name ("f32", "i32", "f16", ...)
    shape: tuple[int, ...]  # ne[0..3] in the first probe decode
    contiguous: bool
    occurrences: int  # nodes of this name in one decode's graph
    rows: RowKind | None  # which logical rows of the batch its rows are, if any

    @property
    def row_elements(self) -> int:
        return self.shape[0]

    @property
    def why_not_selectable(self) -> str | None:
        if self.occurrences != 1:
            return f"{self.occurrences} nodes of the graph have this name"
        if self.dtype not in _DTYPES:
            return f"its element type is {self.dtype}, not f32 or i32"
        if not self.contiguous or self.shape[2:] != (1, 1):
            return f"it is not a two-dimensional contiguous tensor (shape {list(self.shape)})"
        if self.rows is None:
            return "its rows are neither the batch's tokens nor its outputs"
        return None


@dataclass(frozen=True)
class Profile:
    """The graph of one pin, model architecture and backend: what selectors are checked against.

    Record it with :meth:`record`, keep it with :meth:`save`; a loaded profile is validated
    against the model it is used with (:meth:`validate`)."""

    pin: str
    architecture: str
    backend: tuple[str, ...]  # the devices holding the model's weights
    nodes: Mapping[str, NodeLayout] = field(repr=False)

    @classmethod
    def record(cls, model: Model) -> Profile:
        """Decode twice on a fresh context of `model` and record every node of the graph."""
        if not isinstance(model, Model):
            raise TypeError("model must be a retro.Model")
        probes = [_native.probe_graph(model._h, n, o, 1) for n, o in _PROBES]
        counts: dict[str, int] = {}
        for name, *_ in probes[0]:
            counts[name] = counts.get(name, 0) + 1
        first: dict[str, list[tuple[str, tuple[int, ...], bool]]] = {}
        for probe in probes:
            seen: set[str] = set()
            for name, dtype, ne, contiguous, _device in probe:
                if name not in seen:
                    seen.add(name)
                    first.setdefault(name, []).append((dtype, tuple(ne), contiguous))
        nodes = {}
        for name, layouts in first.items():
            rows: RowKind | None = None
            if len(layouts) == len(_PROBES):
                if all(s[1] == n for (_, s, _), (n, _) in zip(layouts, _PROBES, strict=True)):
                    rows = "tokens"
                elif all(s[1] == o for (_, s, _), (_, o) in zip(layouts, _PROBES, strict=True)):
                    rows = "outputs"
            dtype, shape, contiguous = layouts[0]
            nodes[name] = NodeLayout(name, dtype, shape, contiguous, counts.get(name, 0), rows)
        return cls(build_pin(), model.architecture, model_backend(model), nodes)

    def validate(self, model: Model) -> None:
        """Raise ProfileError unless this profile was recorded for this pin, the model's
        architecture and the backend holding its weights."""
        if self.pin != build_pin():
            raise ProfileError(f"the profile was recorded with llama.cpp {self.pin}, this build is {build_pin()}")
        if self.architecture != model.architecture:
            raise ProfileError(
                f"the profile was recorded for architecture {self.architecture!r}, the model is {model.architecture!r}"
            )
        if self.backend != model_backend(model) and not _checks.seeded("TX-PROF-01"):  # seeded defect
            raise ProfileError(
                f"the profile was recorded on {list(self.backend)}, the model's weights are on {list(model_backend(model))}"
            )

    def select(
        self,
        name: str,
        *,
        access: Access = "read-only",
        retain: bool = False,
        max_rows: int = 512,
        dtype: DType | None = None,
        row_elements: int | None = None,
    ) -> Selector:
        """A selector of the node named exactly `name` (the whole name, byte for byte). `dtype`
        and `row_elements`, when given, must be what the profile recorded: nothing is coerced."""
        if not isinstance(name, str):
            raise TypeError("name must be a str")
        if access not in _ACCESS:
            raise ValueError(f"access must be one of {sorted(_ACCESS)}")
        if not isinstance(retain, bool):
            raise TypeError("retain must be a bool")
        max_rows = _checks.integer("max_rows", max_rows, minimum=1, maximum=MAX_ROWS)
        node = self.nodes.get(name)
        if node is None:
            raise ProfileError(f"no node of the profile is named exactly {name!r}")
        why = node.why_not_selectable
        if why:
            raise ProfileError(f"{name!r} cannot be selected: {why}")
        if dtype is not None and dtype != node.dtype:
            raise ProfileError(f"{name!r} is {node.dtype}, not {dtype}")
        # seeded defect: the row width asked for is not held against the profile's
        if row_elements is not None and row_elements != node.row_elements and not _checks.seeded("TX-PROF-01.rows"):
            raise ProfileError(f"{name!r} has {node.row_elements} elements per row, not {row_elements}")
        if access == "mutable-f32" and node.dtype != "f32":
            raise ProfileError(f"{name!r} is {node.dtype}: only f32 nodes can be mutable")
        assert node.rows is not None
        return Selector(
            name,
            node.dtype,  # type: ignore[arg-type]
            node.row_elements,
            max_rows,
            access,
            retain,
            node.rows,
            self,
            _token=_SELECTOR_TOKEN,
        )

    # -- files ------------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(
            {
                "pin": self.pin,
                "architecture": self.architecture,
                "backend": list(self.backend),
                "nodes": [dataclasses.asdict(n) for n in self.nodes.values()],
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> Profile:
        try:
            raw = json.loads(text)
            nodes = {}
            for n in raw["nodes"]:
                layout = NodeLayout(
                    str(n["name"]),
                    str(n["dtype"]),
                    tuple(int(x) for x in n["shape"]),
                    bool(n["contiguous"]),
                    int(n["occurrences"]),
                    n["rows"] if n["rows"] in _ROWS else None,
                )
                if len(layout.shape) != 4:
                    raise ValueError("a node's shape has four dimensions")
                nodes[layout.name] = layout
            pin = str(raw["pin"])
            if _checks.seeded("TX-PROF-01.loaded-pin"):
                pin = build_pin()  # seeded defect: a loaded profile takes this build's pin
            return cls(pin, str(raw["architecture"]), tuple(str(b) for b in raw["backend"]), nodes)
        except (KeyError, TypeError, ValueError) as e:
            raise ProfileError(f"not a tensor-transaction profile: {e}") from None

    def save(self, path: str | os.PathLike[str]) -> Path:
        out = Path(path)
        out.write_text(self.to_json())
        return out

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Profile:
        return cls.from_json(Path(path).read_text())


def build_pin() -> str:
    return str(json.loads(_native.build_info())["llama_cpp_commit"])


def model_backend(model: Model) -> tuple[str, ...]:
    return tuple(sorted(set(model.tensor_devices().values())))


@dataclass(slots=True)
class Transaction:
    """What a handler gets: one selected node of one micro-batch. `data` is a copy the handler
    owns ([rows, row_elements]); writable only for a ``mutable-f32`` selector, whose edits are
    written back after the handler returns, if every value is finite."""

    name: str
    decode: int  # native decodes of the context before this one
    ubatch: int  # micro-batch of that decode
    first_row: int  # logical row of the submitted batch that data's first row is
    positions: np.ndarray  # the sequence positions of data's rows
    data: np.ndarray


Handler = Callable[[Transaction], object]


@dataclass(frozen=True)
class Capture:
    """A retained node's rows from one native decode, committed when that decode succeeded."""

    name: str
    decode: int
    positions: np.ndarray
    data: np.ndarray


@dataclass(frozen=True)
class Generation:
    tokens: list[int]
    decodes: int  # decodes of the target context
    drafted: int = 0  # tokens a draft context proposed
    accepted: int = 0  # of those, kept


class TensorTransactions:
    """Selectors and a handler, given to exactly one :class:`retro.Context` when it is created.

    The complete native state is built here, at the heap address the context's eval callback
    and decode hooks will be given; the context takes it over without moving it and frees it only
    after llama.cpp's context is freed."""

    def __init__(
        self,
        profile: Profile,
        selectors: Iterable[Selector],
        handler: Handler | None = None,
        *,
        retained_limit: int = DEFAULT_RETAINED_LIMIT,
        captures: Iterable[TensorCapture] = (),
    ) -> None:
        if not isinstance(profile, Profile):
            raise TypeError("profile must be a retro.transactions.Profile")
        chosen = list(selectors)
        borrowed = list(captures)
        if not all(isinstance(c, TensorCapture) for c in borrowed):
            raise TypeError("captures must be TensorCapture objects (retro.unsafe)")
        specs = []
        for s in chosen + [c.selector for c in borrowed]:
            if not isinstance(s, Selector):
                raise TypeError("selectors must come from Profile.select()")
            if s.profile is not profile:
                raise ProfileError(f"the selector of {s.name!r} was made from another profile")
        names = [s.name for s in chosen + [c.selector for c in borrowed]]
        if not 1 <= len(names) <= MAX_SELECTORS:
            raise ValueError(f"between 1 and {MAX_SELECTORS} selectors")
        if len(set(names)) != len(names):
            raise ValueError("a node may be selected once")
        if handler is not None and not callable(handler):
            raise TypeError("handler must be callable")
        if handler is None and any(s.access == "mutable-f32" or not s.retain for s in chosen):
            raise ValueError("selectors that are not retained, and mutable ones, need a handler")
        self.retained_limit = _checks.integer("retained_limit", retained_limit, minimum=0, maximum=2**62)
        for s in chosen:
            if s.retain and s.max_rows * s.row_elements * 4 > self.retained_limit:
                raise ValueError(
                    f"{s.name!r}: one decode's rows ({s.max_rows} x {s.row_elements}) exceed retained_limit"
                )
            specs.append(s._spec())
        for c in borrowed:
            specs.append(c.selector._spec(c.address, c.capacity))
        self.profile = profile
        self.selectors = tuple(chosen)
        self.captures = tuple(borrowed)
        self._h = _native.Transactions(specs, _dispatcher(handler), self.retained_limit)

    @property
    def address(self) -> int:
        """The native state's address: the eval-callback user data of the context that takes it."""
        return int(self._h.address)

    @property
    def taken(self) -> bool:
        return bool(self._h.taken)


def _dispatcher(handler: Handler | None) -> Callable[..., None] | None:
    # a closure over the handler only: the native state must not keep the TensorTransactions
    # object (and with it, itself) alive
    if handler is None:
        return None

    def dispatch(name: str, decode: int, ubatch: int, first_row: int, positions: np.ndarray, data: np.ndarray) -> None:
        handler(Transaction(name, decode, ubatch, first_row, positions, data))

    return dispatch


def main(argv: list[str] | None = None) -> int:
    """``retro-profile MODEL --out PROFILE``: record and save the profile of a model on a backend."""
    ap = argparse.ArgumentParser(
        prog="retro-profile",
        description="Record the tensor-transaction profile of a model (llama.cpp pin, architecture, "
        "backend, and every node of a decode's graph) for selectors to be bound to.",
    )
    ap.add_argument("model", type=Path, help="a GGUF file")
    ap.add_argument("--out", type=Path, required=True, help="where to write the profile (JSON)")
    ap.add_argument("--device", type=int, action="append", default=None, help="offload device index (repeatable)")
    ap.add_argument("--gpu-layers", type=int, default=-1, help="layers to offload (-1: all)")
    args = ap.parse_args(argv)
    devices = [] if args.device is None else args.device
    with Model.load(args.model, devices=devices, gpu_layers=args.gpu_layers if devices else 0) as model:
        profile = Profile.record(model)
    profile.save(args.out)
    selectable = [n for n in profile.nodes.values() if n.why_not_selectable is None]
    print(f"{args.out}: llama.cpp {profile.pin}, {profile.architecture} on {', '.join(profile.backend)}")
    print(f"{len(profile.nodes)} node names, {len(selectable)} selectable:")
    for n in selectable:
        print(f"  {n.name:28} {n.dtype} x {n.row_elements} per {'token' if n.rows == 'tokens' else 'output'}")
    return 0
