"""The Redis tier (L4) of the tiered KV store against a real redis-server on loopback
(tests/redis_fixture.py): round trips through every tier, sharing between instances, corrupt records,
and faults: killed, hung, restarted, unreachable."""

from __future__ import annotations

import logging
import time

from threefold.kvstore import Namespace, OffloadConfig, TieredKVStore
from threefold.kvstore.frame import OVERHEAD
from threefold.kvstore.redis_tier import KEY_PREFIX
from threefold.kvstore.store import READ_CHUNK

from kvstore_helpers import NS, block, make_store


def test_redis_round_trip_through_the_whole_chain(tmp_path, redis_server):
    with make_store(cpu_bytes=1 << 20, disk_dir=str(tmp_path), redis_url=redis_server.url) as store:
        blocks = [block(i, 64 << 10) for i in range(3)]
        for block_hash, payload in blocks:
            store.put(block_hash, payload)
        assert store.flush(10)
        store.put(*blocks[0])  # settled in every tier: the second put goes no further than L2
        assert store.flush(10)
        hashes = [h for h, _ in blocks]
        assert store.lookup(hashes) == ["cpu"] * 3
        cpu, disk, _ = store.tiers
        for tier in (cpu, disk):
            tier.delete(NS.key(hashes[1]))
        assert store.lookup(hashes) == ["cpu", "redis", "cpu"]
        assert store.get(hashes[1]) == ("redis", blocks[1][1])  # bit-identical from L4
        assert store.flush(10)
        assert cpu.contains(NS.key(hashes[1])) and disk.contains(NS.key(hashes[1]))  # promoted to L2 and L3
        redis_stats = store.stats().tiers["redis"]
        assert (redis_stats.hits, redis_stats.writes, redis_stats.faults) == (1, 3, {})
        assert redis_stats.bytes_read == 64 << 10


def test_a_prefix_comes_back_in_one_mget_per_chunk_and_a_corrupt_block_ends_it(redis_server):
    import redis

    with make_store(redis_url=redis_server.url) as store:
        blocks = [block(i) for i in range(READ_CHUNK + 8)]
        for block_hash, payload in blocks:
            store.put(block_hash, payload)
        assert store.flush(10)
        hashes = [h for h, _ in blocks]
        client = redis.Redis.from_url(redis_server.url)
        client.config_resetstat()
        assert store.get_prefix(hashes) == [("redis", p) for _, p in blocks]
        calls = {name: stat["calls"] for name, stat in client.info("commandstats").items()}
        assert calls.get("cmdstat_mget") == 2 and "cmdstat_get" not in calls  # 40 blocks, 2 round trips
        client.setrange(KEY_PREFIX + NS.key(hashes[READ_CHUNK + 2]), OVERHEAD + 10, b"garbage")
        assert store.get_prefix(hashes) == [("redis", p) for _, p in blocks[: READ_CHUNK + 2]]
        stats = store.stats().tiers["redis"]
        assert stats.faults == {"checksum": 1} and stats.hits == 2 * len(blocks) - 1
        client.close()


def test_two_stores_share_blocks_through_one_redis(redis_server):
    block_hash, payload = block(0)
    with make_store(cpu_bytes=1 << 20, redis_url=redis_server.url) as instance_a:
        instance_a.put(block_hash, payload)
        assert instance_a.flush(10)
    with make_store(cpu_bytes=1 << 20, redis_url=redis_server.url) as instance_b:
        assert instance_b.lookup([block_hash, block(1)[0]]) == ["redis"]
        assert instance_b.get(block_hash) == ("redis", payload)
        other = Namespace("weights-sha:abc", "auto", 32)  # another block size: no hit
        with TieredKVStore(OffloadConfig(redis_url=redis_server.url), other) as stranger:
            assert stranger.lookup([block_hash]) == [] and stranger.get(block_hash) is None


def test_corrupt_redis_block_is_dropped(redis_server):
    import redis

    with make_store(redis_url=redis_server.url) as store:
        block_hash, payload = block(0)
        store.put(block_hash, payload)
        assert store.flush(10)
        client = redis.Redis.from_url(redis_server.url)
        (key,) = client.keys("threefold:kv:*")
        client.setrange(key, OVERHEAD, b"garbage")
        assert store.get(block_hash) is None
        assert store.stats().tiers["redis"].faults == {"checksum": 1} and client.exists(key) == 0
        client.close()


def test_killed_redis_degrades_then_recovers_on_restart(redis_server):
    with make_store(cpu_bytes=1 << 20, redis_url=redis_server.url) as store:
        store.put(*block(0))
        assert store.flush(10)
        redis_server.stop()
        for i in range(1, 20):  # puts, lookups and gets with Redis gone: none raises
            store.put(*block(i))
            assert store.lookup([block(i)[0]]) == ["cpu"]
            store.tiers[0].delete(NS.key(block(0)[0]))
            assert store.get(block(0)[0]) is None
        assert store.flush(10)
        stats = store.stats().tiers["redis"]
        assert sum(stats.faults.values()) >= 1 and stats.faults.keys() <= {"unavailable", "timeout"}
        redis_server.start()  # same port, empty (no persistence)
        block_hash, payload = block(100)
        deadline = time.monotonic() + 15
        while store.stats().tiers["redis"].writes < 2 and time.monotonic() < deadline:
            time.sleep(0.1)  # the backoff pause runs out
            store.put(block_hash, payload)
            store.flush(10)
        store.tiers[0].delete(NS.key(block_hash))
        assert store.get(block_hash) == ("redis", payload)


def test_unreachable_redis_at_startup_warns_and_serves_without_it(caplog):
    from redis_fixture import free_port

    url = f"redis://127.0.0.1:{free_port()}"
    with caplog.at_level(logging.WARNING), make_store(cpu_bytes=1 << 20, redis_url=url) as store:
        assert "not reachable" in caplog.text
        block_hash, payload = block(0)
        store.put(block_hash, payload)
        assert store.flush(10)
        assert store.get(block_hash) == ("cpu", payload)
        assert store.get(block(1)[0]) is None


def test_a_hung_redis_times_out_quickly_and_counts(redis_server):
    import signal

    with make_store(redis_url=redis_server.url) as store:
        block_hash, payload = block(0)
        store.put(block_hash, payload)
        assert store.flush(10)
        redis_server.process.send_signal(signal.SIGSTOP)  # alive but silent: a hung or overloaded server
        try:
            start = time.monotonic()
            assert store.get(block_hash) is None
            assert time.monotonic() - start < 3  # the socket timeout (0.5 s, not retried), not a hang
            assert store.get(block_hash) is None  # backing off: not even tried
        finally:
            redis_server.process.send_signal(signal.SIGCONT)
        stats = store.stats().tiers["redis"]
        assert stats.faults == {"timeout": 1} and stats.skipped == 1
