"""Bounded per-call caches: what the runtime learns from one call and reuses for the next with the
same metadata (launch plans, validated inputs, library choices, tile decisions) is kept in a
``Bounded`` mapping, which drops its oldest entry beyond ``LIMIT``, so that calls of ever new
shapes cost at most a bounded amount of host memory (scripts/soak.py measures it)."""

from __future__ import annotations

LIMIT = 128  # entries per cache (about 5 KB an entry over every cache of an op: <= 1 MB per op)


class Bounded(dict):
    """A dict of at most ``limit`` entries: setting a new key beyond it drops the oldest entry
    (insertion order). ``add`` makes it usable as a set. Safe against a concurrent eviction by
    another thread (an entry is then dropped twice or not at all: a cache may miss, never err)."""

    def __init__(self, limit: int = LIMIT) -> None:
        super().__init__()
        self.limit = limit

    def __setitem__(self, key, value) -> None:
        if len(self) >= self.limit and key not in self:
            try:
                self.pop(next(iter(self)), None)
            except (StopIteration, RuntimeError):  # emptied or changed by another thread meanwhile
                pass
        super().__setitem__(key, value)

    def add(self, key) -> None:
        self[key] = True
