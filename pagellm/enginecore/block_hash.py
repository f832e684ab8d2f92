"""Prefix-cache identities of full KV blocks.

A full block's hash chains its parent's hash, its token ids and extra keys (the
request's cache_salt and its LoRA adapter's (id, generation), in the first block only:
the chain carries them on; an adapter replaced in place has a new generation, so its
new requests never meet KV computed with the old weights):

    hash(block k) = sha256(msgpack([hash(block k-1) or None, token_ids_k, extra_k]))

so two requests share a block exactly when everything before it and in it is the same.
sha256 over a stable encoding, never Python's `hash()`: it must not collide by
accident, nor differ between processes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec

BlockHash = bytes

_encode = msgspec.msgpack.Encoder().encode


def hash_block(parent: BlockHash | None, token_ids: Sequence[int],
               extra: tuple[str | int, ...] = ()) -> BlockHash:
    return hashlib.sha256(_encode((parent, token_ids, extra))).digest()


def extend_block_hashes(hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
                        cache_salt: str | None, offset: int = 0,
                        lora_key: tuple[int, int] | None = None) -> None:
    """Append to `hashes` the hash of every full block of the request it lacks, given
    the request's tokens from position `offset` on (which must cover those blocks).
    `lora_key`: the request's adapter (id, generation); None for the base model."""
    first = len(hashes) * block_size
    if first < offset:
        raise ValueError(f"tokens from position {offset} cannot hash the block at {first}")
    salt: tuple[str | int, ...] = () if cache_salt is None else (cache_salt,)
    first_extra = salt if lora_key is None else (*salt, *lora_key)  # ints: never a salt
    for start in range(first, offset + len(token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        extra = first_extra if parent is None else ()
        hashes.append(hash_block(parent, token_ids[start - offset:start - offset + block_size],
                                 extra))
