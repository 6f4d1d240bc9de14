"""Block hashes: chained, canonical, stable across processes (the router recomputes them)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from tokenfleet.runtime.engine.kv_cache.block_hash import (
    block_hashes_for,
    extend_block_hashes,
    hash_block,
    hash_extra,
    with_salt,
)

EXTRA = hash_extra("smollm2-135m-instruct")


def test_hash_is_sha256_sized_and_deterministic():
    h = hash_block(None, [1, 2, 3, 4], EXTRA)
    assert len(h) == 32
    assert h == hash_block(None, [1, 2, 3, 4], EXTRA)


def test_chain_depends_on_every_earlier_block():
    a = block_hashes_for(list(range(12)), 4, EXTRA)
    b = block_hashes_for([99, *range(1, 12)], 4, EXTRA)  # only the very first token differs
    assert len(a) == len(b) == 3
    assert all(x != y for x, y in zip(a, b, strict=True))
    # Same tokens in a block, different parent: different hash.
    assert hash_block(a[0], [4, 5, 6, 7], EXTRA) == a[1]
    assert hash_block(None, [4, 5, 6, 7], EXTRA) != a[1]


def test_only_full_blocks_are_hashed_and_extension_is_incremental():
    tokens = list(range(10))
    hashes = block_hashes_for(tokens, 4, EXTRA)
    assert len(hashes) == 2  # tokens 8, 9 form a partial block
    first = list(hashes)
    tokens += [10, 11, 12]
    extend_block_hashes(hashes, tokens, 4, EXTRA)
    assert hashes[:2] == first
    assert hashes == block_hashes_for(tokens, 4, EXTRA)


def test_extra_separates_models_salts_and_types():
    tokens = [5, 6, 7, 8]
    base = hash_block(None, tokens, hash_extra("m"))
    assert base != hash_block(None, tokens, hash_extra("other-model"))
    assert base != hash_block(None, tokens, hash_extra("m", "tenant-a"))
    assert hash_extra("m", "s") == with_salt(hash_extra("m"), "s")
    assert hash_block(None, tokens, ("1",)) != hash_block(None, tokens, (1,))
    # Length-prefixed items: ("ab", "c") is not ("a", "bc").
    assert hash_block(None, tokens, ("ab", "c")) != hash_block(None, tokens, ("a", "bc"))
    with pytest.raises(TypeError):
        hash_block(None, tokens, (1.5,))


_CHILD = """
from tokenfleet.runtime.engine.kv_cache.block_hash import block_hashes_for, hash_extra
print(",".join(h.hex() for h in block_hashes_for(list(range(1000, 1050)), 16, hash_extra("m", "salt"))))
"""


def test_hashes_equal_across_processes_with_different_hash_seeds():
    here = [h.hex() for h in block_hashes_for(list(range(1000, 1050)), 16, hash_extra("m", "salt"))]
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    child = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True, timeout=60
    )
    assert child.stdout.strip().split(",") == here
    assert len(here) == 3
