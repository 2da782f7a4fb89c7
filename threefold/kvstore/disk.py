"""L3: one file per block in a local directory; survives restarts; least recently used out first.

    DIR/<namespace digest hex>/<first 2 hex of block hash>/<block hash hex>.kv

Each file is written to a temporary name and renamed over its final name, so a reader sees a whole
block or none (the frame's checksum still catches what the disk itself garbles). The write bypasses
the page cache (O_DIRECT, straight from the writer's page-aligned RecordBuffer, frame.py) where the
filesystem allows it: on this VM a buffered 720 KiB block costs the writer 4-9 ms of CPU (page-cache
pages allocated and copied into, then written back by the kernel), a direct write 0.4-0.5 ms, and
every CPU-second the writer spends is taken from the engine's compute threads. A direct write returns
when the device has the data, so no fsync: the data is on the device before the rename makes it
visible; a power cut may still lose the newest blocks or leave one the checksum rejects, which a
cache recomputes. Where O_DIRECT is refused (tmpfs), the write is buffered and fsynced before the
rename. A full tier writes over its evicted blocks' files (SPARE_FILES) instead of creating new ones:
creating the file is most of a direct write's CPU. The LRU index lives in memory and is rebuilt from
the directory at startup, ordered by modification time (a read touches the file), so a restarted
engine finds its blocks and keeps evicting the coldest.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import threading
import uuid
from collections import OrderedDict
from pathlib import Path

from threefold.kvstore.frame import RecordBuffer, padded_size
from threefold.kvstore.keys import DIGEST_BYTES
from threefold.kvstore.tier import Backoff, Tier, TierFault

logger = logging.getLogger(__name__)

SUFFIX = ".kv"
TMP_PREFIX = ".tmp-"
DIRECT_ALIGN = 4096
"""O_DIRECT's unit for buffer address, length and file offset (any disk's logical block divides it)."""
SPARE_FILES = 32
"""Evicted blocks' files kept for reuse at most. Creating a file costs this VM's kernel 0.1-0.3 ms of
CPU (an inode, its first blocks, journal entries: most of a 360 KiB block's write), overwriting one
in place well under 0.1 ms; a full tier evicts a block for every block it writes. Spares are left-over
temporaries: not counted in used_bytes, deleted on close and at the next startup."""


def _write_fault(exc: OSError) -> TierFault:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return TierFault("disk_full", str(exc))
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR):
        return TierFault("read_only", str(exc))
    return TierFault("write", str(exc))


class DiskTier(Tier):
    name = "disk"

    def __init__(self, root: str | Path, capacity_bytes: int, backoff: Backoff | None = None) -> None:
        self.root = Path(root)
        self._capacity = capacity_bytes
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, oldest first
        self._used = 0
        self._lock = threading.Lock()
        self._backoff = backoff or Backoff()
        self._opened = False
        self.direct = hasattr(os, "O_DIRECT")
        """Whether writes bypass the page cache; False after the filesystem refused it once."""
        self._direct_buffer = mmap.mmap(-1, DIRECT_ALIGN)  # page-aligned; grown to the largest record
        self._write_lock = threading.Lock()  # one writer of the buffer at a time
        self._spares: list[Path] = []  # evicted blocks' files, renamed to temporaries, to write over
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
            probe = self.root / f"{TMP_PREFIX}probe-{uuid.uuid4().hex}"
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
        found = []
        for ns_dir in self.root.iterdir():
            if not ns_dir.is_dir():
                continue
            for path in ns_dir.glob("*/*"):
                if path.name.startswith(TMP_PREFIX):
                    with contextlib.suppress(OSError):  # (a read-only disk keeps it; it is never read)
                        path.unlink()  # a write cut short by a crash: never visible, now gone
                    continue
                key = _key_of(ns_dir.name, path.name)
                if key is not None:
                    stat = path.stat()
                    found.append((stat.st_mtime_ns, key, stat.st_size))
        found.sort()
        with self._lock:
            self._index = OrderedDict((key, size) for _, key, size in found)
            self._used = sum(size for _, _, size in found)

    def available(self) -> bool:
        return self._opened or (self._backoff.ready() and self._try_open())

    def path_of(self, key: bytes) -> Path:
        block_hex = key[DIGEST_BYTES:].hex()
        return self.root / key[:DIGEST_BYTES].hex() / block_hex[:2] / (block_hex + SUFFIX)

    # ---- Tier ----------------------------------------------------------------

    def get(self, key: bytes) -> bytes | None:
        if not self.available() or key not in self._index:
            return None
        path = self.path_of(key)
        try:
            with open(path, "rb") as file:
                inode = os.fstat(file.fileno()).st_ino
                data = file.read()
            # Still this block's file? An evicted file is renamed away, then written over in place as a
            # spare (SPARE_FILES): read meanwhile, it may hold another block's valid record.
            same = os.stat(path).st_ino == inode
        except FileNotFoundError:  # evicted meanwhile (by us, or another instance on the directory)
            self._forget(key)
            return None
        except OSError as exc:
            raise TierFault("read", str(exc)) from exc
        if not same:
            return None  # written again since we opened it: a miss this time
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
        # The restart index orders by mtime, so a read makes the block recent; a read-only disk still
        # serves reads, only the order after a restart suffers.
        with contextlib.suppress(OSError):
            os.utime(path)
        return data

    def put(self, key: bytes, value: bytes) -> bool:
        return self.put_record(key, memoryview(value))

    def put_record(self, key: bytes, record: memoryview, buffer: RecordBuffer | None = None) -> bool:
        if not self.available():
            raise TierFault("skipped", "disk tier unusable")
        if not self._backoff.ready():
            raise TierFault("skipped", "backing off after a write fault")
        size = len(record)
        if size > self._capacity or key in self._index:
            return False  # same key, same bytes: the key names the weights, codec and tokens
        try:
            self._make_room(size)
            self._write_atomically(self.path_of(key), record, buffer)
        except OSError as exc:
            self._backoff.failed()
            raise _write_fault(exc) from exc
        self._backoff.succeeded()
        with self._lock:
            if key not in self._index:
                self._index[key] = size
                self._used += size
        return True

    def delete(self, key: bytes) -> None:
        self._forget(key)
        try:
            self.path_of(key).unlink(missing_ok=True)
        except OSError as exc:
            raise TierFault("write", str(exc)) from exc

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
        """The index against the files: sizes, totals and capacity. Files that another instance on the
        same directory wrote after our startup are not in our index and not reported."""
        with self._lock:
            index = dict(self._index)
            used = self._used
        problems = [f"used_bytes {used} != {sum(index.values())} indexed"] if used != sum(index.values()) else []
        if used > self._capacity:
            problems.append(f"{used} bytes indexed > capacity {self._capacity}")
        for key, size in index.items():
            path = self.path_of(key)
            try:
                actual = path.stat().st_size
            except FileNotFoundError:
                problems.append(f"{path.name} indexed but missing")
                continue
            if actual != size:
                problems.append(f"{path.name} is {actual} bytes, indexed as {size}")
        return problems

    def keys(self) -> list[bytes]:
        """Oldest first."""
        with self._lock:
            return list(self._index)

    def close(self) -> None:
        with self._write_lock:
            for spare in self._spares:
                with contextlib.suppress(OSError):
                    spare.unlink()
            self._spares.clear()

    # ---- helpers ---------------------------------------------------------------

    def _write_atomically(self, path: Path, record: memoryview, buffer: RecordBuffer | None) -> None:
        with self._write_lock:
            spare = self._spares.pop() if self._spares and self.direct else None
            tmp = spare or path.parent / f"{TMP_PREFIX}{uuid.uuid4().hex}"
            try:
                try:
                    if not (self.direct and self._write_direct(tmp, record, buffer, spare is not None)):
                        _write_buffered(tmp, record)
                except FileNotFoundError:  # no directory for the block yet (or the spare was deleted: a
                    path.parent.mkdir(parents=True, exist_ok=True)  # restarting instance clears temporaries)
                    tmp = path.parent / f"{TMP_PREFIX}{uuid.uuid4().hex}"
                    if not (self.direct and self._write_direct(tmp, record, buffer, False)):
                        _write_buffered(tmp, record)
                try:
                    os.replace(tmp, path)
                except FileNotFoundError:  # a spare from another directory, and this one is not made yet
                    path.parent.mkdir(parents=True, exist_ok=True)
                    os.replace(tmp, path)
            except OSError:
                tmp.unlink(missing_ok=True)
                raise

    def _write_direct(self, tmp: Path, record: memoryview, buffer: RecordBuffer | None, reuse: bool) -> bool:
        """Write the record with O_DIRECT, padded to DIRECT_ALIGN, then cut to its size; False (and
        never again) where the filesystem refuses O_DIRECT. From the writer's aligned RecordBuffer as
        it is, else through the tier's own aligned buffer. `reuse`: `tmp` is a spare file (overwritten
        in place: no inode to create, no blocks to allocate)."""
        size = len(record)
        if buffer is not None:
            source = buffer.padded(DIRECT_ALIGN)
        else:
            if len(self._direct_buffer) < padded_size(size, DIRECT_ALIGN):
                self._direct_buffer = mmap.mmap(-1, padded_size(size, DIRECT_ALIGN))
            source = memoryview(self._direct_buffer)[:padded_size(size, DIRECT_ALIGN)]
            source[:size] = record
        flags = os.O_WRONLY | os.O_DIRECT | (0 if reuse else os.O_CREAT | os.O_EXCL)
        try:
            fd = os.open(tmp, flags, 0o644)
            try:
                written = 0
                while written < len(source):  # a short write of a whole number of blocks continues aligned
                    written += os.write(fd, source[written:])
                os.ftruncate(fd, size)
            finally:
                os.close(fd)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            tmp.unlink(missing_ok=True)  # (open may have worked and the write been refused)
            logger.info("KV offload disk tier %s: no O_DIRECT here (%s); buffered, fsynced writes", self.root, exc)
            self.direct = False
            return False
        return True

    def _make_room(self, num_bytes: int) -> None:
        while True:
            with self._lock:
                if self._used + num_bytes <= self._capacity or not self._index:
                    return
                key, size = self._index.popitem(last=False)
                self._used -= size
                self.num_evicted += 1
            self._retire(self.path_of(key))

    def _retire(self, path: Path) -> None:
        """Remove an evicted block's file: kept as a spare for the next write while there are fewer
        than SPARE_FILES (renamed out of the index's names first: never read as a block again)."""
        if self.direct and len(self._spares) < SPARE_FILES:
            spare = path.parent / f"{TMP_PREFIX}spare-{uuid.uuid4().hex}"
            with contextlib.suppress(FileNotFoundError), self._write_lock:  # (gone: another instance evicted it)
                os.replace(path, spare)
                self._spares.append(spare)
            return
        path.unlink(missing_ok=True)

    def _forget(self, key: bytes) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._used -= size


def _write_buffered(path: Path, record: memoryview) -> None:
    """Write the record, fsynced: the data reaches the disk before the name that points to it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        written = 0
        while written < len(record):
            written += os.write(fd, record[written:])
        os.fsync(fd)
    finally:
        os.close(fd)


def _key_of(ns_hex: str, file_name: str) -> bytes | None:
    """The key a file holds, or None for a file that is not a block (left alone, and not counted)."""
    if not file_name.endswith(SUFFIX):
        return None
    try:
        key = bytes.fromhex(ns_hex + file_name[: -len(SUFFIX)])
    except ValueError:
        return None
    return key if len(key) > DIGEST_BYTES else None
