"""Attention backends over the paged KV cache, chosen by name from ATTENTION_BACKENDS."""

from tokenfleet.runtime.model.attention.base import (
    ATTENTION_BACKENDS,
    AttentionBackend,
    AttentionMetadata,
    get_attention_backend,
    resolve_backend_name,
)
from tokenfleet.runtime.model.attention.metadata import SeqSpec, build_attention_metadata, build_positions

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "AttentionMetadata",
    "SeqSpec",
    "build_attention_metadata",
    "build_positions",
    "get_attention_backend",
    "resolve_backend_name",
]
