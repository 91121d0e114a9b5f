"""Helpers for tests of retro and of code built on it: tiny deterministic models, upstream's own
training loop as an oracle, and probes of native state."""

from .models import TinyLlamaSpec, write_tiny_llama
from .oracle import upstream_epoch
from .probes import PackedBatch, label_rows, last_step_tokens, micro_batch, packed_batch

__all__ = [
    "PackedBatch",
    "TinyLlamaSpec",
    "label_rows",
    "last_step_tokens",
    "micro_batch",
    "packed_batch",
    "upstream_epoch",
    "write_tiny_llama",
]
