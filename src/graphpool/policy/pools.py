"""Sizes: request rounding, small/large routing and segment sizing.

The numbers are tunables of ``SizeConfig`` so tests can shrink them and make
splitting, growth and out-of-memory happen on every run; ``DEFAULT`` holds the
figures of docs/behaviour.rst, "The caching allocator" (PyTorch's).
"""

from __future__ import annotations

from dataclasses import dataclass

KiB = 1024
MiB = 1024 * KiB


@dataclass(frozen=True)
class SizeConfig:
    """Allocator size tunables.

    ``min_block``: rounding unit and smallest block (512 B).
    ``small_size``: largest request of the small pool (1 MiB).
    ``small_segment``: segment for small requests (2 MiB).
    ``large_segment``: segment for large requests under ``min_large_alloc`` (20 MiB).
    ``min_large_alloc``: requests this big get a segment of their own (10 MiB).
    ``round_large``: such segments round up to a multiple of this (2 MiB).

    PyTorch's allocator options (``GRAPHPOOL_ALLOC_CONF``, docs/behaviour.rst "Configuration"):
    ``max_split_size``: blocks this big or bigger are never split, and only requests this big
    or bigger take them (None: no such blocks, PyTorch's default).
    ``max_non_split_rounding``: such a request takes such a block only if it wastes less than
    this (None: ``large_segment``, PyTorch's 20 MiB).
    ``roundup_power2_divisions``: requests round up to 1/N of their power-of-two range, N one of
    16 entries (1 MiB ranges upward, policy/limits.py); () rounds to ``min_block`` only.
    ``garbage_collection_threshold``: with a memory fraction set, before a new segment,
    release the least recently used free segments of the large pool while reserved memory
    passes this share of the fraction's cap (0: never, PyTorch's default).
    ``expandable_segments``: the ordinary pool grows one virtual range per stream and kind
    in place (CUDA virtual memory management) instead of allocating separate segments
    (policy/allocator.py, "Expandable segments"; off by default, as in PyTorch).
    """

    min_block: int = 512
    small_size: int = 1 * MiB
    small_segment: int = 2 * MiB
    large_segment: int = 20 * MiB
    min_large_alloc: int = 10 * MiB
    round_large: int = 2 * MiB
    max_split_size: int | None = None
    max_non_split_rounding: int | None = None
    roundup_power2_divisions: tuple[int, ...] = ()
    garbage_collection_threshold: float = 0.0
    expandable_segments: bool = False

    def __post_init__(self) -> None:
        if self.min_block <= 0 or self.min_block & (self.min_block - 1):
            raise ValueError("min_block must be a power of two")
        for name in ("small_size", "small_segment", "large_segment", "min_large_alloc", "round_large"):
            if getattr(self, name) % self.min_block:
                raise ValueError(f"{name} must be a multiple of min_block")
        if not self.small_size <= self.small_segment:
            raise ValueError("small_segment must hold the largest small request")
        if not self.min_large_alloc <= self.large_segment:
            raise ValueError("large_segment must hold every request below min_large_alloc")
        if self.max_split_size is not None and self.max_split_size < self.large_segment:
            raise ValueError("max_split_size must be at least large_segment")
        if self.max_non_split_rounding is not None and self.max_non_split_rounding < self.large_segment:
            raise ValueError("max_non_split_rounding must be at least large_segment")
        if not 0.0 <= self.garbage_collection_threshold < 1.0:
            raise ValueError("garbage_collection_threshold must be in [0, 1)")
        divs = self.roundup_power2_divisions
        if divs and (len(divs) != 16 or any(d < 0 or d & (d - 1) for d in divs)):
            raise ValueError("roundup_power2_divisions: 16 entries, each 0 or a power of two")

    def non_split_rounding(self) -> int:
        """How much bigger than a request at least ``max_split_size`` a block it takes may be."""
        r = self.max_non_split_rounding
        return self.large_segment if r is None else r

    def round_divisions(self, nbytes: int) -> int:
        """PyTorch's ``round_size`` with ``roundup_power2_divisions`` set: a request of ``nbytes``
        (>= ``min_block``) rounds up to the next 1/N step of its power-of-two range, N the
        entry of that range, when N > 1 and ``nbytes`` > N x ``min_block``; else as
        ``round_size``."""
        divs = self.roundup_power2_divisions
        n = divs[min(max(nbytes.bit_length() - 21, 0), len(divs) - 1)] if divs else 0
        if n <= 1 or nbytes <= self.min_block * n:
            return self.round_size(nbytes)
        floor = 1 << (nbytes.bit_length() - 1)
        if floor == nbytes:
            return nbytes
        step = floor >> (n.bit_length() - 1)
        return (nbytes + step - 1) & -step

    def round_size(self, nbytes: int) -> int:
        """Round a request up to a multiple of ``min_block`` (0 becomes ``min_block``): the rule
        ``CachingAllocator._malloc`` writes out (see Note [The hand-written hot path] in
        policy/allocator.py)."""
        if nbytes < self.min_block:
            return self.min_block
        return (nbytes + self.min_block - 1) & -self.min_block

    def splits(self, size: int, remaining: int, grows: bool) -> bool:
        """Whether a block handed out for a rounded ``size`` with ``remaining`` bytes over is
        split, the rest staying free: the rule ``CachingAllocator._malloc`` writes out. A small
        block splits when the rest holds a ``min_block``; a large one when the rest is more than
        ``small_size`` and the block is under ``max_split_size`` (an oversize block is never
        split); in a growing (expandable) segment whenever the rest holds a ``min_block``."""
        if size <= self.small_size or grows:
            return remaining >= self.min_block
        limit = self.max_split_size
        return remaining > self.small_size and (limit is None or size < limit)

    def is_small(self, size: int) -> bool:
        """True when a rounded size belongs to the small pool."""
        return size <= self.small_size

    def segment_size(self, size: int) -> int:
        """Bytes to ask the driver for when no cached block fits a rounded ``size``."""
        if size <= self.small_size:
            return self.small_segment
        if size < self.min_large_alloc:
            return self.large_segment
        r = self.round_large
        return (size + r - 1) // r * r

    def least_segment(self, size: int) -> int:
        """The smallest segment that holds a rounded ``size``: the fallback when the usual
        segment (``segment_size``) does not fit in what the device has left."""
        if size <= self.small_size:
            return self.small_segment
        return -(-size // self.round_large) * self.round_large


DEFAULT = SizeConfig()
