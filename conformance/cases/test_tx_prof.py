"""Tensor transactions (seed 004), TX-PROF: profile binding: selectors bound to a profile validated
for the model, and the borrowing capture only made unsafely. Each is observed from outside the
binding: llama.cpp's own record of the callback's user data and its destructor, the sequence state
llama.cpp serializes, the logits it returns, numpy references, and the handler's own log. Shared
helpers: _transactions.py."""

from __future__ import annotations

import contextlib
import dataclasses
import io
from collections.abc import Callable

import numpy as np
import pytest

from retro import transactions
from retro.conformance.cases._transactions import (
    decode_tokens,
    plain_context,
    rows_of,
    tx_context,
)
from retro.conformance.evidence import bound, expect
from retro.conformance.shapes import Shape
from retro.conformance.support import hostile, raised
from retro.transactions import Profile, ProfileError, Selector, TensorTransactions
from retro.unsafe import TensorCapture


@pytest.mark.clause("TX-PROF-01")
def test_selectors_are_bound_to_a_profile_validated_for_the_model(backend, loaded, tmp_path, shape: Shape):
    """Selectors come only from a profile; a profile saved and loaded is accepted for its model;
    one recorded for another pin, architecture or backend is refused before anything native
    changes; and every way a selector, a set of them or a profile file can fail to fit the profile
    and the model is refused alone, with its typed error naming what does not fit (_unfitting).
    The shipped command (retro-profile) records the same profile as the API, and its --help says
    what it records and what for."""
    model, profile = loaded
    with bound("TX-PROF-01"), pytest.raises(TypeError):
        Selector("l_out-0", "f32", model.n_embd, 8, "read-only", True, "tokens", profile)
    other = dataclasses.replace(profile)
    with bound("TX-PROF-01"), pytest.raises(ProfileError):
        TensorTransactions(profile, [other.select("l_out-0", retain=True)])
    loaded_back = Profile.load(profile.save(tmp_path / "profile.json"))
    with tx_context(model, shape, loaded_back, [loaded_back.select("l_out-0", retain=True)]) as ctx:
        ctx.decode(decode_tokens(shape)[: shape.decode_micro_batch])
    elsewhere = ("Vulkan0",) if profile.backend != ("Vulkan0",) else ("CPU",)
    for field, value in (("pin", "0000000"), ("architecture", "gpt2"), ("backend", elsewhere)):
        # in memory, and saved and loaded back: a file keeps what it was recorded for
        foreign = dataclasses.replace(profile, **{field: value})
        for kept in (foreign, Profile.load(foreign.save(tmp_path / f"foreign-{field}.json"))):
            tx = TensorTransactions(kept, [kept.select("l_out-0", retain=True)])
            with bound("TX-PROF-01"), pytest.raises(ProfileError):
                plain_context(model, shape, tx).close()
            expect("TX-PROF-01", not tx.taken, f"a profile of another {field} reached native state")
    # the profile a user records with the shipped command is the one recorded here
    recorded = tmp_path / "retro-profile.json"
    argv = [str(model.path), "--out", str(recorded), "--gpu-layers", "-1"]
    argv += [a for index in backend.offload_devices for a in ("--device", str(index))]
    with contextlib.redirect_stdout(io.StringIO()) as said:
        rc = transactions.main(argv)
    expect(
        "TX-PROF-01",
        rc == 0 and Profile.load(recorded).to_json() == profile.to_json(),
        f"retro-profile {' '.join(argv)}: exit {rc}, a profile other than the one recorded in process",
    )
    selectable = sum(n.why_not_selectable is None for n in profile.nodes.values())
    expect(
        "TX-PROF-01",
        f"{len(profile.nodes)} node names, {selectable} selectable" in said.getvalue(),
        f"retro-profile's summary: {said.getvalue()[:300]!r}",
    )
    # and says what it records and what for, under its own name
    with contextlib.redirect_stdout(io.StringIO()) as helped, pytest.raises(SystemExit) as done:
        transactions.main(["--help"])
    text = " ".join(helped.getvalue().split())
    expect(
        "TX-PROF-01",
        done.value.code == 0
        and text.startswith("usage: retro-profile ")
        and "every node of a decode's graph) for selectors to be bound to" in text,
        f"retro-profile --help: exit {done.value.code}, {text[:300]!r}",
    )
    for what, call, kind, names in _unfitting(model, profile):
        err = raised(call)
        expect(
            "TX-PROF-01",
            type(err) is kind and names in str(err),
            f"{what}: raised {err!r}, expected a {kind.__name__} naming {names!r}",
        )


def _unfitting(model, profile: Profile) -> list[tuple[str, Callable[[], object], type[Exception], str]]:
    """Every way a selector, a set of them or a profile file can fail to fit the profile and the
    model, each alone: (what, the call, the typed error, what its message names)."""
    sel = profile.select("l_out-0", retain=True, max_rows=8)
    unretained = profile.select("l_out-0")
    unselectable = next(n for n, node in profile.nodes.items() if node.why_not_selectable)
    damaged = profile.to_json().replace('"shape": [', '"shape": [7, ', 1)
    cases = [
        ("a name of bytes", lambda: profile.select(hostile(b"l_out-0")), TypeError, "name"),
        ("an unknown access", lambda: profile.select("l_out-0", access=hostile("writable")), ValueError, "access"),
        ("a retain flag of 1", lambda: profile.select("l_out-0", retain=hostile(1)), TypeError, "retain"),
        ("no rows", lambda: profile.select("l_out-0", max_rows=0), ValueError, "max_rows"),
        ("a prefix of a name", lambda: profile.select("l_out"), ProfileError, "exactly"),
        ("a node that cannot be selected", lambda: profile.select(unselectable), ProfileError, "cannot be selected"),
        ("another element type", lambda: profile.select("l_out-0", dtype="i32"), ProfileError, "not i32"),
        (
            "another row width",
            lambda: profile.select("l_out-0", row_elements=model.n_embd + 1),
            ProfileError,
            "elements per row",
        ),
        ("a profile that is not one", lambda: TensorTransactions(hostile(None), [sel]), TypeError, "profile"),
        (
            "a capture that is not one",
            lambda: TensorTransactions(profile, [sel], captures=[hostile(sel)]),
            TypeError,
            "captures",
        ),
        ("a selector by name", lambda: TensorTransactions(profile, [hostile("l_out-0")]), TypeError, "Profile.select"),
        ("no selector", lambda: TensorTransactions(profile, []), ValueError, "between 1 and"),
        ("a node selected twice", lambda: TensorTransactions(profile, [sel, sel]), ValueError, "once"),
        (
            "a handler that is not callable",
            lambda: TensorTransactions(profile, [sel], hostile(1)),
            TypeError,
            "handler",
        ),
        ("rows nobody takes", lambda: TensorTransactions(profile, [unretained]), ValueError, "need a handler"),
        (
            "rows past the retained limit",
            lambda: TensorTransactions(profile, [sel], retained_limit=8 * model.n_embd * 4 - 1),
            ValueError,
            "exceed retained_limit",
        ),
        ("a profile of no model", lambda: Profile.record(hostile("model.gguf")), TypeError, "model"),
        ("a file that is no profile", lambda: Profile.from_json("{}"), ProfileError, "not a tensor-transaction"),
        ("a node of three dimensions", lambda: Profile.from_json(damaged), ProfileError, "four dimensions"),
    ]
    return cases


@pytest.mark.clause("TX-PROF-03")
def test_the_borrowing_capture_is_only_made_unsafely(backend, loaded, shape: Shape):
    """TensorCapture's constructor refuses; TensorCapture.unsafe_borrow writes the node's rows
    into the caller's array, which equals the retained capture of the same node. What it borrows
    is checked before a pointer to it is kept (a selector, read-only and not retained, and an array
    of the node's type, contiguous and writable)."""
    model, profile = loaded
    m = shape.decode_micro_batch
    one = decode_tokens(shape)[:m]  # a decode of one micro-batch: the borrowed array holds its rows
    out = np.zeros((m, model.n_embd), np.float32)
    with bound("TX-PROF-03"), pytest.raises(TypeError, match="unsafe_borrow"):
        TensorCapture(profile.select("attn_norm-0"), out)
    made: list[TensorCapture] = []
    refused = raised(lambda: made.append(TensorCapture.unsafe_borrow(profile.select("attn_norm-0"), out)))
    expect("TX-PROF-03", bool(made), f"the explicitly unsafe constructor made none: {refused!r}")
    (capture,) = made
    tx = TensorTransactions(profile, [profile.select("l_out-0", retain=True)], captures=[capture])
    with plain_context(model, shape, tx) as ctx:
        ctx.decode(one)
    with tx_context(model, shape, profile, [profile.select("attn_norm-0", retain=True)]) as ctx:
        ctx.decode(one)
        _, expected = rows_of(ctx.drain_captures(), "attn_norm-0")
    expect("TX-PROF-03", np.array_equal(out, expected), "the borrowed capture did not write the rows")
    # what it borrows is checked before a pointer to it is kept: the selector, and an array the
    # native copy may write into (the node's type, contiguous, writable)
    frozen = np.zeros((m, model.n_embd), np.float32)
    frozen.flags.writeable = False
    read_only = profile.select("attn_norm-0")
    for what, args, kind in (
        ("a node's name", ("attn_norm-0", out), TypeError),
        ("a retained selector", (profile.select("attn_norm-0", retain=True), out), ValueError),
        ("a float64 array", (read_only, out.astype(np.float64)), TypeError),
        ("a strided array", (read_only, np.zeros((m, 2 * model.n_embd), np.float32)[:, ::2]), ValueError),
        ("a read-only array", (read_only, frozen), ValueError),
    ):
        err = raised(lambda: TensorCapture.unsafe_borrow(*args))
        expect("TX-PROF-03", type(err) is kind, f"borrowing {what}: raised {err!r}, expected {kind.__name__}")
