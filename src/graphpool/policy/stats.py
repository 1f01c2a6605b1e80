"""Allocator statistics, cheap enough for the hot path, exact when read.

``memory_stats()`` reports, for ``all``, ``small_pool`` and ``large_pool``, each
statistic's ``current`` level, ``peak`` level and accumulated ``allocated``/``freed``
amounts (PyTorch's key names). Counts and byte sums are kept alike; names say which.

How it stays cheap: only the pool kind that changes is written (``all`` is the sum of
the two kinds), and peaks are kept per *epoch*. An epoch is a run of changes to one
kind while nothing else moves; in it the other kind's levels are constant, so the peak
of ``all`` is the changing kind's highest level in the epoch (``run``) plus the other
kind's level. ``fold()`` turns runs into peaks; it runs when the changing kind
switches, when a hold starts or ends, and before every read. ``active`` is derived:
blocks allocated plus blocks held back (waiting on events or kept for a graph).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # compiled, levels and peaks are native 64-bit ints (no tag checks)
    from mypy_extensions import i64

STAT_NAMES = (
    "allocation",  # count of handed-out blocks
    "allocated_bytes",  # sum of their sizes
    "requested_bytes",  # sum of the sizes asked for (allocated and held blocks)
    "segment",  # count of driver allocations
    "reserved_bytes",  # sum of segment sizes
    "active",  # count of blocks allocated or held
    "active_bytes",  # sum of their sizes
    "inactive_split",  # count of free blocks in split segments
    "inactive_split_bytes",  # sum of their sizes
)
POOL_NAMES = ("all", "small_pool", "large_pool")
SCALAR_NAMES = (
    "num_alloc_retries",
    "num_ooms",
    "num_device_alloc",
    "num_device_free",
    "num_sync_all_streams",
)
OVERSIZE_NAMES = (
    "oversize_allocations",  # count of handed-out blocks of max_split_size or more
    "oversize_segments",  # count of driver allocations of max_split_size or more (not expandable)
)
"""PyTorch's two statistics of ``max_split_size``, kept for ``all`` only (as PyTorch keeps them):
``<name>.current``, ``.peak``, ``.allocated``, ``.freed``. Without ``max_split_size`` no block
is oversize and they stay 0."""
NEVER = (1 << 62) - 1
"""``PoolStats.oversize_at`` when no ``max_split_size`` is set: no block reaches it (4 EiB).
Below 2**62 on purpose: compiled by mypyc, an int attribute up to 2**62 - 1 is a tagged
machine word, and every cached allocation and free compares a block size with it; 2**63 - 1
was a heap object, and those two comparisons cost some 570 instructions a pair."""

# Levels kept directly; "active" and "active_bytes" derive from allocation + held.
LEVELS = (
    "allocation",
    "allocated_bytes",
    "requested_bytes",
    "segment",
    "reserved_bytes",
    "inactive_split",
    "inactive_split_bytes",
    "held",
    "held_bytes",
)
_FIELDS = tuple(f"{name}_{part}" for name in LEVELS for part in ("cur", "alloc", "free", "run", "peak")) + (
    "active_peak",
    "active_bytes_peak",
)


class KindCounters:
    """Every level of one pool kind: ``<level>_cur``, ``_alloc``, ``_free``, ``_run``, ``_peak``.

    ``_run`` is the highest level since the epoch began, ``_peak`` the highest before it.
    Increases must raise ``_run`` when they pass it; decreases never touch it.
    """

    __slots__ = _FIELDS

    allocation_cur: i64
    allocation_alloc: int
    allocation_free: int
    allocation_run: i64
    allocation_peak: i64
    allocated_bytes_cur: i64
    allocated_bytes_alloc: int
    allocated_bytes_free: int
    allocated_bytes_run: i64
    allocated_bytes_peak: i64
    requested_bytes_cur: i64
    requested_bytes_alloc: int
    requested_bytes_free: int
    requested_bytes_run: i64
    requested_bytes_peak: i64
    segment_cur: i64
    segment_alloc: int
    segment_free: int
    segment_run: i64
    segment_peak: i64
    reserved_bytes_cur: i64
    reserved_bytes_alloc: int
    reserved_bytes_free: int
    reserved_bytes_run: i64
    reserved_bytes_peak: i64
    inactive_split_cur: i64
    inactive_split_alloc: int
    inactive_split_free: int
    inactive_split_run: i64
    inactive_split_peak: i64
    inactive_split_bytes_cur: i64
    inactive_split_bytes_alloc: int
    inactive_split_bytes_free: int
    inactive_split_bytes_run: i64
    inactive_split_bytes_peak: i64
    held_cur: i64
    held_alloc: int
    held_free: int
    held_run: i64
    held_peak: i64
    held_bytes_cur: i64
    held_bytes_alloc: int
    held_bytes_free: int
    held_bytes_run: i64
    held_bytes_peak: i64
    active_peak: i64
    active_bytes_peak: i64

    def __init__(self) -> None:
        for name in _FIELDS:
            setattr(self, name, 0)

    def add(self, level: str, amount: int) -> None:
        """Move ``level`` by ``amount`` (either sign); a level may not go below zero."""
        cur = getattr(self, level + "_cur") + amount
        if cur < 0:
            raise AssertionError(f"statistic {level} would go negative")
        setattr(self, level + "_cur", cur)
        if amount >= 0:
            setattr(self, level + "_alloc", getattr(self, level + "_alloc") + amount)
            if cur > getattr(self, level + "_run"):
                setattr(self, level + "_run", cur)
        else:
            setattr(self, level + "_free", getattr(self, level + "_free") - amount)


def _move_split(k: KindCounters, d_split: int, d_bytes: int) -> None:
    """Move the inactive-split count and bytes of ``k`` (either sign)."""
    c = k.inactive_split_cur + d_split
    if c < 0:
        raise AssertionError("inactive_split would go negative")
    k.inactive_split_cur = c
    if d_split > 0:
        k.inactive_split_alloc += d_split
        if c > k.inactive_split_run:
            k.inactive_split_run = c
    else:
        k.inactive_split_free -= d_split
    c = k.inactive_split_bytes_cur + d_bytes
    if c < 0:
        raise AssertionError("inactive_split_bytes would go negative")
    k.inactive_split_bytes_cur = c
    if d_bytes > 0:
        k.inactive_split_bytes_alloc += d_bytes
        if c > k.inactive_split_bytes_run:
            k.inactive_split_bytes_run = c
    else:
        k.inactive_split_bytes_free -= d_bytes


class AllPeaks:
    """The peak of each statistic of ``all`` (both kinds together), one attribute each."""

    __slots__ = STAT_NAMES

    allocation: i64
    allocated_bytes: i64
    requested_bytes: i64
    segment: i64
    reserved_bytes: i64
    active: i64
    active_bytes: i64
    inactive_split: i64
    inactive_split_bytes: i64

    def __init__(self) -> None:
        for name in STAT_NAMES:
            setattr(self, name, 0)

    def __getitem__(self, name: str) -> int:
        value: int = getattr(self, name)
        return value

    def __setitem__(self, name: str, value: int) -> None:
        setattr(self, name, value)


class PoolStats:
    """All statistics of one accounting scope (a device, or one private pool)."""

    __slots__ = ("small", "large", "epoch", "all_peak", *SCALAR_NAMES, "oversize_at", "oversize")

    def __init__(self, oversize_at: int = NEVER) -> None:
        self.small = KindCounters()
        self.large = KindCounters()
        self.epoch = self.small
        self.all_peak = AllPeaks()
        self.num_alloc_retries = 0
        self.num_ooms = 0
        self.num_device_alloc = 0
        self.num_device_free = 0
        self.num_sync_all_streams = 0  # waits for every pending stream use (PyTorch's name)
        self.oversize_at = oversize_at  # max_split_size: blocks this big or bigger are oversize
        # per OVERSIZE_NAMES entry: [current, peak, allocated, freed]
        self.oversize: dict[str, list[int]] = {name: [0, 0, 0, 0] for name in OVERSIZE_NAMES}

    def move_oversize(self, name: str, amount: int) -> None:
        """Move oversize statistic ``name`` by ``amount`` (+1 or -1). Off the hot path: only
        for blocks and segments of ``max_split_size`` or more."""
        s = self.oversize[name]
        cur = s[0] + amount
        if cur < 0:
            raise AssertionError(f"statistic {name} would go negative")
        s[0] = cur
        if amount > 0:
            s[2] += amount
            if cur > s[1]:
                s[1] = cur
        else:
            s[3] -= amount

    def kind(self, is_small: bool) -> KindCounters:
        """The counters of one kind, making it the epoch's kind first."""
        kc = self.small if is_small else self.large
        if self.epoch is not kc:
            self.fold()
            self.epoch = kc
        return kc

    def fold(self) -> None:
        """Close the epoch: turn the changing kind's runs into peaks of it and of ``all``.

        Written out level by level, with no generic attribute access: it runs whenever
        consecutive requests switch between the small and the large pool, which real
        allocation traces do all the time.
        """
        k = self.epoch
        o = self.large if k is self.small else self.small
        p = self.all_peak
        run = k.allocation_run
        if run > k.allocation_peak:
            k.allocation_peak = run
        if run + o.allocation_cur > p.allocation:
            p.allocation = run + o.allocation_cur
        run = k.allocated_bytes_run
        if run > k.allocated_bytes_peak:
            k.allocated_bytes_peak = run
        if run + o.allocated_bytes_cur > p.allocated_bytes:
            p.allocated_bytes = run + o.allocated_bytes_cur
        run = k.requested_bytes_run
        if run > k.requested_bytes_peak:
            k.requested_bytes_peak = run
        if run + o.requested_bytes_cur > p.requested_bytes:
            p.requested_bytes = run + o.requested_bytes_cur
        run = k.segment_run
        if run > k.segment_peak:
            k.segment_peak = run
        if run + o.segment_cur > p.segment:
            p.segment = run + o.segment_cur
        run = k.reserved_bytes_run
        if run > k.reserved_bytes_peak:
            k.reserved_bytes_peak = run
        if run + o.reserved_bytes_cur > p.reserved_bytes:
            p.reserved_bytes = run + o.reserved_bytes_cur
        run = k.inactive_split_run
        if run > k.inactive_split_peak:
            k.inactive_split_peak = run
        if run + o.inactive_split_cur > p.inactive_split:
            p.inactive_split = run + o.inactive_split_cur
        run = k.inactive_split_bytes_run
        if run > k.inactive_split_bytes_peak:
            k.inactive_split_bytes_peak = run
        if run + o.inactive_split_bytes_cur > p.inactive_split_bytes:
            p.inactive_split_bytes = run + o.inactive_split_bytes_cur
        mine = k.allocation_run + k.held_cur
        if mine > k.active_peak:
            k.active_peak = mine
        if mine + o.allocation_cur + o.held_cur > p.active:
            p.active = mine + o.allocation_cur + o.held_cur
        mine = k.allocated_bytes_run + k.held_bytes_cur
        if mine > k.active_bytes_peak:
            k.active_bytes_peak = mine
        if mine + o.allocated_bytes_cur + o.held_bytes_cur > p.active_bytes:
            p.active_bytes = mine + o.allocated_bytes_cur + o.held_bytes_cur
        for kc in (k, o):
            kc.allocation_run = kc.allocation_cur
            kc.allocated_bytes_run = kc.allocated_bytes_cur
            kc.requested_bytes_run = kc.requested_bytes_cur
            kc.segment_run = kc.segment_cur
            kc.reserved_bytes_run = kc.reserved_bytes_cur
            kc.inactive_split_run = kc.inactive_split_cur
            kc.inactive_split_bytes_run = kc.inactive_split_bytes_cur
            kc.held_run = kc.held_cur
            kc.held_bytes_run = kc.held_bytes_cur

    # -- the two hot-path events, one call each -------------------------------
    def on_malloc(self, is_small: bool, size: int, requested: int, d_split: int, d_bytes: int) -> None:
        """A block of ``size`` bytes was handed out; split bookkeeping moved by the deltas."""
        k = self.small if is_small else self.large
        if self.epoch is not k:
            self.fold()
            self.epoch = k
        c = k.allocation_cur + 1
        k.allocation_cur = c
        k.allocation_alloc += 1
        if c > k.allocation_run:
            k.allocation_run = c
        c = k.allocated_bytes_cur + size
        k.allocated_bytes_cur = c
        k.allocated_bytes_alloc += size
        if c > k.allocated_bytes_run:
            k.allocated_bytes_run = c
        c = k.requested_bytes_cur + requested
        k.requested_bytes_cur = c
        k.requested_bytes_alloc += requested
        if c > k.requested_bytes_run:
            k.requested_bytes_run = c
        if d_split or d_bytes:
            _move_split(k, d_split, d_bytes)
        if size >= self.oversize_at:
            self.move_oversize("oversize_allocations", 1)

    def on_release(
        self, is_small: bool, size: int, requested: int, d_split: int, d_bytes: int, freed: bool
    ) -> None:
        """A block stopped being active; split bookkeeping moved by the deltas.

        ``freed``: the user gave it back just now (else its hold ended), so the
        allocation counters move too, as ``on_free`` would.
        """
        k = self.small if is_small else self.large
        if self.epoch is not k:
            self.fold()
            self.epoch = k
        if freed:
            c = k.allocation_cur - 1
            if c < 0:
                raise AssertionError("allocation would go negative")
            k.allocation_cur = c
            k.allocation_free += 1
            k.allocated_bytes_cur -= size
            k.allocated_bytes_free += size
            if size >= self.oversize_at:
                self.move_oversize("oversize_allocations", -1)
        c = k.requested_bytes_cur - requested
        if c < 0:
            raise AssertionError("requested_bytes would go negative")
        k.requested_bytes_cur = c
        k.requested_bytes_free += requested
        if d_split or d_bytes:
            _move_split(k, d_split, d_bytes)

    def on_free(self, is_small: bool, size: int) -> None:
        """A block of ``size`` bytes was given back by its user (it may still be held)."""
        k = self.small if is_small else self.large
        if self.epoch is not k:
            self.fold()
            self.epoch = k
        c = k.allocation_cur - 1
        if c < 0:
            raise AssertionError("allocation would go negative")
        k.allocation_cur = c
        k.allocation_free += 1
        k.allocated_bytes_cur -= size
        k.allocated_bytes_free += size
        if size >= self.oversize_at:
            self.move_oversize("oversize_allocations", -1)

    def on_recycled(self, is_small: bool, size: int, requested: int, n: int) -> None:
        """A block given back whole and handed out again ``n`` times for the same request (a
        parked block, heap.py): ``n`` frees and ``n`` allocations at once. Every level ends
        where it began, so no peak moves; only the accumulated counters grow."""
        k = self.small if is_small else self.large
        k.allocation_alloc += n
        k.allocation_free += n
        k.allocated_bytes_alloc += n * size
        k.allocated_bytes_free += n * size
        k.requested_bytes_alloc += n * requested
        k.requested_bytes_free += n * requested
        if size >= self.oversize_at:
            s = self.oversize["oversize_allocations"]
            s[2] += n
            s[3] += n

    def hold(self, is_small: bool, size: int, amount: int) -> None:
        """``amount`` (+1 or -1) blocks of ``size`` start or stop being held back."""
        self.fold()
        k = self.kind(is_small)
        k.add("held", amount)
        k.add("held_bytes", amount * size)
        self.fold()

    # -- reading ----------------------------------------------------------------
    def current(self, name: str, kind: str = "all") -> int:
        """The current level of one statistic (``kind`` in POOL_NAMES)."""
        kcs = {"all": (self.small, self.large), "small_pool": (self.small,), "large_pool": (self.large,)}
        return sum(self._level(kc, name)[0] for kc in kcs[kind])

    @staticmethod
    def _level(kc: KindCounters, name: str) -> tuple[int, int, int, int]:
        """(current, peak, allocated, freed) of one statistic of one kind; epoch folded."""
        if name == "active" or name == "active_bytes":
            n, h = ("allocation", "held") if name == "active" else ("allocated_bytes", "held_bytes")
            return (
                getattr(kc, n + "_cur") + getattr(kc, h + "_cur"),
                getattr(kc, name + "_peak"),
                getattr(kc, n + "_alloc"),
                getattr(kc, n + "_free") - getattr(kc, h + "_alloc") + getattr(kc, h + "_free"),
            )
        return (
            getattr(kc, name + "_cur"),
            getattr(kc, name + "_peak"),
            getattr(kc, name + "_alloc"),
            getattr(kc, name + "_free"),
        )

    def as_dict(self) -> dict[str, int]:
        """Flatten to ``"<stat>.<pool>.<counter>"`` keys plus the scalar counters."""
        self.fold()
        out: dict[str, int] = {}
        for name in STAT_NAMES:
            s = self._level(self.small, name)
            g = self._level(self.large, name)
            a = (s[0] + g[0], self.all_peak[name], s[2] + g[2], s[3] + g[3])
            for pool_name, vals in zip(POOL_NAMES, (a, s, g), strict=True):
                prefix = f"{name}.{pool_name}."
                out[prefix + "current"] = vals[0]
                out[prefix + "peak"] = max(vals[1], vals[0])
                out[prefix + "allocated"] = vals[2]
                out[prefix + "freed"] = vals[3]
        for name in SCALAR_NAMES:
            out[name] = getattr(self, name)
        for name, o in self.oversize.items():
            out[name + ".current"], out[name + ".peak"] = o[0], o[1]
            out[name + ".allocated"], out[name + ".freed"] = o[2], o[3]
        return out

    def reset_peak(self) -> None:
        """Set every peak to its current level."""
        self.fold()
        for kc in (self.small, self.large):
            for level in LEVELS:
                setattr(kc, level + "_peak", getattr(kc, level + "_cur"))
            kc.active_peak = kc.allocation_cur + kc.held_cur
            kc.active_bytes_peak = kc.allocated_bytes_cur + kc.held_bytes_cur
        for name in STAT_NAMES:
            self.all_peak[name] = self.current(name)
        for s in self.oversize.values():
            s[1] = s[0]

    def reset_accumulated(self) -> None:
        """Zero every accumulated counter and the scalar counters."""
        for kc in (self.small, self.large):
            for level in LEVELS:
                setattr(kc, level + "_alloc", 0)
                setattr(kc, level + "_free", 0)
        for name in SCALAR_NAMES:
            setattr(self, name, 0)
        for s in self.oversize.values():
            s[2] = s[3] = 0
