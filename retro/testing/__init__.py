"""Helpers for tests of retro and of code built on it: tiny deterministic models."""

from .models import TinyLlamaSpec, write_tiny_llama

__all__ = ["TinyLlamaSpec", "write_tiny_llama"]
