"""Stable assignment of posts to chunk jobs (independent of row order and Python's hash seed)."""

from __future__ import annotations

import hashlib


def stable_chunk(post_id: str, n_chunks: int) -> int:
    digest = hashlib.blake2b(str(post_id).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % n_chunks
