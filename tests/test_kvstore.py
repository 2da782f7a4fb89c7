"""The tiered KV store (threefold/kvstore): config, keys, frames, host memory and a real disk (tmp
directories, a tiny tmpfs to fill), and the metrics. Redis: test_kvstore_redis.py. No model needed:
payloads are random bytes, compared bit for bit."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time

import pytest

from threefold.errors import ThreefoldError
from threefold.kvstore import FORMAT_VERSION, Namespace, OffloadConfig, TieredKVStore, add_offload_args
from threefold.kvstore.config import parse_bytes
from threefold.kvstore.disk import DiskTier
from threefold.kvstore.frame import HEADROOM, OVERHEAD, FrameError, RecordBuffer, decode, encode
from threefold.kvstore.memory import MemoryTier
from threefold.kvstore.tier import Backoff, Tier

from kvstore_helpers import NS, block, make_store

# ---- config ----------------------------------------------------------------------


@pytest.mark.parametrize("text,expected", [
    ("4GiB", 4 << 30), ("50GB", 50 * 10**9), ("512mib", 512 << 20), ("1.5KiB", 1536), ("1000", 1000),
    (2048, 2048), ("0", 0), ("7 MB", 7 * 10**6)])
def test_parse_bytes(text, expected):
    assert parse_bytes(text, "kv_offload_cpu_bytes") == expected


@pytest.mark.parametrize("text", ["4G", "lots", "-1", "1e9", "", "GiB"])
def test_parse_bytes_refuses_ambiguous_or_bad_sizes(text):
    with pytest.raises(ThreefoldError, match="kv_offload_cpu_bytes") as info:
        parse_bytes(text, "kv_offload_cpu_bytes")
    assert info.value.param == "kv_offload_cpu_bytes"


@pytest.mark.parametrize("kwargs,param", [
    ({"redis_url": "http://127.0.0.1:6379"}, "kv_offload_redis"),
    ({"redis_url": "redis://host:notaport"}, "kv_offload_redis"),
    ({"codec": "int3"}, "kv_offload_codec"),
    ({"cpu_bytes": "-5"}, "kv_offload_cpu_bytes"),
    ({"disk_dir": "/tmp/x", "disk_bytes": 0}, "kv_offload_disk_bytes")])
def test_config_validation_names_the_bad_option(kwargs, param):
    with pytest.raises(ThreefoldError) as info:
        OffloadConfig(**kwargs)
    assert info.value.param == param


def test_config_defaults_and_enabled():
    assert not OffloadConfig().enabled
    config = OffloadConfig(cpu_bytes="1GiB", codec="int4")
    assert config.enabled and config.cpu_bytes == 1 << 30 and config.codec == "int4:group=32"
    assert OffloadConfig(redis_url="redis://127.0.0.1:6379/2").enabled


def test_yaml_and_flags(tmp_path):
    path = tmp_path / "offload.yaml"
    path.write_text("cpu_bytes: 4GiB\nkv_offload_disk: /data/kv\ndisk_bytes: 50GB\n"
                    "redis_url: redis://127.0.0.1:6379\ncodec: int8\n")
    config = OffloadConfig.from_yaml(path)
    assert config == OffloadConfig(cpu_bytes=4 << 30, disk_dir="/data/kv", disk_bytes=50 * 10**9,
                                   redis_url="redis://127.0.0.1:6379", codec="int8")
    parser = argparse.ArgumentParser()
    add_offload_args(parser)
    ns = parser.parse_args(["--kv-offload-config", str(path), "--kv-offload-cpu-bytes", "1MiB",
                            "--kv-offload-codec", "fp8"])
    overridden = OffloadConfig.from_args(ns)  # the flags win over the file
    assert (overridden.cpu_bytes, overridden.codec, overridden.disk_dir) == (1 << 20, "fp8_e4m3", "/data/kv")
    assert OffloadConfig.from_args(parser.parse_args([])) == OffloadConfig()
    keywords = OffloadConfig.from_options(kv_offload_config=str(path), kv_offload_disk_bytes="1GiB",
                                          kv_offload_redis=None)  # LLM(...) keywords; None = not given
    assert (keywords.disk_bytes, keywords.redis_url) == (1 << 30, "redis://127.0.0.1:6379")
    with pytest.raises(ThreefoldError, match="unknown KV offload option 'kv_offload_cpu'") as info:
        OffloadConfig.from_options(kv_offload_cpu="1GiB")
    assert info.value.param == "kv_offload_cpu"


@pytest.mark.parametrize("text,match", [("cpu_byte: 1GiB\n", "unknown key 'cpu_byte'"), ("- a\n", "mapping"),
                                        ("a: [\n", "not valid YAML")])
def test_bad_yaml(tmp_path, text, match):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ThreefoldError, match=match):
        OffloadConfig.from_yaml(path)
    with pytest.raises(ThreefoldError, match="cannot read"):
        OffloadConfig.from_yaml(tmp_path / "missing.yaml")


# ---- keys and frames -------------------------------------------------------------


def test_namespace_separates_everything_a_block_depends_on():
    variants = [NS, Namespace("weights-sha:abd", "auto", 16), Namespace("weights-sha:abc", "int8", 16),
                Namespace("weights-sha:abc", "auto", 32), Namespace("weights-sha:abc", "auto", 16, FORMAT_VERSION + 1)]
    assert len({ns.digest for ns in variants}) == len(variants)
    assert Namespace("weights-sha:abc", "auto", 16).digest == NS.digest  # stable across processes
    assert NS.key(b"h" * 32) == NS.digest + b"h" * 32


def test_frame_round_trip_and_every_corruption_is_refused():
    payload = os.urandom(1000)
    record = encode(payload, NS.digest, FORMAT_VERSION)
    assert len(record) == len(payload) + OVERHEAD
    assert decode(record, NS.digest, FORMAT_VERSION) == payload
    flipped = bytearray(record)
    flipped[OVERHEAD + 10] ^= 0x01
    cases = {"checksum": bytes(flipped), "truncated": record[:-1], "bad_magic": b"XXXX" + record[4:],
             "namespace": encode(payload, Namespace("other", "auto", 16).digest, FORMAT_VERSION),
             "version": encode(payload, NS.digest, FORMAT_VERSION + 1)}
    for reason, bad in [*cases.items(), ("truncated", record[:10]), ("truncated", record + b"\0")]:
        with pytest.raises(FrameError) as info:
            decode(bad, NS.digest, FORMAT_VERSION)
        assert info.value.reason == reason


def test_the_record_buffer_frames_like_encode_in_an_aligned_buffer():
    buffer = RecordBuffer()
    for size in (1000, 368_640, 10):  # grows past its first page, then reuses the larger buffer
        payload = os.urandom(size)
        record = buffer.pack(payload, NS.digest, FORMAT_VERSION)
        assert bytes(record) == encode(payload, NS.digest, FORMAT_VERSION)
        assert decode(bytes(record), NS.digest, FORMAT_VERSION) == payload
        slot = buffer.with_header(b"HEAD", 4096)  # a tier's header in the room before the record
        assert len(slot) % 4096 == 0 and HEADROOM + len(record) <= len(slot) < HEADROOM + len(record) + 4096
        assert bytes(slot[:4]) == b"HEAD" and bytes(slot[HEADROOM:HEADROOM + len(record)]) == bytes(record)


# ---- memory tier and the store over it --------------------------------------------


def test_memory_tier_is_lru_by_bytes():
    tier = MemoryTier(capacity_bytes=1000)
    tier.put(b"a", b"1" * 400)
    tier.put(b"b", b"2" * 400)
    assert tier.get(b"a") == b"1" * 400  # a is now the most recent
    tier.put(b"c", b"3" * 300)  # 1100 > 1000: evicts b, the least recently used
    assert tier.keys() == [b"a", b"c"] and tier.used_bytes == 700 and tier.num_evicted == 1
    tier.put(b"d", b"4" * 1001)  # larger than the tier: not stored, nothing evicted
    assert tier.keys() == [b"a", b"c"]
    tier.put(b"e", b"5" * 1000)
    assert tier.keys() == [b"e"] and tier.used_bytes == 1000 and tier.check_integrity() == []


def test_store_over_memory_round_trips_and_looks_up_the_prefix():
    with make_store(cpu_bytes=64 << 10) as store:
        blocks = [block(i) for i in range(4)]
        for block_hash, payload in blocks[:3]:
            store.put(block_hash, payload)
        hashes = [h for h, _ in blocks]
        assert store.lookup(hashes) == ["cpu", "cpu", "cpu"]
        assert store.lookup([hashes[3], *hashes[:3]]) == []  # stops at the first miss
        assert store.get(hashes[1]) == ("cpu", blocks[1][1])
        assert store.get(hashes[3]) is None
        stats = store.stats().tiers["cpu"]
        assert (stats.hits, stats.misses, stats.bytes_read, stats.used_bytes) == (1, 1, 4096, 3 * 4096)


def test_a_reused_buffer_does_not_change_a_stored_block(tmp_path):
    with make_store(cpu_bytes=1 << 20, disk_dir=str(tmp_path)) as store:
        buffer = bytearray(b"a" * 4096)
        store.put(b"h" * 32, buffer)
        buffer[:] = b"b" * 4096  # the engine reuses its staging buffer for the next block
        store.flush()
        assert store.get(b"h" * 32) == ("cpu", b"a" * 4096)
        store.tiers[0].delete(NS.key(b"h" * 32))
        assert store.get(b"h" * 32) == ("disk", b"a" * 4096)


def test_another_namespace_never_hits_in_memory():
    config = OffloadConfig(cpu_bytes=64 << 10)
    tier = MemoryTier(64 << 10)
    block_hash, payload = block(0)
    with TieredKVStore(config, NS, tiers=[tier]) as mine:
        mine.put(block_hash, payload)
        with TieredKVStore(config, Namespace("weights-sha:abc", "int8", 16), tiers=[tier]) as other:
            assert other.lookup([block_hash]) == [] and other.get(block_hash) is None
        assert mine.get(block_hash) == ("cpu", payload)


def test_bandwidth_starts_at_a_prior_and_follows_reads():
    with make_store(cpu_bytes=1 << 20) as store:
        prior = store.bandwidth("cpu")
        assert prior > 1e9
        block_hash, payload = block(0, 256 << 10)
        store.put(block_hash, payload)
        store.get(block_hash)
        assert store.bandwidth("cpu") != prior and store.stats().tiers["cpu"].load_seconds > 0


# ---- disk tier -----------------------------------------------------------------------


SLOT = 8192
"""The disk slot of a 4096-byte payload: slot header room + record, rounded up to 4 KiB."""


def read_record(tier: DiskTier, key: bytes) -> bytes:
    path, offset, length = tier.location(key)
    with open(path, "rb") as file:
        file.seek(offset)
        return file.read(length)


def test_disk_round_trip_lru_and_restart(tmp_path):
    with make_store(disk_dir=str(tmp_path), disk_bytes=3 * SLOT) as store:
        blocks = [block(i) for i in range(4)]
        for block_hash, payload in blocks[:3]:
            store.put(block_hash, payload)
            store.flush()
        assert store.get(blocks[0][0]) == ("disk", blocks[0][1])  # 0 is now the most recent
        store.put(*blocks[3])
        assert store.flush(10)
        hashes = [h for h, _ in blocks]
        assert [store.lookup([h]) for h in hashes] == [["disk"], [], ["disk"], ["disk"]]  # 1 was evicted
        (slab,) = tmp_path.rglob("*.slab")  # every block in one file, in fixed slots
        assert slab.stat().st_size == 3 * SLOT and slab.name.startswith(f"{SLOT}-")
        assert store.check_integrity() == []
        disk = store.tiers[0]
        assert read_record(disk, NS.key(hashes[3])) == encode(blocks[3][1], NS.digest, NS.format_version)
        assert disk.location(NS.key(hashes[3]))[1] == SLOT + HEADROOM  # 3 went into 1's slot
        assert store.stats().writer_cpu_seconds > 0
        assert disk.direct  # ext4: written past the page cache (O_DIRECT), yet the same bytes
    with make_store(disk_dir=str(tmp_path), disk_bytes=3 * SLOT) as restarted:
        assert restarted.check_integrity() == []
        assert restarted.tiers[0].keys() == [NS.key(h) for h in (hashes[2], hashes[0], hashes[3])]  # 0 was read
        assert restarted.get(hashes[3]) == ("disk", blocks[3][1])
    with TieredKVStore(OffloadConfig(disk_dir=str(tmp_path)), Namespace("weights-sha:NEW", "auto", 16)) as other:
        assert other.lookup(hashes) == [] and other.get(hashes[0]) is None  # new weights: no stale KV


def test_a_full_disk_tier_reuses_slots_and_never_serves_one_read_while_reused(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, 2 * SLOT)
    blocks = [(NS.key(h), encode(p, NS.digest, FORMAT_VERSION)) for h, p in (block(i) for i in range(4))]
    tier.put(*blocks[0])
    tier.put(*blocks[1])
    first = tier.location(blocks[0][0])
    tier.put(*blocks[2])  # evicts 0: its slot is written over
    assert tier.location(blocks[2][0]) == first and tier.location(blocks[0][0]) is None
    assert tier.get(blocks[2][0]) == blocks[2][1] and tier.get(blocks[0][0]) is None
    # A read of 1 during which a put evicts 1 and writes 3 into that same slot: what the reader holds
    # may be 3's valid record, or a mix, and must not be returned as 1's.
    second = tier.location(blocks[1][0])
    real_read = tier._read

    def read_then_evict(slab, slot, length):
        data = real_read(slab, slot, length)
        if length > HEADROOM:  # (2 read meanwhile, so 1 is again the least recent)
            tier._index.move_to_end(blocks[1][0], last=False)
            tier.put(*blocks[3])
        return data

    monkeypatch.setattr(tier, "_read", read_then_evict)
    assert tier.get(blocks[1][0]) is None
    monkeypatch.undo()
    assert tier.location(blocks[3][0]) == second
    assert tier.get(blocks[3][0]) == blocks[3][1] and tier.check_integrity() == []
    big = encode(os.urandom(2 * 4096), NS.digest, FORMAT_VERSION)  # another size of slot: evicts both,
    assert tier.put(NS.key(b"x" * 32), big)  # and the emptied slab is deleted to make room
    (slab,) = tmp_path.rglob("*.slab")
    assert slab.name.startswith("12288-") and tier.get(NS.key(b"x" * 32)) == big
    assert tier.check_integrity() == [] and tier.used_bytes == 12288
    tier.close()


def test_two_engines_on_one_disk_directory_keep_to_their_own_slabs(tmp_path):
    first, second = DiskTier(tmp_path, 4 * SLOT), DiskTier(tmp_path, 4 * SLOT)
    a, b = (NS.key(block(i)[0]) for i in range(2))
    record_a, record_b = (encode(block(i)[1], NS.digest, FORMAT_VERSION) for i in range(2))
    first.put(a, record_a)
    second.put(b, record_b)  # cannot take the first one's slab (locked): makes its own
    assert len(list(tmp_path.rglob("*.slab"))) == 2
    assert first.get(a) == record_a and second.get(b) == record_b and second.get(a) is None
    first.close()
    third = DiskTier(tmp_path, 4 * SLOT)  # a restart beside the live second: adopts the first's slab only
    assert third.get(a) == record_a and third.get(b) is None and third.check_integrity() == []
    second.close()
    third.close()


def test_each_namespace_keeps_its_blocks_in_its_own_slabs_across_a_restart(tmp_path):
    other = Namespace("weights-sha:other", "auto", 16)
    tier = DiskTier(tmp_path, 3 * SLOT)
    mine, theirs = NS.key(block(0)[0]), other.key(block(1)[0])
    records = {mine: encode(block(0)[1], NS.digest, FORMAT_VERSION),
               theirs: encode(block(1)[1], other.digest, FORMAT_VERSION)}
    for key, record in records.items():
        tier.put(key, record)
    assert sorted(p.parent.name for p in tmp_path.rglob("*.slab")) == sorted([NS.hex, other.hex])
    tier.close()
    restarted = DiskTier(tmp_path, 3 * SLOT)
    assert all(restarted.get(key) == record for key, record in records.items())
    assert restarted.check_integrity() == []
    restarted.close()


@pytest.mark.parametrize("damage,reason", [("flip", "checksum"), ("truncate", "truncated"),
                                           ("header", "checksum"), ("torn", "checksum")])
def test_corrupt_disk_block_is_detected_deleted_and_counted(tmp_path, damage, reason):
    with make_store(disk_dir=str(tmp_path)) as store:
        block_hash, payload = block(0)
        store.put(block_hash, payload)
        store.flush()
        path, offset, length = store.tiers[0].location(NS.key(block_hash))
        data = bytearray(path.read_bytes())
        if damage == "flip":  # a payload byte: the record's own CRC
            data[offset + OVERHEAD + 100] ^= 0xFF
        elif damage == "truncate":
            del data[offset + length // 2:]
        elif damage == "header":  # the key in the slot header: its CRC
            data[offset - HEADROOM + 40] ^= 0xFF
        else:  # a torn write: the header of a new block over the older record (every CRC is sound)
            other = encode(block(1)[1], NS.digest, NS.format_version)
            data[offset:offset + len(other)] = other
        path.write_bytes(bytes(data))
        assert store.get(block_hash) is None
        assert store.lookup([block_hash]) == [] and store.tiers[0].location(NS.key(block_hash)) is None
        assert store.stats().tiers["disk"].faults == {reason: 1}
        assert store.check_integrity() == []
    with make_store(disk_dir=str(tmp_path)) as restarted:  # its slot header was voided: not indexed again
        assert restarted.lookup([block_hash]) == [] and restarted.check_integrity() == []


def test_unwritable_disk_dir_warns_disables_the_tier_and_recovers(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("a regular file: no directory can be made under it, even by root")
    with caplog.at_level(logging.WARNING), make_store(cpu_bytes=1 << 20, disk_dir=str(blocker / "kv")) as store:
        assert "not usable" in caplog.text
        block_hash, payload = block(0)
        store.put(block_hash, payload)
        store.flush()
        assert store.get(block_hash) == ("cpu", payload)  # the other tiers serve
        assert store.stats().tiers["disk"].writes == 0
        blocker.unlink()
        blocker.mkdir()  # the fault ends: the tier opens on a later try
        deadline = time.monotonic() + 10
        while store.stats().tiers["disk"].writes == 0 and time.monotonic() < deadline:
            store.put(*block(1))
            store.flush()
            time.sleep(0.05)
        assert store.stats().tiers["disk"].writes >= 1
        assert list((blocker / "kv").rglob("*.slab"))


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 64 KiB filesystem (tmpfs), to fill up and to remount read-only; root only."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount_point)],
                            capture_output=True, check=False)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {result.stderr.decode().strip()}")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


def wait_for_disk_writes(store: TieredKVStore, at_least: int) -> None:
    deadline, i = time.monotonic() + 10, 1000
    while store.stats().tiers["disk"].writes < at_least and time.monotonic() < deadline:
        time.sleep(0.05)  # the backoff pause runs out
        i += 1
        store.put(*block(i))
        store.flush()


def test_full_then_read_only_disk_is_counted_skipped_and_recovers(small_tmpfs):
    def remount(options: str) -> None:
        subprocess.run(["mount", "-o", f"remount,{options}", str(small_tmpfs)], check=True)

    # A short backoff (20 ms doubling to 100 ms) so the test need not wait out the default 5 s pause.
    tiers = [MemoryTier(1 << 20), DiskTier(small_tmpfs / "kv", 1 << 20, backoff=Backoff(0.02, 0.1))]
    with TieredKVStore(OffloadConfig(), NS, tiers=tiers) as store:
        blocks = [block(i, 16 << 10) for i in range(8)]  # 128 KiB into 64 KiB: the disk fills up
        for block_hash, payload in blocks:
            store.put(block_hash, payload)
            store.flush()
        disk = store.stats().tiers["disk"]
        assert disk.faults.get("disk_full", 0) >= 1 and 1 <= disk.writes < 8
        assert not list(small_tmpfs.rglob(".tmp-*"))  # a failed write leaves nothing visible
        assert all(store.get(h) == ("cpu", p) for h, p in blocks)  # every block still served
        assert store.check_integrity() == []
        remount("size=1m")
        wait_for_disk_writes(store, disk.writes + 1)  # space again: the tier is used again
        assert store.stats().tiers["disk"].writes > disk.writes
        remount("ro")
        time.sleep(0.15)  # past the longest backoff pause: the next write is tried, and fails
        store.put(*block(99, 1024))
        store.flush()
        assert store.stats().tiers["disk"].faults.get("read_only", 0) >= 1
        store.tiers[0].delete(NS.key(blocks[0][0]))
        assert store.get(blocks[0][0]) == ("disk", blocks[0][1])  # a read-only disk still serves reads


def test_a_read_only_disk_at_startup_serves_what_it_holds(small_tmpfs, caplog):
    block_hash, payload = block(0)
    with make_store(disk_dir=str(small_tmpfs / "kv")) as store:
        store.put(block_hash, payload)
        store.flush()
    subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)
    with caplog.at_level(logging.WARNING), make_store(disk_dir=str(small_tmpfs / "kv")) as store:
        assert "not writable" in caplog.text
        assert store.get(block_hash) == ("disk", payload)
        store.put(*block(1))
        store.flush()
        assert store.stats().tiers["disk"].skipped == 1 and store.lookup([block(1)[0]]) == []


def test_chain_promotes_a_lower_hit_upwards(tmp_path):
    with make_store(cpu_bytes=1 << 20, disk_dir=str(tmp_path)) as store:
        block_hash, payload = block(0)
        store.put(block_hash, payload)
        store.flush()
        memory = store.tiers[0]
        memory.delete(NS.key(block_hash))
        assert store.lookup([block_hash]) == ["disk"]
        assert store.get(block_hash) == ("disk", payload)
        assert store.lookup([block_hash]) == ["cpu"]  # promoted
        stats = store.stats().tiers
        assert (stats["cpu"].misses, stats["disk"].hits) == (1, 1)


def test_random_traffic_against_the_writer_thread_never_serves_wrong_bytes(tmp_path):
    """The engine thread puts, looks up and gets at random while the writer fills the disk; small tiers
    force evictions in both. Every payload is a function of its hash, so any mix-up shows."""
    import hashlib
    import random

    def payload_of(block_hash: bytes) -> bytes:
        size = 512 + block_hash[0] * 16
        return (hashlib.sha256(block_hash).digest() * (size // 32 + 1))[:size]

    rng = random.Random(0)
    hashes = [hashlib.sha256(bytes([i])).digest() for i in range(40)]
    with make_store(cpu_bytes=8 << 10, disk_dir=str(tmp_path), disk_bytes=32 << 10) as store:
        for _ in range(400):
            block_hash = rng.choice(hashes)
            op = rng.random()
            if op < 0.5:
                store.put(block_hash, payload_of(block_hash))
            elif op < 0.8:
                found = store.get(block_hash)
                assert found is None or found[1] == payload_of(block_hash)
            elif op < 0.97:
                tiers = store.lookup(rng.sample(hashes, 3))
                assert set(tiers) <= {"cpu", "disk"}
            else:
                store.flush(10)  # now and then let the writer (one direct write per block) catch up, so L3 holds blocks
        assert store.flush(10)
        assert store.check_integrity() == []
        stats = store.stats().tiers
        assert stats["cpu"].hits > 0 and stats["disk"].hits > 0 and stats["disk"].used_bytes <= 32 << 10


def test_integrity_check_can_fail(tmp_path):
    with make_store(disk_dir=str(tmp_path)) as store:
        store.put(*block(0))
        store.flush()
        (path,) = tmp_path.rglob("*.slab")
        path.write_bytes(b"x")
        assert store.check_integrity() == [f"disk: slot 0 of {path.name} does not hold its indexed block"]


def test_a_full_writer_queue_drops_and_counts(tmp_path):
    with TieredKVStore(OffloadConfig(disk_dir=str(tmp_path)), NS, max_pending_bytes=1000) as store:
        store.put(*block(0, 4096))
        store.flush()
        assert store.stats().dropped_writes == 1 and not list(tmp_path.rglob("*.slab"))


class SlowTier(Tier):
    """A tier below L2 whose writes burn `cpu_s` of CPU each (what a disk or Redis write costs the writer)."""

    name = "slow"

    def __init__(self, cpu_s: float) -> None:
        self.cpu_s = cpu_s
        self.held: dict[bytes, bytes] = {}

    def get(self, key: bytes) -> bytes | None:
        return self.held.get(key)

    def put(self, key: bytes, value: bytes) -> bool:
        start = time.thread_time()
        while time.thread_time() - start < self.cpu_s:
            pass
        self.held[key] = value
        return True

    def delete(self, key: bytes) -> None:
        self.held.pop(key, None)

    def contains_many(self, keys: list[bytes]) -> list[bool]:
        return [key in self.held for key in keys]

    capacity_bytes = used_bytes = None


def test_the_writer_keeps_to_its_cpu_share_while_steps_run_and_drains_when_idle():
    tier = SlowTier(cpu_s=0.005)
    with TieredKVStore(OffloadConfig(), NS, tiers=[tier], writer_cpu_share=0.05) as store:
        store.engine_step(running=True)  # a long step: the writer may spend 5% of its wall time
        for i in range(200):
            store.put(*block(i, 64))
        time.sleep(1.0)
        busy = store.stats()
        # 1 s at 5% plus the 10 ms burst: ~12 writes of 5 ms, not the 200 an unthrottled writer does
        assert busy.writer_cpu_seconds < 0.05 + 0.01 + 0.05 and busy.pending_writes > 150
        store.engine_step(running=False)  # idle from IDLE_AFTER_S on: unthrottled
        assert store.flush(10) and len(tier.held) == 200
    with TieredKVStore(OffloadConfig(), NS, tiers=[SlowTier(0.06)], writer_cpu_share=0.0) as store:
        store.engine_step(running=True)
        store.put(*block(0, 64))
        store.put(*block(1, 64))
        assert not store.flush(0.3)  # share 0: the burst's one write, then none while the step runs
        assert store.stats().pending_writes == 1
        store.engine_step(running=False)
        assert store.flush(5)


def test_the_writer_share_follows_its_backlog_so_a_steady_producer_loses_nothing():
    # 30 blocks over 1.5 s while a step runs, 5 ms of writer CPU each: 10% of wall time. A queue of 12
    # blocks overflows at a fixed 1% share (what was the default: 3-4 writes in 1.5 s) and at 0; the
    # backlog share rises past 10% once the queue is about half full, and holds it there.
    tier = SlowTier(cpu_s=0.005)
    with TieredKVStore(OffloadConfig(), NS, tiers=[tier], max_pending_bytes=12 * 64, writer_cpu_share=0.0) as store:
        store.engine_step(running=True)
        assert store.busy_share() == 0.0  # an empty queue: no writes while steps run
        for i in range(30):
            store.put(*block(i, 64))
            time.sleep(0.05)
        busy = store.stats()
        assert busy.dropped_writes == 0 and busy.pending_writes < 12
        assert busy.writer_cpu_seconds < 0.5 * 1.5 + 0.01 + 0.05  # never past the highest share
        store.engine_step(running=False)
        assert store.flush(5) and len(tier.held) == 30
    with TieredKVStore(OffloadConfig(), NS, tiers=[SlowTier(0.005)], max_pending_bytes=12 * 64,
                       writer_cpu_share=0.01, backlog_share=0.0) as store:  # the old fixed share, for contrast
        store.engine_step(running=True)
        for i in range(30):
            store.put(*block(i, 64))
            time.sleep(0.05)
        assert store.stats().dropped_writes > 0


def test_the_writer_writes_only_once_its_backlog_passes_a_quarter_of_the_queue():
    with TieredKVStore(OffloadConfig(), NS, tiers=[SlowTier(0.06)], max_pending_bytes=8 * 64,
                       writer_cpu_share=0.0) as store:
        store.engine_step(running=True)
        for i in range(3):  # the burst takes one; two left: 2/8 of the queue, not past a quarter
            store.put(*block(i, 64))
        assert not store.flush(0.4) and store.stats().pending_writes == 2
        assert store.busy_share() == 0.0
        for i in range(3, 8):  # 7/8 full: share 0.5 x (7/8 - 1/4) / (3/4) = 5/12
            store.put(*block(i, 64))
        assert abs(store.busy_share() - 5 / 12) < 0.07  # the writer may have taken one already
        time.sleep(0.6)
        assert store.stats().pending_writes <= 5  # it wrote while the step ran
        store.engine_step(running=False)
        assert store.flush(5)


def test_a_block_still_in_the_writer_queue_is_found_and_read_from_it_after_l2_dropped_it():
    slow = SlowTier(0.02)  # the 10 ms burst covers one write
    (h0, p0), (h1, p1) = block(0, 64), block(1, 64)
    with TieredKVStore(OffloadConfig(), NS, tiers=[MemoryTier(100), slow], writer_cpu_share=0.0) as store:
        store.engine_step(running=True)  # a long step, no write budget left after one write
        store.put(h0, p0)
        store.put(h1, p1)  # L2 (100 bytes) keeps only this one
        time.sleep(0.1)
        queued = [h for h in (h0, h1) if NS.key(h) not in slow.held]
        assert queued and store.stats().pending_writes == len(queued)
        assert store.lookup([h0, h1]) == ["slow", "cpu"]
        assert store.get(h0) == ("slow", p0)  # from slow itself or from its queue: never lost
        store.engine_step(running=False)
        assert store.flush(5) and len(slow.held) == 2
        assert store.lookup([block(5, 64)[0]]) == []


def test_the_writer_queue_serves_a_queued_block_as_a_hit_of_its_tier():
    slow = SlowTier(0.02)  # the 10 ms burst covers one write
    blocks = [block(i, 64) for i in range(3)]
    with TieredKVStore(OffloadConfig(), NS, tiers=[slow], writer_cpu_share=0.0) as store:
        store.engine_step(running=True)
        for h, p in blocks:
            store.put(h, p)
        time.sleep(0.1)  # the burst writes at most one; the others wait while the step runs
        assert len(slow.held) <= 1 and store.stats().pending_writes >= 2
        assert store.lookup([h for h, _ in blocks]) == ["slow"] * 3
        assert store.get_prefix([h for h, _ in blocks]) == [("slow", p) for _, p in blocks]
        assert store.stats().tiers["slow"].hits == 3
        store.engine_step(running=False)
        assert store.flush(5) and len(slow.held) == 3


# ---- metrics ---------------------------------------------------------------------------


def test_metrics_render_per_tier_counters(tmp_path):
    from prometheus_client import CollectorRegistry, generate_latest

    from threefold.kvstore.metrics import KVOffloadCollector

    with make_store(cpu_bytes=1 << 20, disk_dir=str(tmp_path)) as store:
        registry = CollectorRegistry()
        registry.register(KVOffloadCollector(store.stats, "smollm2", NS.block_size))
        block_hash, payload = block(0)
        store.put(block_hash, payload)
        store.flush()
        store.tiers[0].delete(NS.key(block_hash))
        store.get(block_hash)  # cpu miss, disk hit
        (path,) = tmp_path.rglob("*.slab")
        path.write_bytes(b"junk")
        store.tiers[0].delete(NS.key(block_hash))
        store.get(block_hash)  # cpu miss, disk corrupt
        text = generate_latest(registry).decode()
    for line in ('threefold:kv_offload_hits_total{model_name="smollm2",tier="disk"} 1.0',
                 'threefold:kv_offload_misses_total{model_name="smollm2",tier="cpu"} 2.0',
                 'threefold:kv_offload_hit_tokens_total{model_name="smollm2",tier="disk"} 16.0',
                 'threefold:kv_offload_faults_total{kind="truncated",model_name="smollm2",tier="disk"} 1.0',
                 f'threefold:kv_offload_read_bytes_total{{model_name="smollm2",tier="disk"}} {4096.0}',
                 'threefold:kv_offload_capacity_bytes{model_name="smollm2",tier="cpu"} 1.048576e+06',
                 'threefold:kv_offload_dropped_writes_total{model_name="smollm2"} 0.0'):
        assert line in text, line


@pytest.mark.parametrize("env,expected", [({}, "True"), ({"MALLOC_TRIM_THRESHOLD_": "131072"}, "False")])
def test_the_store_keeps_mallocs_heap_mapped_unless_the_user_tuned_it(env, expected):
    # A fresh process: the setting is process-wide and made once. glibc only (this image's libc).
    script = ("from threefold.kvstore.malloc import keep_heap_mapped\n"
              "from threefold.kvstore import Namespace, OffloadConfig, TieredKVStore\n"
              "TieredKVStore(OffloadConfig(cpu_bytes=1 << 20), Namespace('w', 'auto', 16)).close()\n"
              "print(keep_heap_mapped())")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    result = subprocess.run([sys.executable, "-c", script], env={**clean, **env}, capture_output=True, text=True,
                            timeout=60, check=True)
    assert result.stdout.strip() == expected
