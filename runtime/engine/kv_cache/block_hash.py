"""Chained block hashes for prefix caching: `h_i = sha256(h_{i-1}, tokens_i, extra)` over full blocks.

The hash names the *whole prefix* up to and including block i, so two requests share block i only if every
token before it matches too. It must be stable across processes and machines: the router recomputes the
same hashes from token ids to match them against the KV events each pod publishes. Python's `hash()` is
salted per process (PYTHONHASHSEED), so the input is a canonical byte encoding fed to sha256.

Encoding (version tag first, so a future change can never collide with today's hashes):
    b"tfkv1" | parent (0x00, or 0x01 + 32 bytes) | extra (count, then each item tagged and length-prefixed)
    | token count (u32) | tokens (little-endian i64 each)
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Callable, Sequence

BlockHash = bytes
ExtraItem = str | int | None

_VERSION = b"tfkv1"
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")
_HEAD_ROOT = _VERSION + b"\x00"
_HEAD_CHILD = _VERSION + b"\x01"


def hash_extra(model_name: str, cache_salt: str | None = None) -> tuple[str, ...]:
    """What besides the tokens decides whether KV can be shared: the model and an optional tenant salt.

    `hash_extra(m, s) == hash_extra(m) + (s,)`, so an engine can build the model part once and add each
    request's salt (see `with_salt`).
    """
    return (model_name,) if cache_salt is None else (model_name, cache_salt)


def with_salt(base_extra: tuple[ExtraItem, ...], cache_salt: str | None) -> tuple[ExtraItem, ...]:
    return base_extra if cache_salt is None else (*base_extra, cache_salt)


def with_adapter(
    base_extra: tuple[ExtraItem, ...], cache_salt: str | None, adapter_key: str | None
) -> tuple[ExtraItem, ...]:
    """The extra of a request run under a LoRA adapter (`adapter_key`: its name and weights digest): KV
    computed under one adapter is never a hit for another one, for the base model, or for the same name
    loaded with other weights. The key follows the salt's place (None when unsalted), so its item count
    differs from every extra without an adapter: no client salt can collide with an adapter's key."""
    if adapter_key is None:
        return with_salt(base_extra, cache_salt)
    return (*base_extra, cache_salt, adapter_key)


def encode_extra(extra: tuple[ExtraItem, ...]) -> bytes:
    """Canonical bytes of `extra`; type-tagged so that ("1",) and (1,) never collide."""
    parts = [_U32.pack(len(extra))]
    for item in extra:
        if item is None:
            parts.append(b"N")
        elif isinstance(item, bool):  # bool is an int subclass: tag it apart
            parts.append(b"B" + (b"\x01" if item else b"\x00"))
        elif isinstance(item, int):
            parts.append(b"I" + _I64.pack(item))
        elif isinstance(item, str):
            raw = item.encode("utf-8")
            parts.append(b"S" + _U32.pack(len(raw)) + raw)
        else:
            raise TypeError(f"hash extra items must be str, int or None, got {type(item).__name__}")
    return b"".join(parts)


def hash_block_encoded(parent: BlockHash | None, token_ids: Sequence[int], extra_bytes: bytes) -> BlockHash:
    """`hash_block` with the extra already encoded (the hot path encodes it once per request)."""
    h = hashlib.sha256(_VERSION)
    h.update(b"\x00" if parent is None else b"\x01" + parent)
    h.update(extra_bytes)
    h.update(_U32.pack(len(token_ids)))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


@functools.lru_cache(maxsize=8)
def _block_encoder(block_size: int) -> tuple[Callable[..., bytes], bytes]:
    """(pack of `block_size` tokens, their encoded count): compiled once per block size."""
    return struct.Struct(f"<{block_size}q").pack, _U32.pack(block_size)


def append_block_hashes(
    block_hashes: list[BlockHash],
    parent: BlockHash | None,
    token_ids: Sequence[int],
    block_size: int,
    extra_bytes: bytes,
) -> None:
    """Append the chained hashes of consecutive full blocks to `block_hashes` (byte-identical to
    `hash_block_encoded` per block). `token_ids` hold whole blocks only; `parent` precedes the first.

    The KV manager hashes every block of every sequence as it fills, so this is its one hashing loop:
    the token packer is compiled once per block size and each block is a single sha256 call.
    """
    pack, count = _block_encoder(block_size)
    for i in range(0, len(token_ids) - block_size + 1, block_size):
        data = b"".join(
            (
                _HEAD_ROOT if parent is None else _HEAD_CHILD + parent,
                extra_bytes,
                count,
                pack(*token_ids[i : i + block_size]),
            )
        )
        parent = hashlib.sha256(data).digest()
        block_hashes.append(parent)


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra: tuple[ExtraItem, ...]) -> BlockHash:
    """Hash of one block given its parent's hash (None for the first block of a sequence)."""
    return hash_block_encoded(parent, token_ids, encode_extra(extra))


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    extra: tuple[ExtraItem, ...] | bytes,
) -> list[BlockHash]:
    """Append the hashes of the full blocks of `token_ids` not hashed yet; returns `block_hashes`.

    `token_ids` are all the sequence's tokens so far (`block_hashes` already covers a prefix of them);
    a trailing partial block is never hashed: its content is not final. `extra` may be pre-encoded bytes.
    """
    extra_bytes = extra if isinstance(extra, bytes) else encode_extra(extra)
    num_full = len(token_ids) // block_size
    start = len(block_hashes)
    if start < num_full:
        parent = block_hashes[-1] if block_hashes else None
        tokens = token_ids[start * block_size : num_full * block_size]
        append_block_hashes(block_hashes, parent, tokens, block_size, extra_bytes)
    return block_hashes


def block_hashes_for(
    token_ids: Sequence[int], block_size: int, extra: tuple[ExtraItem, ...]
) -> list[BlockHash]:
    """All full-block hashes of a token sequence (what the router computes for an incoming prompt)."""
    return extend_block_hashes([], token_ids, block_size, extra)
