"""The geometries the checks run at, as data: one table of named shape profiles (as test-backend-ops
keeps its cases), read by every check through the `shape` fixture (cases/conftest.py). A check says
which profiles it runs at with @pytest.mark.shapes (the tiny one alone when it says nothing); each
case records the profile it passed at as the path `shape=<name>`, so results.json and the reports
say at which profiles each clause passed. A check holds no size of its own: it takes them from its
profile, or computes them from it (half a window, two windows)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from retro.testing import TinyLlamaSpec


@dataclass(frozen=True)
class Shape:
    name: str
    #: the generated model's TinyLlamaSpec fields beyond the defaults (its seed comes from the run)
    model: Mapping[str, Any]
    #: tokens of a training window, and the n_ctx (and n_batch) of the contexts that train them
    window: int
    #: the n_ubatch at which a window is trained in parts (several micro-batches per window)
    micro_batch: int
    #: n_batch and n_ubatch of the decoding contexts of the tensor-transaction checks: several
    #: micro-batches per decode, so that a capture spans them
    decode_batch: int
    decode_micro_batch: int
    #: the longest one step or decode may take on a slow machine (two cores, a GPU-like RPC server,
    #: seeded-defect runs beside it): how long an RPC link of the run waits for a reply
    step_deadline_s: float = 30.0
    #: what the training math is held to (BASE-01's numpy oracle): numpy's whole gradient of every
    #: weight (autograd), or, where that costs minutes a window, the head's weights' alone in
    #: closed form (every class of the cross-entropy reaches them)
    whole_gradient: bool = True
    #: the checks held to an oracle token by token (numpy's gradient and loss, the heads' sums):
    #: tokens of their windows (the window where a step is cheap, else whole micro-batches of one),
    #: and windows per step of the numpy oracle's
    oracle_window: int = 0
    oracle_period: int = 2
    #: why these sizes: which kernels and paths they reach
    purpose: str = ""
    #: the TinyLlamaSpec of the profile's model, its seed aside
    spec: TinyLlamaSpec = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        spec = TinyLlamaSpec(**self.model)
        if spec.n_ctx != self.window:  # upstream's loop (the oracle) trains windows of n_ctx_train
            raise ValueError(f"shape {self.name}: the model's n_ctx must be the window")
        if self.window % self.micro_batch or self.decode_batch % self.decode_micro_batch:
            raise ValueError(f"shape {self.name}: a window must split into whole micro-batches")
        if self.oracle_window % self.micro_batch or not 0 < self.oracle_window <= self.window:
            raise ValueError(f"shape {self.name}: the oracle's windows must be whole micro-batches of a window")
        object.__setattr__(self, "spec", spec)

    def __str__(self) -> str:  # the case id's parameter value: shape=<name>
        return self.name

    def model_spec(self, seed: int, **overrides: Any) -> TinyLlamaSpec:
        """The profile's model for `seed`, with `overrides` (a deeper or wider variant, a draft)."""
        return dataclasses.replace(self.spec, seed=seed, **overrides)

    @property
    def oracle_micro_batch(self) -> int:
        """The n_ubatch that trains oracle_window: the whole window, or micro_batch within one."""
        return self.window if self.oracle_window == self.window else self.micro_batch

    @property
    def parts(self) -> int:
        """Micro-batches per window at `micro_batch`."""
        return self.window // self.micro_batch


#: a case's parameter for its profile, and the path its passing intact run records: shape=<name>
PATH_PREFIX = "shape="

#: the profiles, by name; "tiny" is every check's default
SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape(
            "tiny",
            model={},
            window=256,
            micro_batch=64,
            decode_batch=64,
            decode_micro_batch=4,
            oracle_window=256,
            purpose="a model of vocabulary 512, width 64 and 2 layers that every check can afford on every backend, "
            "many times over (the seeded-defect runs): the contracts' logic at every path",
        ),
        Shape(
            "realistic",
            model={
                "vocabulary": "llama-spm",
                "n_vocab": 32000,
                "n_embd": 2048,
                "n_layer": 1,
                "n_head": 16,
                "n_head_kv": 4,
                "n_ff": 5632,
                "n_ctx": 512,
            },
            window=512,
            micro_batch=64,
            decode_batch=512,
            decode_micro_batch=64,
            # a whole window's AdamW step on a GPU-like server took 30 s on two busy cores
            step_deadline_s=300.0,
            # numpy's whole gradient of one window took 88 s, the head's (closed form) a second; a
            # step of one window of two micro-batches costs an eighth of a period of two windows
            whole_gradient=False,
            oracle_window=128,
            oracle_period=1,
            purpose="the sizes users train at, where kernels take their other paths: LLaMA 2's tokenizer (32,000 "
            "classes for the cross-entropy heads, past every block size of their row kernels), width 2048 with "
            "grouped-query attention (16 heads over 4 KV heads of 128), windows of 512 tokens trained whole and in "
            "micro-batches of 64; one layer, so that the oracles and the seeded-defect runs stay affordable",
        ),
    )
}
DEFAULT = "tiny"


def check_of(case_id: str) -> str:
    """A case's check: its id without the shape parameter (test_x[shape=realistic,head=dense] ->
    test_x[head=dense]). A check shown able to fail at one profile is the same check at another
    (HARNESS-07's rule is judged per check)."""
    name, bracket, params = case_id.partition("[")
    if not bracket:
        return case_id
    kept = [p for p in params.rstrip("]").split(",") if not p.startswith(PATH_PREFIX)]
    return f"{name}[{','.join(kept)}]" if kept else name


def shape_of(case_id: str) -> str | None:
    """The profile a case ran at (its shape parameter), None for a check that takes none."""
    _, _, params = case_id.partition("[")
    found = (p.removeprefix(PATH_PREFIX) for p in params.rstrip("]").split(",") if p.startswith(PATH_PREFIX))
    return next(found, None)


def parse(selection: str | None) -> list[Shape]:
    """--shape's value: comma-separated profile names, or "all"; the default profile when None."""
    if selection is None:
        return [SHAPES[DEFAULT]]
    names = list(SHAPES) if selection.strip() == "all" else [n.strip() for n in selection.split(",") if n.strip()]
    unknown = [n for n in names if n not in SHAPES]
    if unknown or not names:
        raise ValueError(f"--shape: unknown profile(s) {unknown or selection!r}; known: {', '.join(SHAPES)} or all")
    return [SHAPES[n] for n in dict.fromkeys(names)]
