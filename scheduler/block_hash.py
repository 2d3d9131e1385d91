"""The prefix cache's keys: a full block is named by the sha256 of its parent's digest and its token ids,
the first block's parent a digest of the sequence's LoRA adapter and cache salt (``block_hash_seed``)."""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Sequence


def block_hash_seed(lora_id: int = 0, cache_salt: str | None = None) -> bytes:
    """The first block's parent for sequences of this adapter and salt.

    The id has a fixed width and a flag byte precedes the salt, so no salt can encode as another
    salt or as an adapter id; lone surrogates (valid in JSON strings) encode rather than raise.
    """
    salt = b"\x00" if cache_salt is None else b"\x01" + cache_salt.encode("utf-8", "surrogatepass")
    return hashlib.sha256(b"servelm-prefix-seed\x00" + struct.pack("<q", lora_id) + salt).digest()


# The base model's chain root, for sequences without a seed.
BASE_HASH_SEED = block_hash_seed()


@functools.cache
def _int64s(n: int) -> struct.Struct:
    """A packer of ``n`` token ids compiled once (one block size in practice); array('q', ids) is slower."""
    return struct.Struct(f"<{n}q")


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """A full block's key: sha256 of its parent's digest (the seed for the first block) and its token
    ids as int64 little-endian. Kept as bytes; KV events wanting an int (as vLLM's can) take the last 8
    bytes big-endian."""
    return hashlib.sha256(parent + _int64s(len(token_ids)).pack(*token_ids)).digest()
