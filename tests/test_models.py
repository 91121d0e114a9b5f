"""The tiny test-model generator: deterministic, small, loadable, with a real tokenizer."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import retro
from retro.testing import TinyLlamaSpec, write_tiny_llama
from retro.testing.models import VOCABULARIES


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    a = write_tiny_llama(tmp_path / "a.gguf", TinyLlamaSpec(seed=3))
    b = write_tiny_llama(tmp_path / "b.gguf", TinyLlamaSpec(seed=3))
    c = write_tiny_llama(tmp_path / "c.gguf", TinyLlamaSpec(seed=4))
    assert _digest(a) == _digest(b)
    assert _digest(a) != _digest(c)


def test_default_model_is_tiny_and_loads_with_its_shape(model_path):
    assert 0.6e6 < model_path.stat().st_size < 0.8e6
    with retro.Model.load(model_path, devices=[]) as m:
        assert (m.n_vocab, m.n_embd, m.n_layer, m.n_ctx_train) == (512, 64, 2, 256)
        names = m.tensor_names()
        assert len(names) == 3 + 9 * 2
        assert m.tensor("blk.1.ffn_gate.weight").shape == (192, 64)
        assert m.tensor("token_embd.weight").shape == (512, 64)


@settings(max_examples=40, deadline=None)
@given(text=st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=64))
def test_tokenizer_round_trips_utf8(model_path, text):
    with retro.Model.load(model_path, devices=[]) as m:
        ids = m.tokenize(text)
        assert all(0 <= i < m.n_vocab for i in ids)
        assert m.detokenize(ids) == text


def test_merges_are_used(model_path):
    with retro.Model.load(model_path, devices=[]) as m:
        text = "the quick brown fox jumps over the lazy dog " * 4
        assert len(m.tokenize(text)) < len(text.encode())


@pytest.mark.parametrize("bad", [dict(n_vocab=100), dict(n_embd=63), dict(n_head=3, n_head_kv=2)])
def test_invalid_specs_are_rejected(bad):
    with pytest.raises(ValueError):
        TinyLlamaSpec(**bad)


@pytest.mark.parametrize(("name", "tokenized"), [("llama-spm", [15043, 3186]), ("llama-bpe", [9906, 1917])])
def test_a_published_vocabulary_is_copied_whole(tmp_path, name, tokenized):
    """The realistic shape profile's tokenizers, installed with the binding from llama.cpp's sources:
    every token, and LLaMA's own tokenization of a greeting (its .inp/.out test pairs' convention)."""
    n_vocab = VOCABULARIES[name]
    spec = TinyLlamaSpec(vocabulary=name, n_vocab=n_vocab, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, n_layer=1)
    path = write_tiny_llama(tmp_path / f"{name}.gguf", spec)
    with retro.Model.load(path, devices=[]) as m:
        assert m.n_vocab == n_vocab
        assert m.tokenize("Hello world") == tokenized
        assert m.detokenize(tokenized) == "Hello world"
    with pytest.raises(ValueError, match="tokens"):
        write_tiny_llama(tmp_path / "wrong.gguf", dataclasses.replace(spec, n_vocab=n_vocab - 1))
