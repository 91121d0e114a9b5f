"""Tiny random llama models written as GGUF with the `gguf` package.

The tokenizer is a real byte-level BPE ('gpt2' model): 256 byte tokens, merges of byte pairs up
to the vocabulary size, and BOS/EOS control tokens, so any UTF-8 text round-trips through
tokenize/detokenize. Everything is derived from the seed: the same spec writes the same bytes.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import gguf
import numpy as np

BOS, EOS = "<|bos|>", "<|endoftext|>"


@dataclass(frozen=True)
class TinyLlamaSpec:
    n_vocab: int = 512
    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_head_kv: int = 4
    n_ff: int = 192
    n_ctx: int = 256
    seed: int = 0
    init_std: float = 0.02
    # a draft model for speculative decoding: the same weights as `seed`'s, with noise of this
    # many standard deviations added to the last layer's FFN output, so that it mostly agrees
    draft_noise: float = 0.0

    def __post_init__(self) -> None:
        if self.n_vocab < 256 + 2 + 1:
            raise ValueError("n_vocab must hold the 256 byte tokens, BOS, EOS and at least one merge")
        if self.n_embd % self.n_head or self.n_head % self.n_head_kv:
            raise ValueError("n_embd must divide by n_head, and n_head by n_head_kv")


@cache
def _byte_symbols() -> list[str]:
    """GPT-2's reversible byte -> printable unicode mapping, indexed by byte value."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    table: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def _vocabulary(spec: TinyLlamaSpec) -> tuple[list[str], list[int], list[str]]:
    byte_tokens = _byte_symbols()
    n_merges = spec.n_vocab - 256 - 2
    # merge pairs of the symbols of ordinary text (lowercase letters, space as 'Ġ'), seeded order;
    # past the 729 pairs, each merged token of the last level is extended by one more symbol (a
    # vocabulary of 32k has tokens of up to four symbols), every merge's parts being tokens already
    alphabet = [byte_tokens[ord(c)] for c in " abcdefghijklmnopqrstuvwxyz"]
    rng = np.random.default_rng(spec.seed)
    merges: list[str] = []
    prefixes = alphabet
    while len(merges) < n_merges:
        pairs = [a + " " + b for a, b in itertools.product(prefixes, alphabet)]
        order = rng.permutation(len(pairs))
        level = [pairs[i] for i in order[: n_merges - len(merges)]]
        merges += level
        prefixes = [m.replace(" ", "") for m in level]
    tokens = byte_tokens + [m.replace(" ", "") for m in merges] + [BOS, EOS]
    types = [gguf.TokenType.NORMAL] * (len(tokens) - 2) + [gguf.TokenType.CONTROL] * 2
    return tokens, [int(t) for t in types], merges


def write_tiny_llama(path: str | os.PathLike[str], spec: TinyLlamaSpec | None = None) -> Path:
    """Write a random llama model with a working tokenizer to `path` (f32 weights)."""
    spec = spec or TinyLlamaSpec()
    path = Path(path)
    tokens, types, merges = _vocabulary(spec)
    rng = np.random.default_rng(spec.seed + 1)
    head_dim = spec.n_embd // spec.n_head
    n_embd_kv = head_dim * spec.n_head_kv

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * spec.init_std).astype(np.float32)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"retro-tiny-llama-{spec.seed}")
    w.add_context_length(spec.n_ctx)
    w.add_embedding_length(spec.n_embd)
    w.add_block_count(spec.n_layer)
    w.add_feed_forward_length(spec.n_ff)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(spec.n_vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index(BOS))
    w.add_eos_token_id(tokens.index(EOS))
    w.add_add_bos_token(False)

    w.add_tensor("token_embd.weight", weight(spec.n_vocab, spec.n_embd))
    for i in range(spec.n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(spec.n_embd, dtype=np.float32))
        w.add_tensor(f"blk.{i}.attn_q.weight", weight(spec.n_embd, spec.n_embd))
        w.add_tensor(f"blk.{i}.attn_k.weight", weight(n_embd_kv, spec.n_embd))
        w.add_tensor(f"blk.{i}.attn_v.weight", weight(n_embd_kv, spec.n_embd))
        w.add_tensor(f"blk.{i}.attn_output.weight", weight(spec.n_embd, spec.n_embd))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(spec.n_embd, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", weight(spec.n_ff, spec.n_embd))
        w.add_tensor(f"blk.{i}.ffn_up.weight", weight(spec.n_ff, spec.n_embd))
        down = weight(spec.n_embd, spec.n_ff)
        if spec.draft_noise and i == spec.n_layer - 1:
            noise = np.random.default_rng(spec.seed + 2).standard_normal(down.shape)
            down = (down + noise * spec.draft_noise * down.std()).astype(np.float32)
        w.add_tensor(f"blk.{i}.ffn_down.weight", down)
    w.add_tensor("output_norm.weight", np.ones(spec.n_embd, dtype=np.float32))
    w.add_tensor("output.weight", weight(spec.n_vocab, spec.n_embd))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
