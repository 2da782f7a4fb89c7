"""External KV: the scheduler's view of the KV offload store (plain Python; the engine implements it).

On admission the scheduler offers the request's block hashes past its local prefix hit; the store
side stages the payloads of the longest prefix worth loading (its tiers' bandwidth against the
recompute time) and says from which tier each came. Staging is verified data in host memory, so the
runner's load before the forward cannot fail: a missing or corrupt block simply ends the prefix and
the rest is recomputed.
"""

from __future__ import annotations

from typing import Protocol


class ExternalKV(Protocol):
    def fetch(self, request_id: str, block_hashes: list[bytes], num_tokens_after: int) -> list[str]:
        """Stage the longest loadable prefix of `block_hashes`; the tier of each staged block.
        `num_tokens_after`: tokens the request computes past these blocks anyway (for the cost model)."""
        ...

    def release(self, request_id: str) -> None:
        """Drop what was staged for a request that will not load it (finished, or not admitted)."""
        ...
