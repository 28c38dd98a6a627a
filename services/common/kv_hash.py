"""The prefix-cache hash chain over full KV blocks, shared by the engine (which caches blocks by
it and reports them in KV events) and the router (which hashes a request's prompt the same way
to look it up in its KV index). Pure Python: the engine imports it without grpc, the router
without torch."""

from __future__ import annotations

import hashlib
from array import array


def chain_hash(parent: int | None, token_ids, salt: str | None, lora: str | None = None) -> int:
    """Deterministic across processes (unlike hash()), so KV events from different workers agree.
    lora: the adapter's fingerprint; 0xff never occurs in UTF-8, so no cache_salt can imitate it."""
    digest = hashlib.blake2b(digest_size=8)
    if parent is None:
        digest.update(b"root:" + (salt or "").encode())
        if lora is not None:
            digest.update(b"\xfflora:" + lora.encode())
    else:
        digest.update(parent.to_bytes(8, "little"))
    digest.update(array("q", token_ids).tobytes())
    return int.from_bytes(digest.digest(), "little") >> 1  # fits a signed int64 (protobuf, JSON)


def prefix_hashes(
    token_ids,
    block_size: int,
    salt: str | None,
    lora: str | None = None,
    max_blocks: int | None = None,
) -> list[int]:
    """The chain hashes of token_ids' full blocks, root first (at most max_blocks of them)."""
    num_full = len(token_ids) // block_size
    if max_blocks is not None:
        num_full = min(num_full, max_blocks)
    hashes: list[int] = []
    parent = None
    for start in range(0, num_full * block_size, block_size):
        parent = chain_hash(parent, token_ids[start : start + block_size], salt, lora)
        hashes.append(parent)
    return hashes
