"""Allocator statistics: ``Stat`` counters and the arrays behind ``memory_stats()``.

Each statistic keeps ``current`` (a level), ``peak`` (its highest level), and the
accumulated ``allocated`` and ``freed`` amounts, for ``all``, ``small_pool`` and
``large_pool``. Counts and byte sums use the same type; the name says which.
Levels only move through ``increase``/``decrease``, which refuse to go negative.
"""

from __future__ import annotations

STAT_NAMES = (
    "allocation",  # count of handed-out blocks
    "allocated_bytes",  # sum of their sizes
    "requested_bytes",  # sum of the sizes asked for
    "segment",  # count of driver allocations
    "reserved_bytes",  # sum of segment sizes
    "active",  # count of blocks allocated or waiting (events, graphs)
    "active_bytes",  # sum of their sizes
    "inactive_split",  # count of free blocks in split segments
    "inactive_split_bytes",  # sum of their sizes
)
POOL_NAMES = ("all", "small_pool", "large_pool")
SCALAR_NAMES = ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free")
ALL, SMALL, LARGE = 0, 1, 2


class Stat:
    """One statistic of one pool type: level, peak level, and accumulated changes."""

    __slots__ = ("current", "peak", "allocated", "freed")

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0
        self.allocated = 0
        self.freed = 0

    def increase(self, amount: int) -> None:
        """Raise the level by ``amount`` (>= 0)."""
        cur = self.current + amount
        self.current = cur
        self.allocated += amount
        if cur > self.peak:
            self.peak = cur

    def decrease(self, amount: int) -> None:
        """Lower the level by ``amount``; it may not go below zero."""
        cur = self.current - amount
        if cur < 0:
            raise AssertionError(f"statistic would go negative ({self.current} - {amount})")
        self.current = cur
        self.freed += amount


def _triple() -> tuple[Stat, Stat, Stat]:
    return (Stat(), Stat(), Stat())


class StatArrays:
    """Every statistic for one accounting scope (a device, or one private pool).

    Attributes are named as in ``STAT_NAMES``; each is indexed by ALL/SMALL/LARGE.
    """

    __slots__ = STAT_NAMES + SCALAR_NAMES

    allocation: tuple[Stat, Stat, Stat]
    allocated_bytes: tuple[Stat, Stat, Stat]
    requested_bytes: tuple[Stat, Stat, Stat]
    segment: tuple[Stat, Stat, Stat]
    reserved_bytes: tuple[Stat, Stat, Stat]
    active: tuple[Stat, Stat, Stat]
    active_bytes: tuple[Stat, Stat, Stat]
    inactive_split: tuple[Stat, Stat, Stat]
    inactive_split_bytes: tuple[Stat, Stat, Stat]
    num_alloc_retries: int
    num_ooms: int
    num_device_alloc: int
    num_device_free: int

    def __init__(self) -> None:
        for name in STAT_NAMES:
            setattr(self, name, _triple())
        for name in SCALAR_NAMES:
            setattr(self, name, 0)

    def change(self, name: str, kind: int, amount: int) -> None:
        """Add ``amount`` (may be negative) to statistic ``name`` of pool type ``kind`` and ``all``."""
        trio = getattr(self, name)
        if amount >= 0:
            trio[ALL].increase(amount)
            trio[kind].increase(amount)
        else:
            trio[ALL].decrease(-amount)
            trio[kind].decrease(-amount)

    def as_dict(self) -> dict[str, int]:
        """Flatten to ``"<stat>.<pool>.<counter>"`` keys plus the scalar counters."""
        out: dict[str, int] = {}
        for name in STAT_NAMES:
            trio = getattr(self, name)
            for pool_name, st in zip(POOL_NAMES, trio):
                prefix = f"{name}.{pool_name}."
                out[prefix + "current"] = st.current
                out[prefix + "peak"] = st.peak
                out[prefix + "allocated"] = st.allocated
                out[prefix + "freed"] = st.freed
        for name in SCALAR_NAMES:
            out[name] = getattr(self, name)
        return out

    def reset_peak(self) -> None:
        """Set every peak to its current level."""
        for name in STAT_NAMES:
            for st in getattr(self, name):
                st.peak = st.current

    def reset_accumulated(self) -> None:
        """Zero every accumulated counter and the scalar counters."""
        for name in STAT_NAMES:
            for st in getattr(self, name):
                st.allocated = 0
                st.freed = 0
        for name in SCALAR_NAMES:
            setattr(self, name, 0)
