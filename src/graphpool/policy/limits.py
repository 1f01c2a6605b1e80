"""Caps on a device's reserved memory, and the ``GRAPHPOOL_ALLOC_CONF`` syntax that sets them.

Two caps, as PyTorch and RMM users expect: a fraction of the device's total memory
(PyTorch's ``set_per_process_memory_fraction``) and a byte count. The allocator checks
them before every driver allocation (``CachingAllocator._device_malloc``): a segment
that would take reserved memory past either cap is refused as the driver refuses one
when the device is full, so the usual retry (release the cache, try again) and the
out-of-memory error follow. Plain Python, no device: validation and arithmetic only.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any, NamedTuple

UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
"""Size suffixes of ``parse_size`` (case-insensitive): decimal kB..TB, binary KiB..TiB."""

_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")

CONF_KEYS = ("memory_limit", "per_process_memory_fraction")
"""The keys ``GRAPHPOOL_ALLOC_CONF`` knows."""


def check_fraction(fraction: Any) -> float:
    """``fraction`` as a float in [0, 1]; TypeError for a non-number, ValueError out of range."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
        raise TypeError(f"the memory fraction must be a float in [0, 1], not {type(fraction).__name__}")
    value = float(fraction)
    if math.isnan(value) or not 0.0 <= value <= 1.0:
        raise ValueError(
            f"the memory fraction must be in [0, 1] (of the device's total memory), not {fraction}"
        )
    return value


def check_limit_bytes(nbytes: Any) -> int | None:
    """``nbytes`` as an int >= 0, or None (no limit); TypeError for a non-int, ValueError below 0."""
    if nbytes is None:
        return None
    if isinstance(nbytes, bool) or not hasattr(nbytes, "__index__"):
        raise TypeError(
            f"the memory limit must be an int number of bytes or None, not {type(nbytes).__name__}"
        )
    value = int(nbytes.__index__())
    if value < 0:
        raise ValueError(f"the memory limit must be >= 0 bytes, not {value}")
    return value


def parse_size(text: str) -> int:
    """A byte count written as ``8589934592``, ``8GiB``, ``512 MiB`` or ``1.5GB``."""
    m = _SIZE.fullmatch(text)
    unit = UNITS.get(m.group(2).lower()) if m is not None else None
    if m is None or unit is None:
        raise ValueError(
            f"{text!r} is not a size: write a number of bytes, optionally with a unit "
            "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 8GiB"
        )
    number = m.group(1)
    if "." in number:
        return int(float(number) * unit)
    return int(number) * unit


class AllocConf(NamedTuple):
    """What ``GRAPHPOOL_ALLOC_CONF`` sets (None: not set)."""

    memory_limit: int | None = None
    per_process_memory_fraction: float | None = None


def parse_alloc_conf(text: str) -> AllocConf:
    """Parse ``key:value`` pairs separated by commas (PyTorch's ``PYTORCH_CUDA_ALLOC_CONF`` form),
    e.g. ``memory_limit:8GiB,per_process_memory_fraction:0.5``. Raises ValueError naming
    the bad part and the known keys."""
    limit: int | None = None
    fraction: float | None = None
    for part in text.split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition(":")
        key = key.strip()
        if not sep or key not in CONF_KEYS:
            raise ValueError(f"{part.strip()!r}: expected key:value with a key among {', '.join(CONF_KEYS)}")
        if key == "memory_limit":
            limit = parse_size(value)
        else:
            try:
                number = float(value)
            except ValueError:
                raise ValueError(f"per_process_memory_fraction:{value.strip()} is not a number") from None
            fraction = check_fraction(number)
    return AllocConf(limit, fraction)


class MemoryLimits:
    """The caps of one device (immutable: the allocator swaps the whole object).

    ``cap`` is the binding one in bytes (the smaller of the two), None when neither is set.
    """

    __slots__ = ("total", "fraction", "nbytes", "cap")

    def __init__(self, total: int, fraction: float | None = None, nbytes: int | None = None) -> None:
        self.total = total
        self.fraction = fraction
        self.nbytes = nbytes
        caps = [c for c in (self.fraction_bytes(), nbytes) if c is not None]
        self.cap: int | None = min(caps) if caps else None

    def fraction_bytes(self) -> int | None:
        """The fraction's cap in bytes (``int(fraction * total)``, as PyTorch), None if unset."""
        return None if self.fraction is None else int(self.fraction * self.total)

    def with_fraction(self, fraction: float | None) -> MemoryLimits:
        """A copy with the fraction cap changed (None: no fraction cap)."""
        return MemoryLimits(self.total, fraction, self.nbytes)

    def with_bytes(self, nbytes: int | None) -> MemoryLimits:
        """A copy with the byte cap changed (None: no byte cap)."""
        return MemoryLimits(self.total, self.fraction, nbytes)

    def refusal(self, reserved: int, nbytes: int, fmt: Callable[[int], str]) -> str | None:
        """Which cap a new segment of ``nbytes`` on top of ``reserved`` would pass, in words
        (``fmt`` writes a byte count); None when it passes none."""
        out = []
        frac = self.fraction_bytes()
        if frac is not None and reserved + nbytes > frac:
            out.append(
                f"the per-process memory fraction {self.fraction:g} of the device's "
                f"{fmt(self.total)} (= {fmt(frac)}; set_per_process_memory_fraction)"
            )
        if self.nbytes is not None and reserved + nbytes > self.nbytes:
            out.append(f"the memory limit of {fmt(self.nbytes)} ({self.nbytes} bytes; set_memory_limit)")
        return " and ".join(out) if out else None

    def __repr__(self) -> str:
        return f"MemoryLimits(total={self.total}, fraction={self.fraction}, nbytes={self.nbytes})"
