"""Tensor transactions and generation as an API: what the caller gets wrong is refused with a
typed error before anything native exists or changes; profiles round-trip through their files;
sampled generation is reproducible. (Their contract is certified in conformance/cases.)"""

from __future__ import annotations

import numpy as np
import pytest

import retro
from retro.testing import TinyLlamaSpec, write_tiny_llama
from retro.transactions import Profile, ProfileError, TensorTransactions


@pytest.fixture
def profile(model: retro.Model) -> Profile:
    return Profile.record(model)


def test_a_profile_records_the_graph_and_marks_what_cannot_be_selected(model, profile):
    assert profile.pin == retro.build_info()["llama_cpp_commit"]
    assert profile.architecture == model.architecture == "llama"
    assert profile.backend == ("CPU",)
    norm = profile.nodes["attn_norm-0"]
    assert (norm.dtype, norm.row_elements, norm.rows, norm.why_not_selectable) == ("f32", 64, "tokens", None)
    assert profile.nodes["result_output"].rows == "outputs"
    assert "3 nodes" in (profile.nodes["Kcur-0"].why_not_selectable or "")
    assert "two-dimensional" in (profile.nodes["Qcur-0 (view) (permuted)"].why_not_selectable or "")


def test_a_profile_round_trips_through_its_file_and_a_bad_file_is_a_profile_error(profile, tmp_path):
    path = profile.save(tmp_path / "p.json")
    again = Profile.load(path)
    assert again == profile
    for text in ("{}", "[]", '{"pin": "x", "architecture": "llama", "backend": [], "nodes": [{"name": 1}]}', "nope"):
        with pytest.raises(ProfileError):
            Profile.from_json(text)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"access": "write"}, ValueError),
        ({"retain": 1}, TypeError),
        ({"max_rows": 0}, ValueError),
        ({"max_rows": 1 << 21}, OverflowError),
        ({"dtype": "i32"}, ProfileError),
        ({"row_elements": 32}, ProfileError),
    ],
)
def test_selectors_refuse_what_the_profile_does_not_say(profile, kwargs, error):
    with pytest.raises(error):
        profile.select("l_out-0", **kwargs)


def test_transactions_refuse_incoherent_selections(profile):
    sel = profile.select("l_out-0", retain=True)
    with pytest.raises(ValueError):
        TensorTransactions(profile, [])
    with pytest.raises(ValueError):
        TensorTransactions(profile, [sel, profile.select("l_out-0")], lambda t: None)
    with pytest.raises(ValueError, match="need a handler"):
        TensorTransactions(profile, [profile.select("l_out-0")])
    with pytest.raises(ValueError, match="retained_limit"):
        TensorTransactions(profile, [sel], retained_limit=1024)
    with pytest.raises(TypeError):
        TensorTransactions(profile, [sel], handler=42)  # type: ignore[arg-type]


def test_a_context_refuses_bad_transactions_and_generation_arguments(model, profile):
    with pytest.raises(TypeError):
        retro.Context(model, transactions=object())  # type: ignore[arg-type]
    with retro.Context(model, n_ctx=256, n_batch=64) as ctx:
        refused = [{"max_new": 0}, {"max_new": 4, "n_draft": 0}]
        # the temperature's bounds exactly: just below 0 and just above 100
        refused += [{"max_new": 4, "temperature": t} for t in (-1e-6, -1.0, 100.0001, float("nan"))]
        for kwargs in refused:
            with pytest.raises(ValueError):
                ctx.generate([1, 2], **kwargs)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            ctx.generate([1, 2], 4, draft=ctx)
        assert ctx.n_past == 0


def test_speculative_generation_needs_empty_sequences_and_one_vocabulary(model, tmp_path):
    other = write_tiny_llama(tmp_path / "v.gguf", TinyLlamaSpec(n_vocab=600))
    with retro.Model.load(other, devices=[]) as m2, retro.Context(m2, n_ctx=256, n_batch=64) as wrong:
        with retro.Context(model, n_ctx=256, n_batch=64) as target, retro.Context(model, n_ctx=256) as draft:
            with pytest.raises(ValueError, match="vocabulary"):
                target.generate([1, 2], 4, draft=wrong)
            draft.decode([5])
            with pytest.raises(ValueError, match="empty sequences"):
                target.generate([1, 2], 4, draft=draft)
            with pytest.raises(ValueError, match="greedy"):
                target.generate([1, 2], 4, draft=draft, temperature=0.5)


def test_sampled_generation_is_reproducible_from_its_seed(model):
    def sample(seed: int) -> list[int]:
        with retro.Context(model, n_ctx=256, n_batch=64, n_threads=1) as ctx:
            return ctx.generate([1, 2, 3], 12, temperature=1.5, seed=seed, stop_at_eog=False).tokens

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_greedy_generation_is_the_argmax_of_each_decode(model):
    with retro.Context(model, n_ctx=256, n_batch=64, n_threads=1) as ctx:
        tokens = ctx.generate([1, 2, 3], 5, stop_at_eog=False).tokens
    with retro.Context(model, n_ctx=256, n_batch=64, n_threads=1) as ctx:
        logits = ctx.decode([1, 2, 3])
        expected = [int(np.argmax(logits[-1]))]
        for _ in range(4):
            expected.append(int(np.argmax(ctx.decode([expected[-1]])[-1])))
    assert tokens == expected


def test_a_transaction_failure_reaches_the_caller_with_its_description(model, profile):
    def handler(t):
        raise LookupError("no steering vector for " + t.name)

    tx = TensorTransactions(profile, [profile.select("l_out-0")], handler)
    with retro.Context(model, n_ctx=256, n_batch=64, transactions=tx) as ctx:
        with pytest.raises(retro.TensorCallbackError) as err:
            ctx.generate([1, 2, 3], 4)
        assert err.value.tokens == []
        f = err.value.failure
        assert (f.kind, f.node, f.type) == ("handler", "l_out-0", "builtins.LookupError")
        assert "no steering vector for l_out-0" in f.message and "handler" in f.traceback
        assert ctx.transaction_failure == f


def test_the_profile_command_writes_a_profile_the_model_validates_against(model_path, tmp_path, capsys):
    from retro.transactions import main

    assert main([str(model_path), "--out", str(tmp_path / "p.json")]) == 0
    assert "selectable" in capsys.readouterr().out
    with retro.Model.load(model_path, devices=[]) as m:
        Profile.load(tmp_path / "p.json").validate(m)


def test_generation_stops_at_an_end_of_generation_token_with_or_without_a_draft(model):
    with retro.Context(model, n_ctx=256, n_batch=64, n_threads=1) as ctx:
        plain = ctx.generate([5, 6, 7], 30, stop_at_eog=False).tokens
    eos = model.tokenize("<|endoftext|>", parse_special=True)[0]
    weights = model.tensor("output.weight")
    weights[eos] = weights[plain[6]] * 1.5  # the end token now wins where plain[6] did
    model._h.set_tensor("output.weight", weights)
    with retro.Context(model, n_ctx=256, n_batch=64, n_threads=1) as ctx:
        greedy = ctx.generate([5, 6, 7], 30).tokens
    with retro.Context(model, n_ctx=256, n_batch=64, n_threads=1) as ctx, retro.Context(model, n_ctx=256) as draft:
        speculative = ctx.generate([5, 6, 7], 30, draft=draft, n_draft=4)
    assert greedy == [*plain[:6], eos]
    assert speculative.tokens == greedy and speculative.accepted > 0
