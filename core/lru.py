"""Least-recently-used caches bounded by size: an ``OrderedDict`` whose oldest entries go once the sizes of all
exceed a limit.  The build's caches of compiled engines, serialized and extracted branches use it."""

from __future__ import annotations

from collections import OrderedDict


def lru_put(cache: OrderedDict, key, value, limit: int, size=len) -> None:
    """``cache[key] = value`` as its most recent entry, then the least recent out until the ``size`` of all is
    within ``limit`` (the newest always stays).  Not thread-safe: a caller shared between threads holds its lock."""
    cache[key] = value
    cache.move_to_end(key)
    total = sum(size(v) for v in cache.values())
    while total > limit and len(cache) > 1:
        total -= size(cache.popitem(last=False)[1])
