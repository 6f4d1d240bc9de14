"""Prefill/decode disaggregation on the wire: the `kv_transfer_params` request/response member and the
binary block stream a decode pod fetches from a prefill pod.

Request member `kv_transfer_params` (router -> pod, in the OpenAI body; other servers ignore it):

- to a prefill pod: `{"do_remote_decode": true, "hold_seconds": float}` — run the request (the router sends
  `max_tokens: 1`, `stream: false`), then hold the prompt's full KV blocks for at most `hold_seconds`. The
  JSON answer carries `kv_transfer_params` = `PrefillDone`: the held blocks' hashes (hex), the pod's own
  address and a `hold_id`.
- to a decode pod: `{"do_remote_prefill": true, "remote_url", "hold_id", "block_hashes": [hex, ...]}` — fetch
  the blocks this pod does not hold yet, insert them as prefix-cache blocks, then run the request as an
  ordinary request (a full prefix hit). Any transfer failure (prefill pod gone, timeout, refused blocks)
  means the pod recomputes the prompt: the answer is the same, only slower.
- streamed: the router may instead stream the prefill (`stream: true`, `max_tokens: 1`, resumable-stream
  annotations) so the client gets the first token at once; the prefill pod then names its hold in the
  `x-tokenfleet-kv-hold` response header, and the decode pod gets the request as a continuation of that
  stream (`tokenfleet_continuation`, runtime/openai/resume.py) with `kv_transfer_params` without
  `block_hashes`: it hashes the continuation's prompt ids itself. A fetch that arrives before the prefill
  stream has ended waits for its hold.

Block stream (`POST {remote_url}/v1/kv/fetch`, body `{"hold_id": str, "start": int, "tp_size": int}`,
response `application/octet-stream`, chunked):

    u32 big-endian N | N bytes of UTF-8 JSON `FetchHeader` | payload of block start | ... | of the last block

Every payload is exactly `layout.bytes_per_block` bytes: for each layer its K block then its V block, raw
`[block_size, num_kv_heads, head_dim]` tensors of `layout.dtype`, native byte order (little-endian on every
platform we run). A tensor-parallel pod's payload is `layout.tp_size` such shards, rank 0 first, each over
that rank's KV heads (`block_shape` is one shard's); `tp_size` in the fetch body is the fetching pod's, and
a prefill pod of another size answers 409 (`code: tp_size_mismatch`, both sizes in the message) and ends
the hold; a fetch without it is answered and the receiver's layout check refuses the blocks. `start`
skips the leading blocks the decode pod already holds; `parent` is the hash before the first sent block, so
the receiver can check the chain from the token ids. The fetch releases the hold, whether or not the stream
is read to its end. Unknown or expired `hold_id` -> 404; a `start` past
the held blocks -> 400. `DELETE {remote_url}/v1/kv/holds/{hold_id}` releases a hold nobody will fetch.
"""

from __future__ import annotations

import json
import struct

from pydantic import BaseModel, ConfigDict, Field

FIELD = "kv_transfer_params"
FETCH_PATH = "/v1/kv/fetch"
HOLDS_PATH = "/v1/kv/holds"
HOLD_HEADER = "x-tokenfleet-kv-hold"  # a streamed prefill's hold id (its answer has no body to carry it)
CONTENT_TYPE = "application/octet-stream"
DEFAULT_HOLD_SECONDS = 30.0
MAX_HOLD_SECONDS = 600.0
_LEN = struct.Struct(">I")
MAX_HEADER_BYTES = 64 << 20


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class PrefillParams(_Wire):
    do_remote_decode: bool = True
    hold_seconds: float = Field(default=DEFAULT_HOLD_SECONDS, gt=0, le=MAX_HOLD_SECONDS)


class PrefillDone(_Wire):
    """What a prefill pod answers: where the held KV is and what it is."""

    remote_url: str
    hold_id: str
    block_hashes: list[str]  # hex, the held full blocks of the prompt in order
    block_size: int


class DecodeParams(_Wire):
    do_remote_prefill: bool = True
    remote_url: str
    hold_id: str
    block_hashes: list[str] = Field(default_factory=list)  # empty: the decode pod hashes the prompt itself


class FetchRequest(_Wire):
    hold_id: str
    start: int = Field(default=0, ge=0)
    tp_size: int | None = Field(default=None, ge=1)  # the fetching pod's tensor-parallel ranks


class FetchHeader(_Wire):
    layout: dict  # KVLayout.as_json(): num_layers, block_shape (one rank's shard), dtype, tp_size
    block_size: int
    cache_salt: str | None
    parent: str | None  # hex hash of block start-1; None when start == 0
    block_hashes: list[str]  # hex, blocks start.. in order
    token_ids: list[int]  # their tokens, block_size per block


def encode_header(header: FetchHeader) -> bytes:
    raw = header.model_dump_json().encode()
    return _LEN.pack(len(raw)) + raw


def header_length(prefix: bytes) -> int:
    (n,) = _LEN.unpack(prefix)
    if n > MAX_HEADER_BYTES:
        raise ValueError(f"KV fetch header of {n} bytes")
    return n


def decode_header(raw: bytes) -> FetchHeader:
    return FetchHeader.model_validate(json.loads(raw))


HEADER_PREFIX_BYTES = _LEN.size
