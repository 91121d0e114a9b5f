"""Tiny random llama models written as GGUF with the `gguf` package.

The tokenizer is a real byte-level BPE ('gpt2' model): 256 byte tokens, merges of byte pairs up
to the vocabulary size, and BOS/EOS control tokens, so any UTF-8 text round-trips through
tokenize/detokenize. Or it is a published model's, copied from one of the vocabulary files that
llama.cpp's sources carry for its tokenizer tests (`vocabulary`: installed with the binding, see
vocabulary_file). Everything is derived from the seed: the same spec writes the same bytes.
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
    # a published tokenizer instead of the generated BPE: a name of VOCABULARIES (its file is
    # installed with the binding) or a GGUF file's path; n_vocab must be its size
    vocabulary: str = ""

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


#: the published tokenizers of llama.cpp's test vocabularies installed with the binding, by name:
#: their sizes (LLaMA 2's SentencePiece and LLaMA 3's byte-level BPE)
VOCABULARIES = {"llama-spm": 32000, "llama-bpe": 128256}


def vocabulary_file(name: str) -> Path:
    """The installed vocabulary file of `name` (VOCABULARIES), or `name` itself when it is a path."""
    if name not in VOCABULARIES:
        return Path(name)
    from retro import _native  # the files are installed beside the extension module

    path = Path(_native.__file__).parent / "vocab" / f"ggml-vocab-{name}.gguf"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the binding was installed without its vocabulary files")
    return path


def _published_tokenizer(w: gguf.GGUFWriter, spec: TinyLlamaSpec) -> None:
    """Copy a published tokenizer's fields (its tokens, scores, types, merges, special tokens)."""
    fields = gguf.GGUFReader(vocabulary_file(spec.vocabulary)).fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    if len(tokens) != spec.n_vocab:
        raise ValueError(
            f"vocabulary {spec.vocabulary!r} has {len(tokens)} tokens; the spec says n_vocab {spec.n_vocab}"
        )
    w.add_tokenizer_model(fields["tokenizer.ggml.model"].contents())
    if "tokenizer.ggml.pre" in fields:
        w.add_tokenizer_pre(fields["tokenizer.ggml.pre"].contents())
    w.add_token_list(tokens)
    w.add_token_types(fields["tokenizer.ggml.token_type"].contents())
    if "tokenizer.ggml.scores" in fields:
        w.add_token_scores(fields["tokenizer.ggml.scores"].contents())
    if "tokenizer.ggml.merges" in fields:
        w.add_token_merges(fields["tokenizer.ggml.merges"].contents())
    w.add_bos_token_id(int(fields["tokenizer.ggml.bos_token_id"].contents()))
    w.add_eos_token_id(int(fields["tokenizer.ggml.eos_token_id"].contents()))
    if "tokenizer.ggml.unknown_token_id" in fields:
        w.add_unk_token_id(int(fields["tokenizer.ggml.unknown_token_id"].contents()))
    w.add_add_bos_token(False)  # as the generated tokenizer: the checks choose their own tokens


def write_tiny_llama(path: str | os.PathLike[str], spec: TinyLlamaSpec | None = None) -> Path:
    """Write a random llama model with a working tokenizer to `path` (f32 weights)."""
    spec = spec or TinyLlamaSpec()
    path = Path(path)
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
    if spec.vocabulary:
        _published_tokenizer(w, spec)
    else:
        tokens, types, merges = _vocabulary(spec)
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
