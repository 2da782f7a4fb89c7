"""L4: a Redis server that several engines share, so one computes a prefix and the others load it.

One Redis string per block, `threefold:kv:<key>`, holding the whole frame (header, payload, checksum):
there is no index key, so a block is visible exactly when its data is, and a failed SET leaves
nothing behind. Redis sizes itself: run it with `maxmemory` and `maxmemory-policy allkeys-lru`.

Faults never reach the engine: every Redis error or timeout is a TierFault, and after one the tier is
skipped for a backoff pause (tier.Backoff), then tried again, so a restarted server is used again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.retry import Retry

from threefold.kvstore.frame import RecordBuffer
from threefold.kvstore.tier import Backoff, Tier, TierFault

logger = logging.getLogger(__name__)

KEY_PREFIX = b"threefold:kv:"
READ_BUFFER_BYTES = 1 << 20
"""recv() size of the client (redis-py: 64 KiB). A read releases and retakes the GIL around every recv, and
retaking it behind the engine's thread can wait a switch interval (5 ms): a few large recvs, not hundreds."""
SOCKET_TIMEOUT_S = 0.5
"""A loopback or LAN Redis answers in well under a millisecond; half a second means it is in trouble,
and recomputing beats waiting longer."""


class RedisTier(Tier):
    name = "redis"

    def __init__(self, url: str, backoff: Backoff | None = None, socket_timeout: float = SOCKET_TIMEOUT_S) -> None:
        self.url = url
        self._backoff = backoff or Backoff()
        # One quick retry of a connection error, without a pause: it replaces a pooled connection that a
        # Redis restart closed. A timeout is not retried (the server is slow: waiting again is worse than
        # recomputing), and redis-py's default, three retries with growing sleeps, would stall the engine.
        retry = Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))
        self._client = redis.Redis.from_url(url, socket_timeout=socket_timeout,
                                            socket_connect_timeout=socket_timeout, retry=retry, max_connections=8,
                                            socket_read_size=READ_BUFFER_BYTES)
        try:
            self._client.ping()
        except (RedisError, OSError) as exc:
            logger.warning("KV offload Redis tier %s is not reachable (%s); serving without it and retrying "
                           "later", url, exc)
            self._backoff.failed()

    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Run one client call; any failure becomes a counted TierFault and starts the backoff."""
        if not self._backoff.ready():
            raise TierFault("skipped", f"Redis {self.url} backing off")
        try:
            result = fn(*args)
        except (RedisError, OSError) as exc:
            self._backoff.failed()
            kind = "timeout" if isinstance(exc, TimeoutError | redis.TimeoutError) else "unavailable"
            raise TierFault(kind, f"Redis {what}: {exc}") from exc
        self._backoff.succeeded()
        return result

    def available(self) -> bool:
        return self._backoff.ready()

    def get(self, key: bytes) -> bytes | None:
        value = self._call("GET", self._client.get, KEY_PREFIX + key)
        return bytes(value) if value is not None else None

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        """One MGET: a fault loses the whole batch (the engine recomputes from its first block)."""
        values = self._call("MGET", self._client.mget, [KEY_PREFIX + key for key in keys])
        return [bytes(value) if value is not None else None for value in values]

    def put(self, key: bytes, value: bytes) -> bool:
        self._call("SET", self._client.set, KEY_PREFIX + key, value)
        return True

    def put_record(self, key: bytes, record: memoryview, buffer: RecordBuffer | None = None) -> bool:
        """SET of the view as it is: the client sends a large value from the caller's buffer, uncopied."""
        return self.put(key, record)  # type: ignore[arg-type]  # redis-py takes any bytes-like value

    def delete(self, key: bytes) -> None:
        self._call("DEL", self._client.delete, KEY_PREFIX + key)

    def contains_many(self, keys: list[bytes]) -> list[bool]:
        if not keys:
            return []

        def exists_all() -> list[int]:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(KEY_PREFIX + key)
            return pipe.execute()

        return [bool(n) for n in self._call("EXISTS", exists_all)]

    @property
    def capacity_bytes(self) -> None:
        return None

    @property
    def used_bytes(self) -> None:
        return None  # shared with other instances; Redis' INFO memory says, not this process

    def close(self) -> None:
        self._client.close()
