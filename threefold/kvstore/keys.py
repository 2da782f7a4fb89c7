"""Stored blocks' keys: a versioned namespace digest + the block's chained prefix hash.

    key = namespace.digest (16 bytes) + block_hash (32 bytes, core/hashing.py)
    namespace.digest = blake2b-128(FORMAT_VERSION | model fingerprint | codec spec | block size)

A block written by other weights, another codec, another block size or another format version has
another digest, so it can never be read back as this engine's KV: stale KV is impossible by
construction, not by invalidation. The digest is also written into every frame (frame.py) and checked
on read, so even a file renamed by hand cannot be served under the wrong namespace.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

FORMAT_VERSION = 1
"""Bump when the frame layout or the payload layout changes: old blocks then become unreachable."""

DIGEST_BYTES = 16


@dataclass(frozen=True)
class Namespace:
    """What a stored block's bytes depend on besides its tokens."""

    model_fingerprint: str
    """The weights' identity (the engine's loaded.fingerprint: file contents and numerics), not a name."""
    codec: str
    """The codec spec the payload is encoded in (kv/spec.py's canonical text)."""
    block_size: int
    """Tokens per block."""
    format_version: int = FORMAT_VERSION
    digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        text = f"threefold-kv|v{self.format_version}|{self.model_fingerprint}|{self.codec}|{self.block_size}"
        object.__setattr__(self, "digest", hashlib.blake2b(text.encode(), digest_size=DIGEST_BYTES).digest())

    def key(self, block_hash: bytes) -> bytes:
        """The store key of one block."""
        return self.digest + block_hash

    @property
    def hex(self) -> str:
        return self.digest.hex()
