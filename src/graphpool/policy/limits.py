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

CONF_KEYS = (
    "memory_limit",
    "per_process_memory_fraction",
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "roundup_power2_divisions",
    "garbage_collection_threshold",
    "expandable_segments",
    "release_other_caches",
)
"""The keys ``GRAPHPOOL_ALLOC_CONF`` knows (all but ``memory_limit`` and ``release_other_caches``
are PyTorch's)."""

MiB = 1024 * 1024
MIN_SPLIT_MB = 20
"""Smallest ``max_split_size_mb`` and ``max_non_split_rounding_mb``: PyTorch's large segment
(``kLargeBuffer``, 20 MiB), as PyTorch checks."""
DIVISION_INTERVALS = 16
"""``roundup_power2_divisions`` holds one entry per power-of-two size range from 1 MiB up
(the last one open-ended), as PyTorch's ``kRoundUpPowerOfTwoIntervals``."""


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
    """What ``GRAPHPOOL_ALLOC_CONF`` sets (None: not set). Sizes in bytes; ``roundup_power2_divisions``
    as its 16 per-range entries (``DIVISION_INTERVALS``)."""

    memory_limit: int | None = None
    per_process_memory_fraction: float | None = None
    max_split_size: int | None = None
    max_non_split_rounding: int | None = None
    roundup_power2_divisions: tuple[int, ...] | None = None
    garbage_collection_threshold: float | None = None
    expandable_segments: bool | None = None
    release_other_caches: bool | None = None  # graphpool.cooperate (not a SizeConfig field)

    def policy(self) -> dict[str, Any]:
        """The ``SizeConfig`` fields this configuration sets (policy/pools.py)."""
        out: dict[str, Any] = {}
        for name in (
            "max_split_size",
            "max_non_split_rounding",
            "roundup_power2_divisions",
            "garbage_collection_threshold",
            "expandable_segments",
        ):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out


def _split_top(text: str) -> list[str]:
    """``text`` cut at the commas outside brackets (the list form of ``roundup_power2_divisions``)."""
    parts: list[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _natural(key: str, value: str) -> int:
    value = value.strip()
    if not value.isdigit():
        raise ValueError(f"{key}:{value} is not a whole number")
    return int(value)


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def parse_divisions(value: str) -> tuple[int, ...]:
    """PyTorch's ``roundup_power2_divisions`` value as its 16 per-range entries: ``N`` (every
    range), or ``[256:1,512:2,>:8]`` (the first entry also covers every smaller range; ``>``
    every range after the last named one). Range keys are sizes in MiB, each a power of two
    naming the range that starts there; divisions are powers of two (0 or 1: no rounding)."""
    key = "roundup_power2_divisions"
    value = value.strip()
    table = [0] * DIVISION_INTERVALS
    if not value.startswith("["):
        n = _natural(key, value)
        if not _power_of_two(n):
            raise ValueError(f"{key}:{n}: the divisions must be a power of two")
        return (n,) * DIVISION_INTERVALS
    if not value.endswith("]") or not value[1:-1].strip():
        raise ValueError(f"{key}:{value}: expected a list such as [256:1,512:2,>:8]")
    first = True
    last = 0
    for item in value[1:-1].split(","):
        bound, sep, count = item.partition(":")
        bound = bound.strip()
        if not sep:
            raise ValueError(f"{key}: {item.strip()!r} is not size_mb:divisions")
        n = _natural(key, count)
        if n and not _power_of_two(n):
            raise ValueError(f"{key}: {item.strip()!r}: the divisions must be a power of two or 0")
        if bound == ">":
            table[last + 1 :] = [n] * (DIVISION_INTERVALS - last - 1)
            continue
        mb = _natural(key, bound)
        if not _power_of_two(mb):
            raise ValueError(f"{key}: {item.strip()!r}: the size (MiB) must be a power of two")
        index = min(mb.bit_length() - 1, DIVISION_INTERVALS - 1)
        if first:
            table[:index] = [n] * index
            first = False
        table[index] = n
        last = index
    return tuple(table)


def parse_alloc_conf(text: str) -> AllocConf:
    """Parse ``key:value`` pairs separated by commas (PyTorch's ``PYTORCH_CUDA_ALLOC_CONF`` form),
    e.g. ``memory_limit:8GiB,max_split_size_mb:512``; a later pair overrides an earlier one.
    Raises ValueError naming the bad part and the known keys."""
    conf: dict[str, Any] = {}
    for part in _split_top(text):
        if not part.strip():
            continue
        key, sep, value = part.partition(":")
        key = key.strip()
        if not sep or key not in CONF_KEYS:
            raise ValueError(f"{part.strip()!r}: expected key:value with a key among {', '.join(CONF_KEYS)}")
        if key == "memory_limit":
            conf[key] = parse_size(value)
        elif key in ("per_process_memory_fraction", "garbage_collection_threshold"):
            try:
                number = float(value)
            except ValueError:
                raise ValueError(f"{key}:{value.strip()} is not a number") from None
            if key == "per_process_memory_fraction":
                conf[key] = check_fraction(number)
            elif not 0.0 < number < 1.0:
                raise ValueError(f"{key}:{value.strip()}: set it in (0.0, 1.0), as PyTorch")
            else:
                conf[key] = number
        elif key in ("max_split_size_mb", "max_non_split_rounding_mb"):
            mb = _natural(key, value)
            if mb < MIN_SPLIT_MB:
                raise ValueError(f"{key}:{mb} is too small: it must be >= {MIN_SPLIT_MB}, as PyTorch's")
            conf[key.removesuffix("_mb")] = mb * MiB
        elif key == "roundup_power2_divisions":
            conf[key] = parse_divisions(value)
        else:  # expandable_segments, release_other_caches
            flag = value.strip()
            if flag not in ("True", "true", "False", "false"):
                raise ValueError(f"{key}:{flag}: use True or False")
            conf[key] = flag in ("True", "true")
    return AllocConf(**conf)


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
