"""The build's size-bounded LRU caches (``core.lru``): a ``SizedLRU`` evicts as a plain ``OrderedDict`` does
under ``lru_put``, and keeps its total right through every way an entry comes or goes."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

from parastream.core.lru import SizedLRU, lru_put


def _plain_put(cache: OrderedDict, key, value, limit: int, size) -> None:
    """The eviction ``lru_put`` made before ``SizedLRU``: every entry's size added up at each put."""
    cache[key] = value
    cache.move_to_end(key)
    total = sum(size(v) for v in cache.values())
    while total > limit and len(cache) > 1:
        total -= size(cache.popitem(last=False)[1])


def test_a_sized_lru_evicts_as_a_plain_ordered_dict_does():
    rng = np.random.default_rng(0)
    plain, sized = OrderedDict(), SizedLRU(size=lambda v: len(v[1]))
    for i in range(400):
        key = int(rng.integers(0, 60))
        value = (key, b"x" * int(rng.integers(1, 50)))
        if i % 7 == 0 and key in plain:  # a hit moves it to the end, as the callers do
            plain.move_to_end(key)
            sized.move_to_end(key)
        _plain_put(plain, key, value, 500, size=lambda v: len(v[1]))
        lru_put(sized, key, value, 500)
        assert list(plain.items()) == list(sized.items())
        assert sized.total == sum(len(v[1]) for v in sized.values())
        assert sized.total <= 500 or len(sized) == 1


def test_the_total_follows_every_change():
    c = SizedLRU()
    c["a"], c["b"], c["c"] = b"12", b"345", b"6"
    assert c.total == 6
    c["a"] = b"1234"  # replaced: its old size out
    assert c.total == 8
    del c["b"]
    assert c.total == 5
    assert c.pop("c") == b"6" and c.total == 4
    assert c.pop("missing", None) is None and c.total == 4
    with pytest.raises(KeyError):
        c.pop("missing")
    c.update(d=b"99", e=b"1")
    c.setdefault("f", b"777")
    assert c.total == 10
    assert c.popitem(last=False) == ("a", b"1234") and c.total == 6
    c.clear()
    assert c.total == 0 and not c


def test_the_newest_entry_stays_whatever_its_size():
    c = SizedLRU()
    lru_put(c, "small", b"1", 4)
    lru_put(c, "big", b"123456789", 4)
    assert list(c) == ["big"] and c.total == 9
