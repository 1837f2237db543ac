"""KV state: pool sizing, the static and paged caches, and the paged cache's block manager (C++).

The engine's scheduler is the one caller of the block manager; models only read the caches
through the attention metadata the runner builds.
"""

from fastllm.kv_cache.chunk_store import ChunkIndex, ChunkKVStore
from fastllm.kv_cache.paged_cache import (
    BlockManager,
    KVCacheFullError,
    KVCacheSpec,
    KVPoolPlan,
    PagedKVCache,
    StaticKVCache,
    cache_dtype_serves,
    cache_slots,
    default_kv_cache_memory,
    plan_pool,
    zeros_pool,
)

__all__ = ["BlockManager", "ChunkIndex", "ChunkKVStore", "KVCacheFullError", "KVCacheSpec",
           "KVPoolPlan", "PagedKVCache", "StaticKVCache", "cache_dtype_serves", "cache_slots",
           "default_kv_cache_memory", "plan_pool", "zeros_pool"]
