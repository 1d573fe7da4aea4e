#!/usr/bin/env python3
# The reference of docs/benchmarks.md "Prefix lookup": bytes per cached block of a prefix-cache
# map of the shape vLLM v1 keeps, measured with tracemalloc (not vLLM itself, which needs a GPU
# and PyPI). Run: /usr/bin/python3 tests/bench/vllm_shape_bytes.py
# Bytes per cached block of a CPython structure shaped like vLLM v1's prefix-cache map
# (vllm/v1/core/kv_cache_utils.py: BlockHashType(hash_value, token_ids, extra_keys) keys of
# block_pool.cached_block_hash_to_block: dict[BlockHashType, dict[int, KVCacheBlock]]), with the
# KVCacheBlock objects themselves left out (they exist for every GPU block, cached or not).
import random, tracemalloc
from typing import NamedTuple, Optional, Tuple, Any
class BlockHashType(NamedTuple):
    hash_value: int
    token_ids: Tuple[int, ...]
    extra_keys: Optional[Any] = None
N = 200_000
blocks = [object() for _ in range(N)]  # stand-ins for the KVCacheBlock objects (not counted)
rng = random.Random(1)
tracemalloc.start()
before = tracemalloc.get_traced_memory()[0]
cached = {}
for i in range(N):
    key = BlockHashType(rng.getrandbits(63), tuple(rng.randrange(128000) for _ in range(16)))
    cached[key] = {i: blocks[i]}
after = tracemalloc.get_traced_memory()[0]
print(f"{(after - before) / N:.0f} bytes per block ({N} blocks of 16 tokens)")
