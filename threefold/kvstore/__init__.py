"""KV tiers below the engine's pool: host memory (L2), local disk (L3) and Redis (L4). Torch-free:
payloads are the engine's encoded blocks, as opaque bytes."""

from threefold.kvstore.config import OffloadConfig, add_offload_args
from threefold.kvstore.keys import FORMAT_VERSION, Namespace
from threefold.kvstore.stats import StoreStats, TierStats
from threefold.kvstore.store import TieredKVStore

__all__ = ["FORMAT_VERSION", "Namespace", "OffloadConfig", "StoreStats", "TierStats", "TieredKVStore",
           "add_offload_args"]
