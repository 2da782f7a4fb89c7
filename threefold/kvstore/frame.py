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

import mmap
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


PAGE = mmap.PAGESIZE


def encode(payload: bytes, namespace_digest: bytes, version: int) -> bytes:
    header = _HEADER.pack(MAGIC, version, namespace_digest, len(payload))
    return header + payload + _CRC.pack(zlib.crc32(payload, zlib.crc32(header)))


HEADROOM = 128
"""Bytes a RecordBuffer keeps free before each record, for a tier's own header (disk.py's slot header):
the tier then writes header and record from one page-aligned buffer, with no staging copy."""


class RecordBuffer:
    """One reused, page-aligned buffer that a writer frames each record into, in one pass: the payload
    is copied in once and checksummed there, while its bytes are still in the cache (a CRC over the
    payload where it lies reads it from memory a second time), and every tier writes the same view:
    a file with O_DIRECT straight from it, HEADROOM bytes before the record left for its own header
    (the buffer is aligned: no staging copy), Redis the record as it is (no joined copy). Not
    thread-safe: one per writer thread; a record is valid until the next `pack`."""

    def __init__(self) -> None:
        self._buffer = mmap.mmap(-1, PAGE)  # anonymous mmap: page-aligned, as O_DIRECT wants
        self._size = 0

    def pack(self, payload: bytes, namespace_digest: bytes, version: int) -> memoryview:
        """Frame `payload` into the buffer; the record's bytes (the same as `encode` returns)."""
        size = OVERHEAD + len(payload)
        if len(self._buffer) < padded_size(HEADROOM + size, PAGE):  # (the old one goes with the last view)
            self._buffer = mmap.mmap(-1, padded_size(HEADROOM + size, PAGE))
        view = memoryview(self._buffer)[HEADROOM:]
        _HEADER.pack_into(view, 0, MAGIC, version, namespace_digest, len(payload))
        end = _HEADER.size + len(payload)
        view[_HEADER.size:end] = payload
        _CRC.pack_into(view, end, zlib.crc32(view[:end]))
        self._size = size
        return view[:size]

    def with_header(self, header: bytes, align: int) -> memoryview:
        """The last record with `header` (at most HEADROOM bytes) written in the room before it, from the
        buffer's start up to a multiple of `align` (a power of two up to PAGE): an O_DIRECT write's unit.
        Between header and record, and after the record, lie stale bytes."""
        assert len(header) <= HEADROOM
        view = memoryview(self._buffer)
        view[:len(header)] = header
        return view[:padded_size(HEADROOM + self._size, align)]


def padded_size(size: int, align: int) -> int:
    return -(-size // align) * align


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
