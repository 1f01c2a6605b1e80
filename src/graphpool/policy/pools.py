"""Sizes: request rounding, small/large routing, segment sizing and the split rule.

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
    """

    min_block: int = 512
    small_size: int = 1 * MiB
    small_segment: int = 2 * MiB
    large_segment: int = 20 * MiB
    min_large_alloc: int = 10 * MiB
    round_large: int = 2 * MiB

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

    def round_size(self, nbytes: int) -> int:
        """Round a request up to a multiple of ``min_block`` (0 becomes ``min_block``)."""
        if nbytes < self.min_block:
            return self.min_block
        return (nbytes + self.min_block - 1) & -self.min_block

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

    def should_split(self, is_small: bool, remaining: int) -> bool:
        """Whether the rest of a block after a request stays free on its own."""
        if is_small:
            return remaining >= self.min_block
        return remaining > self.small_size


DEFAULT = SizeConfig()
