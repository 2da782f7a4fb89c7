"""L3: blocks in fixed-size slots of a few large slab files in a local directory; survives restarts;
least recently used out first.

    DIR/<namespace digest hex>/<slot bytes>-<id>.slab    slot i at byte i * slot bytes:

    offset  size  field (the slot header, frame.HEADROOM bytes)
    0       4     SLOT_MAGIC b"TFSL"
    4       2     SLOT_VERSION
    6       2     key length L (at most MAX_KEY_BYTES)
    8       8     when it was written (ns since the epoch: the restart index's order)
    16      8     record length R
    24      4     the record's own CRC (its last 4 bytes)
    28      L     the key (namespace digest + block hash)
    28+L    4     CRC-32 of bytes 0 .. 28+L
    HEADROOM  R   the record (frame.py: header, payload, CRC)

Why slots, not a file per block: creating a file is most of a block's write on this VM's ext4 (an
inode, its first extent, journal entries: 0.1-0.8 ms of the writer's CPU for a 360 KiB block, and
dearer after mass deletions), a `pwrite` into a slab 0.04-0.05 ms; on 2 cores every CPU-second the
writer spends is taken from the engine's compute threads. A slab grows as its slots are first written
and is deleted when its last block is evicted; a full tier writes over its least recently used slot.

A slot is written in one `pwrite` with O_DIRECT, straight from the writer's page-aligned RecordBuffer
(the header goes in the room it keeps before the record), where the filesystem allows it: a buffered
write costs the writer several times the CPU (page-cache pages allocated, copied into, written back).
The index (memory) learns of a block only after its write returned, so a failed or partial write is
never served. A read checks the slot header (magic, its CRC, the key asked for, and that the record
ends in the CRC the header names: a torn write that left a new header over an older record is caught
here) and the store checks the record's own CRC; a slot reused while it was being read is a miss.
At startup the index is rebuilt from the slot headers, oldest write first (reads do not reorder it
across a restart). Each slab is locked (flock) by the process that uses it: a second engine on the
same directory makes slabs of its own and leaves the first one's alone.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import struct
import threading
import time
import uuid
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from threefold.kvstore.frame import HEADROOM, FrameError, RecordBuffer, padded_size
from threefold.kvstore.keys import DIGEST_BYTES
from threefold.kvstore.tier import Backoff, Tier, TierFault

logger = logging.getLogger(__name__)

SUFFIX = ".slab"
SLOT_MAGIC = b"TFSL"
SLOT_VERSION = 1
_SLOT = struct.Struct("<4sHHQQI")
_CRC = struct.Struct("<I")
MAX_KEY_BYTES = HEADROOM - _SLOT.size - _CRC.size
DIRECT_ALIGN = 4096
"""O_DIRECT's unit for buffer address, length and file offset (any disk's logical block divides it)."""
SLAB_BYTES = 256 << 20
"""A slab file's size at most: few enough files for a large tier (200 open files for 50 GiB)."""


def _write_fault(exc: OSError) -> TierFault:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return TierFault("disk_full", str(exc))
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR):
        return TierFault("read_only", str(exc))
    return TierFault("write", str(exc))


def slot_header(key: bytes, record: memoryview | bytes, written_ns: int) -> bytes:
    """The header of the slot holding `record` (a whole frame: its last 4 bytes are its CRC)."""
    head = _SLOT.pack(SLOT_MAGIC, SLOT_VERSION, len(key), written_ns, len(record),
                      _CRC.unpack_from(record, len(record) - _CRC.size)[0]) + key
    return head + _CRC.pack(zlib.crc32(head))


def parse_slot_header(data: memoryview | bytes) -> tuple[bytes, int, int, int] | None:
    """(key, written ns, record length, record CRC) of a sound slot header, else None."""
    if len(data) < _SLOT.size:
        return None
    magic, version, key_len, written_ns, length, record_crc = _SLOT.unpack_from(data)
    end = _SLOT.size + key_len
    if magic != SLOT_MAGIC or version != SLOT_VERSION or key_len > MAX_KEY_BYTES or len(data) < end + _CRC.size:
        return None
    if zlib.crc32(data[:end]) != _CRC.unpack_from(data, end)[0]:
        return None
    return bytes(data[_SLOT.size:end]), written_ns, length, record_crc


Kind = tuple[str, int]
"""(namespace hex, slot bytes): the blocks a slab's slots take. A namespace's blocks go to its own slabs only,
so its directory holds its blocks (and the restart scan finds them there)."""


@dataclass(eq=False)
class Slab:
    """One slab file: `num_written` slots so far (the file's extent), at most `num_slots`."""

    path: Path
    fd: int
    """Open for reading, and holding the slab's lock (writes open an fd of their own)."""
    slot_bytes: int
    namespace: str
    """The hex digest of the namespace whose blocks it holds (its directory's name)."""
    num_slots: int
    num_written: int = 0
    occupied: int = 0
    generations: list[int] = field(default_factory=list)
    """Per slot, bumped whenever the slot is given to another block: a read that began before it is void."""

    def offset(self, slot: int) -> int:
        return slot * self.slot_bytes

    @property
    def kind(self) -> Kind:
        return self.namespace, self.slot_bytes


Location = tuple[Slab, int, int]
"""(slab, slot, record length) of an indexed block."""


class DiskTier(Tier):
    name = "disk"

    def __init__(self, root: str | Path, capacity_bytes: int, backoff: Backoff | None = None) -> None:
        self.root = Path(root)
        self._capacity = capacity_bytes
        self._index: OrderedDict[bytes, Location] = OrderedDict()  # oldest first
        self._free: dict[Kind, list[tuple[Slab, int]]] = {}  # free slots of each kind
        self._filling: dict[Kind, Slab] = {}  # the slab of each kind whose unwritten slots come next
        self._slabs: list[Slab] = []
        self._used = 0  # slot bytes of the indexed blocks
        self._allocated = 0  # slot bytes of every slot written at least once (the slabs' extent)
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()  # one writer of the write buffer at a time
        self._backoff = backoff or Backoff()
        self._opened = False
        self._closed = False
        self.direct = hasattr(os, "O_DIRECT")
        """Whether slabs are read and written past the page cache; False where the filesystem refuses it."""
        self._write_buffer = mmap.mmap(-1, DIRECT_ALIGN)  # page-aligned; grown to the largest slot
        self._read_buffers = threading.local()  # one aligned buffer per reading thread
        self.num_evicted = 0
        self._try_open(startup=True)

    # ---- opening and the index ---------------------------------------------

    def _try_open(self, startup: bool = False) -> bool:
        """Create and index the directory, then prove it writable. Unusable: the engine serves without
        the tier and the backoff decides when to try again. Read-only: its blocks are served, and writes
        wait for the backoff like any write fault."""
        # Warn once at startup; retries while the fault lasts stay quiet (they are counted as skips).
        log = logger.warning if startup else logger.debug
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._rebuild_index()
        except OSError as exc:
            log("KV offload disk tier %s is not usable (%s); serving without it and retrying later", self.root, exc)
            self._backoff.failed()
            return False
        self._opened = True
        try:
            probe = self.root / f".probe-{uuid.uuid4().hex}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            log("KV offload disk tier %s is not writable (%s); serving the %d blocks it holds and retrying "
                "writes later", self.root, exc, len(self._index))
            self._backoff.failed()
            return True
        self._backoff.succeeded()
        return True

    def _rebuild_index(self) -> None:
        self._close_slabs()  # (a retry after a failed start begins afresh)
        found: list[tuple[int, bytes, Slab, int, int]] = []
        for ns_dir in sorted(self.root.iterdir()):
            if ns_dir.is_dir():
                for path in sorted(ns_dir.glob(f"*{SUFFIX}")):
                    slab = self._adopt(path)
                    if slab is not None:
                        found += [(written, key, slab, slot, length) for key, written, slot, length
                                  in self._scan(slab, ns_dir.name)]
        found.sort(key=lambda entry: entry[0])
        with self._lock:
            for _, key, slab, slot, length in found:  # the same block in two slots: the newer write wins
                self._index.pop(key, None)
                self._index[key] = (slab, slot, length)
            for slab, _, _ in self._index.values():
                self._used += slab.slot_bytes
                slab.occupied += 1
            taken = {(id(slab), slot) for slab, slot, _ in self._index.values()}
            for slab in self._slabs:
                self._free.setdefault(slab.kind, []).extend(
                    (slab, slot) for slot in range(slab.num_written) if (id(slab), slot) not in taken)
            while self._used > self._capacity and self._index:  # (the tier was made smaller)
                self._evict_oldest()

    def _adopt(self, path: Path) -> Slab | None:
        """Open and lock a slab found at startup; None if it is not one, or another live engine holds it."""
        try:
            slot_bytes = int(path.name.split("-", 1)[0])
        except ValueError:
            return None
        if slot_bytes <= HEADROOM or slot_bytes % DIRECT_ALIGN:
            return None
        fd = self._open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        num_written = os.fstat(fd).st_size // slot_bytes  # a slot cut short at the end is written over
        slab = Slab(path, fd, slot_bytes, path.parent.name, max(num_written, SLAB_BYTES // slot_bytes), num_written,
                    generations=[0] * num_written)
        self._slabs.append(slab)
        self._allocated += num_written * slot_bytes
        if num_written < slab.num_slots:
            self._filling[slab.kind] = slab
        return slab

    def _scan(self, slab: Slab, ns_hex: str) -> list[tuple[bytes, int, int, int]]:
        """(key, written ns, slot, record length) of each slot whose header is sound and of this namespace."""
        entries = []
        for slot in range(slab.num_written):
            header = parse_slot_header(self._read(slab, slot, HEADROOM))
            if header is not None and header[0][:DIGEST_BYTES].hex() == ns_hex and len(header[0]) > DIGEST_BYTES \
                    and padded_size(HEADROOM + header[2], DIRECT_ALIGN) <= slab.slot_bytes:
                entries.append((header[0], header[1], slot, header[2]))
        return entries

    def _open(self, path: Path, flags: int) -> int:
        """An fd of `path`, past the page cache where the filesystem allows it."""
        if self.direct:
            try:
                return os.open(path, flags | os.O_DIRECT, 0o644)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                logger.info("KV offload disk tier %s: no O_DIRECT here (%s); buffered writes", self.root, exc)
                self.direct = False
        return os.open(path, flags, 0o644)

    def _pwrite(self, slab: Slab, data: memoryview, offset: int) -> None:
        """Write at `offset` through an fd of its own: a slab stays open for reading only, so an operator
        can still remount its filesystem read-only (open and close cost ~4 us, a create ~100x that)."""
        fd = self._open(slab.path, os.O_WRONLY)
        try:
            written = 0
            while written < len(data):  # a short write of whole blocks continues aligned
                done = os.pwrite(fd, data[written:], offset + written)
                if done == 0:
                    raise OSError(errno.EIO, "a write made no progress")
                written += done
        finally:
            os.close(fd)

    def available(self) -> bool:
        return self._opened or (not self._closed and self._backoff.ready() and self._try_open())

    def location(self, key: bytes) -> tuple[Path, int, int] | None:
        """(slab file, byte offset of the record, record length) of a held block: for tests and tools."""
        with self._lock:
            loc = self._index.get(key)
        return None if loc is None else (loc[0].path, loc[0].offset(loc[1]) + HEADROOM, loc[2])

    # ---- Tier ----------------------------------------------------------------

    def get(self, key: bytes) -> bytes | None:
        """The record, None when missing (or its slot was reused while it was read); FrameError when the
        slot is bad (the store counts it and deletes the block)."""
        if not self.available():
            return None
        with self._lock:
            loc = self._index.get(key)
            if loc is None:
                return None
            self._index.move_to_end(key)
            slab, slot, length = loc
            generation = slab.generations[slot]
        try:
            data = self._read(slab, slot, HEADROOM + length)
        except OSError as exc:
            if self._reused(key, loc, generation):  # (its slab emptied and was deleted meanwhile)
                return None
            raise TierFault("read", str(exc)) from exc
        if self._reused(key, loc, generation):  # what was read may be either block, or a mix
            return None
        if len(data) < HEADROOM:
            raise FrameError("truncated", f"slot {slot} of {slab.path.name}: {len(data)} bytes, no header")
        header = parse_slot_header(data[:HEADROOM])
        if header is None or header[0] != key:
            raise FrameError("checksum", f"slot {slot} of {slab.path.name}: bad slot header")
        if len(data) < HEADROOM + length:
            raise FrameError("truncated", f"slot {slot} of {slab.path.name}: {len(data) - HEADROOM} of {length} bytes")
        record = bytes(data[HEADROOM:HEADROOM + length])
        if _CRC.unpack_from(record, length - _CRC.size)[0] != header[3]:
            raise FrameError("checksum", f"slot {slot} of {slab.path.name}: the record is not the one its header names")
        self._touch(key, loc, generation, data)
        return record

    def _touch(self, key: bytes, loc: Location, generation: int, data: memoryview) -> None:
        """Restamp a block just read (its slot's first aligned block, header and all, from what was read),
        so a restarted engine orders it as recent. Best effort: a failed or skipped touch only costs order."""
        head = data.obj  # the whole aligned read buffer (data is a view of it)
        assert isinstance(head, mmap.mmap)
        first = memoryview(head)[:DIRECT_ALIGN]
        header = slot_header(key, data[HEADROOM:], time.time_ns())
        first[:len(header)] = header
        with self._write_lock:
            if self._reused(key, loc, generation):
                return
            with contextlib.suppress(OSError):
                self._pwrite(loc[0], first, loc[0].offset(loc[1]))

    def _reused(self, key: bytes, loc: Location, generation: int) -> bool:
        """Whether the slot read for `key` was given to another block since the read began."""
        with self._lock:
            return self._index.get(key) is not loc or loc[0].generations[loc[1]] != generation

    def put(self, key: bytes, value: bytes) -> bool:
        return self.put_record(key, memoryview(value))

    def put_record(self, key: bytes, record: memoryview, buffer: RecordBuffer | None = None) -> bool:
        if not self.available():
            raise TierFault("skipped", "disk tier unusable")
        if not self._backoff.ready():
            raise TierFault("skipped", "backing off after a write fault")
        if len(key) > MAX_KEY_BYTES:
            raise ValueError(f"a disk tier key is at most {MAX_KEY_BYTES} bytes, got {len(key)}")
        slot_bytes = padded_size(HEADROOM + len(record), DIRECT_ALIGN)
        if slot_bytes > self._capacity:
            return False
        with self._write_lock:
            with self._lock:
                if key in self._index:
                    return False  # same key, same bytes: the key names the weights, codec and tokens
            try:
                claimed = self._claim(key, slot_bytes)
                if claimed is None:
                    return False
                slab, slot = claimed
                try:
                    self._write_slot(slab, slot, key, record, buffer)
                except OSError:
                    with self._lock:
                        self._free.setdefault(slab.kind, []).append((slab, slot))
                    raise
            except OSError as exc:
                self._backoff.failed()
                raise _write_fault(exc) from exc
            self._backoff.succeeded()
            with self._lock:
                self._index[key] = (slab, slot, len(record))
                self._used += slot_bytes
                slab.occupied += 1
        return True

    def delete(self, key: bytes) -> None:
        """Forget a block and void its slot header on disk (a corrupt block must not come back at the
        next startup); the slot is free again once voided."""
        with self._lock:
            loc = self._index.pop(key, None)
            if loc is None:
                return
            slab, slot, _ = loc
            self._used -= slab.slot_bytes
            slab.occupied -= 1
            slab.generations[slot] += 1
        try:
            with self._write_lock:
                self._pwrite(slab, self._zeros(), slab.offset(slot))
        except OSError as exc:
            raise TierFault("write", str(exc)) from exc
        finally:
            with self._lock:
                self._release(slab, slot)

    def contains_many(self, keys: list[bytes]) -> list[bool]:
        if not self._opened:
            return [False] * len(keys)
        with self._lock:
            return [key in self._index for key in keys]

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used

    def check_integrity(self) -> list[str]:
        """The index against the slabs: totals, capacity, slots free and held at once, and every held
        slot's header on disk naming its block."""
        with self._lock:
            index = dict(self._index)
            free = [(slab, slot) for slots in self._free.values() for slab, slot in slots]
            used, allocated, slabs = self._used, self._allocated, list(self._slabs)
        problems = []
        if used != sum(slab.slot_bytes for slab, _, _ in index.values()):
            problems.append(f"used_bytes {used} != the indexed slots' bytes")
        if used > self._capacity:
            problems.append(f"{used} bytes indexed > capacity {self._capacity}")
        if allocated != sum(slab.num_written * slab.slot_bytes for slab in slabs):
            problems.append(f"allocated {allocated} != the slabs' written slots")
        held = {(id(slab), slot) for slab, slot, _ in index.values()}
        if len(held) != len(index) or held & {(id(slab), slot) for slab, slot in free}:
            problems.append("a slot is held twice, or held and free")
        problems += [f"{slab.path.name}: occupied {slab.occupied} != its indexed slots" for slab in slabs
                     if slab.occupied != sum(1 for s, _, _ in index.values() if s is slab)]
        for key, (slab, slot, length) in index.items():
            header = parse_slot_header(self._read(slab, slot, HEADROOM))
            if header is None or header[0] != key or header[2] != length:
                problems.append(f"slot {slot} of {slab.path.name} does not hold its indexed block")
        return problems

    def keys(self) -> list[bytes]:
        """Oldest first."""
        with self._lock:
            return list(self._index)

    def close(self) -> None:
        """Close the slabs (releasing their locks for the next engine on this directory)."""
        with self._write_lock:
            self._close_slabs()
            self._opened, self._closed = False, True

    # ---- helpers ---------------------------------------------------------------

    def _close_slabs(self) -> None:
        with self._lock:
            for slab in self._slabs:
                with contextlib.suppress(OSError):
                    os.close(slab.fd)
            self._slabs.clear()
            self._index.clear()
            self._free.clear()
            self._filling.clear()
            self._used = self._allocated = 0

    def _claim(self, key: bytes, slot_bytes: int) -> tuple[Slab, int] | None:
        """A slot for a new block: a free one, else a new one within capacity, else the least recently
        used block's (evicted); None when the tier cannot hold it. Holds the write lock."""
        kind = key[:DIGEST_BYTES].hex(), slot_bytes
        while True:
            with self._lock:
                free = self._free.get(kind)
                if free:
                    slab, slot = free.pop()
                    slab.generations[slot] += 1
                    return slab, slot
                if self._allocated + slot_bytes <= self._capacity:
                    filling = self._filling.get(kind)
                    if filling is not None and filling.num_written < filling.num_slots:
                        filling.num_written += 1
                        filling.generations.append(0)
                        self._allocated += slot_bytes
                        return filling, filling.num_written - 1
                elif self._index:
                    self._evict_oldest()
                    continue
                else:
                    return None
            self._new_slab(kind)  # (outside the lock: creating a file; readers go on)

    def _new_slab(self, kind: Kind) -> None:
        namespace, slot_bytes = kind
        directory = self.root / namespace
        directory.mkdir(exist_ok=True)
        path = directory / f"{slot_bytes}-{uuid.uuid4().hex}{SUFFIX}"
        fd = self._open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with self._lock:
            slab = Slab(path, fd, slot_bytes, namespace, max(1, SLAB_BYTES // slot_bytes))
            self._slabs.append(slab)
            self._filling[kind] = slab

    def _evict_oldest(self) -> None:
        """Drop the least recently used block (holding the lock); its slot is free for the next write."""
        _, (slab, slot, _) = self._index.popitem(last=False)
        self._used -= slab.slot_bytes
        slab.occupied -= 1
        slab.generations[slot] += 1
        self.num_evicted += 1
        self._release(slab, slot)

    def _release(self, slab: Slab, slot: int) -> None:
        """A slot no block holds (holding the lock): free, or the whole slab deleted once it holds no block
        (its bytes go back to the tier: another size of slot, another namespace, may need them)."""
        if slab.occupied > 0:
            self._free.setdefault(slab.kind, []).append((slab, slot))
            return
        self._slabs.remove(slab)
        self._free[slab.kind] = [(s, i) for s, i in self._free.get(slab.kind, []) if s is not slab]
        if self._filling.get(slab.kind) is slab:
            del self._filling[slab.kind]
        self._allocated -= slab.num_written * slab.slot_bytes
        with contextlib.suppress(OSError):
            slab.path.unlink()
        with contextlib.suppress(OSError):
            os.close(slab.fd)

    def _write_slot(self, slab: Slab, slot: int, key: bytes, record: memoryview,
                    buffer: RecordBuffer | None) -> None:
        """Header and record in one write at the slot's offset, from the writer's RecordBuffer as it is
        (the header goes in the room it keeps), else through the tier's own aligned buffer."""
        header = slot_header(key, record, time.time_ns())
        if buffer is not None:
            source = buffer.with_header(header, DIRECT_ALIGN)
        else:
            size = padded_size(HEADROOM + len(record), DIRECT_ALIGN)
            if len(self._write_buffer) < size:
                self._write_buffer = mmap.mmap(-1, size)
            source = memoryview(self._write_buffer)[:size]
            source[:len(header)] = header
            source[HEADROOM:HEADROOM + len(record)] = record
        self._pwrite(slab, source, slab.offset(slot))

    def _read(self, slab: Slab, slot: int, length: int) -> memoryview:
        """Up to `length` bytes from the slot's start (fewer at the file's end), through this thread's
        aligned buffer: a view, valid until this thread's next read."""
        size = padded_size(length, DIRECT_ALIGN)
        buffer = getattr(self._read_buffers, "buffer", None)
        if buffer is None or len(buffer) < size:
            buffer = self._read_buffers.buffer = mmap.mmap(-1, size)
        view = memoryview(buffer)[:size]
        got = os.preadv(slab.fd, [view], slab.offset(slot))
        return view[:min(got, length)]

    def _zeros(self) -> memoryview:
        """One aligned block of zeros (voids a slot header), from the write buffer: holds the write lock."""
        view = memoryview(self._write_buffer)[:DIRECT_ALIGN]
        view[:] = bytes(DIRECT_ALIGN)
        return view
