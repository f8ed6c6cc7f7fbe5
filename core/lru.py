"""Least-recently-used caches bounded by size: an ``OrderedDict`` whose oldest entries go once the sizes of all
exceed a limit.  The build's caches of compiled engines, serialized and extracted branches use it."""

from __future__ import annotations

from collections import OrderedDict


class SizedLRU(OrderedDict):
    """An ``OrderedDict`` that keeps the total ``size`` of its values (``total``) as entries are set, deleted,
    popped or cleared, so that ``lru_put`` need not add up every entry's size at each put: with a plain
    ``OrderedDict`` that was 0.8 million size calls in NASNet-A Large's measured search (~1,800 puts into caches
    of up to ~900 entries), 2 s of 38 on a 2-core machine (bench/search_prepare.py, profiled)."""

    def __init__(self, size=len):
        super().__init__()
        self.size = size
        self.total = 0

    def __setitem__(self, key, value):
        if key in self:
            self.total -= self.size(OrderedDict.__getitem__(self, key))
        OrderedDict.__setitem__(self, key, value)
        self.total += self.size(value)

    def __delitem__(self, key):
        self.total -= self.size(OrderedDict.__getitem__(self, key))
        OrderedDict.__delitem__(self, key)

    # (OrderedDict's own pop and popitem do not go through __delitem__)
    def pop(self, key, *default):
        if key in self:
            self.total -= self.size(OrderedDict.__getitem__(self, key))
        return OrderedDict.pop(self, key, *default)

    def popitem(self, last: bool = True):
        key, value = OrderedDict.popitem(self, last)
        self.total -= self.size(value)
        return key, value

    def clear(self) -> None:
        OrderedDict.clear(self)
        self.total = 0


def lru_put(cache: SizedLRU, key, value, limit: int) -> None:
    """``cache[key] = value`` as its most recent entry, then the least recent out until the sizes of all
    (``cache.total``) are within ``limit`` (the newest always stays).  Not thread-safe: a caller shared between
    threads holds its lock."""
    cache[key] = value
    cache.move_to_end(key)
    while cache.total > limit and len(cache) > 1:
        cache.popitem(last=False)
