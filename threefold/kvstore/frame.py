"""One stored record: header + payload + checksum. A bad record is refused, never returned.

    offset  size  field
    0       4     MAGIC  b"TFKV"
    4       2     format version (little-endian)
    6       16    namespace digest (keys.py)
    22      8     payload length, bytes
    30      n     payload (opaque: the engine's encoded KV block)
    30+n    4     CRC-32 of everything before it

CRC-32 (zlib), not a cryptographic hash: the threat is a torn write, a flipped bit or a truncated file,
which CRC-32 detects (every burst up to 32 bits, all but 2^-32 of the rest), and zlib computes it at
several GB/s, far from the load path's cost. Nobody can forge a block past a hash anyway: whoever can
write the store can write a matching hash too.
"""

from __future__ import annotations

import struct
import zlib

MAGIC = b"TFKV"
_HEADER = struct.Struct("<4sH16sQ")
_CRC = struct.Struct("<I")
OVERHEAD = _HEADER.size + _CRC.size


class FrameError(Exception):
    """A record that must not be used; `reason` is the fault kind counted in the store's stats."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def encode(payload: bytes, namespace_digest: bytes, version: int) -> bytes:
    return b"".join(encode_parts(payload, namespace_digest, version))


def encode_parts(payload: bytes, namespace_digest: bytes, version: int) -> tuple[bytes, bytes, bytes]:
    """The record as (header, payload, checksum), for a writer that need not join them (a file: writev)."""
    header = _HEADER.pack(MAGIC, version, namespace_digest, len(payload))
    crc = zlib.crc32(payload, zlib.crc32(header))
    return header, payload, _CRC.pack(crc)


def decode(record: bytes, namespace_digest: bytes, version: int) -> bytes:
    """The payload of a record, or FrameError naming what is wrong with it."""
    if len(record) < OVERHEAD:
        raise FrameError("truncated", f"{len(record)} bytes, shorter than a header")
    magic, got_version, digest, length = _HEADER.unpack_from(record)
    if magic != MAGIC:
        raise FrameError("bad_magic", f"magic {magic!r}")
    if got_version != version:
        raise FrameError("version", f"format version {got_version}, expected {version}")
    if digest != namespace_digest:
        raise FrameError("namespace", "written under another model, codec or block size")
    if len(record) != OVERHEAD + length:
        raise FrameError("truncated", f"{len(record)} bytes, header says {OVERHEAD + length}")
    view = memoryview(record)
    end = _HEADER.size + length
    (crc,) = _CRC.unpack_from(record, end)
    if zlib.crc32(view[_HEADER.size:end], zlib.crc32(view[:_HEADER.size])) != crc:
        raise FrameError("checksum", "CRC-32 mismatch")
    return bytes(view[_HEADER.size:end])
