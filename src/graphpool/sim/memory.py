"""The memory of one simulated device: real bytes behind every address.

Segments are bump-allocated at 2 MiB alignment and addresses are never reused, so a
stale pointer always lands in a freed range and is reported instead of silently
aliasing newer memory. Backing stores are ``np.zeros`` arrays, which the OS maps
lazily, so large segments cost nothing until touched. Not thread-safe: the device's
lock guards it.
"""

from __future__ import annotations

from bisect import bisect_right

import numpy as np

from graphpool.sim.cudaerr import cuda_error

SEGMENT_ALIGNMENT = 2 * 1024 * 1024
"""Every allocation starts on a 2 MiB boundary, as cudaMalloc's large allocations do."""


class SimMemory:
    """Address space ``[base, ...)`` with ``capacity`` bytes usable at once."""

    def __init__(self, base: int, capacity: int) -> None:
        self.base = base
        self.capacity = capacity
        self.used = 0
        self._next = base
        self._starts: list[int] = []  # every allocation ever made, ascending (bump order)
        self._sizes: dict[int, int] = {}  # start -> size, for every allocation ever made
        self._live: dict[int, np.ndarray] = {}  # start -> backing bytes, live ones only

    def allocate(self, nbytes: int) -> int | None:
        """A fresh address for ``nbytes``; ``None`` when ``used + nbytes`` exceeds the capacity."""
        if self.used + nbytes > self.capacity:
            return None
        ptr = self._next
        self._next += -(-nbytes // SEGMENT_ALIGNMENT) * SEGMENT_ALIGNMENT
        self._starts.append(ptr)
        self._sizes[ptr] = nbytes
        self._live[ptr] = np.zeros(nbytes, dtype=np.uint8)
        self.used += nbytes
        return ptr

    def release(self, ptr: int) -> bool:
        """Free the allocation starting at ``ptr``; False when no live allocation starts there."""
        if self._live.pop(ptr, None) is None:
            return False
        self.used -= self._sizes[ptr]
        return True

    def is_live(self, ptr: int) -> bool:
        """Whether a live allocation starts exactly at ``ptr``."""
        return ptr in self._live

    def allocations(self) -> list[tuple[int, int]]:
        """(start, size) of every live allocation, by address."""
        return [(p, self._sizes[p]) for p in sorted(self._live)]

    def view(self, ptr: int, nbytes: int, call: str = "kernel") -> np.ndarray:
        """A writable uint8 view of ``[ptr, ptr + nbytes)``, which must lie in one live allocation.

        O(log n) in the number of allocations ever made. Raises CUDAError
        cudaErrorIllegalAddress otherwise, as a kernel touching that range would fault.
        """
        if nbytes < 0:
            raise cuda_error(call, "cudaErrorInvalidValue", f"negative size {nbytes}")
        i = bisect_right(self._starts, ptr) - 1
        if i < 0:
            raise cuda_error(call, "cudaErrorIllegalAddress", f"{ptr:#x} is not device memory")
        start = self._starts[i]
        size = self._sizes[start]
        if ptr + nbytes > start + size or (nbytes == 0 and ptr >= start + size):
            raise cuda_error(
                call,
                "cudaErrorIllegalAddress",
                f"[{ptr:#x}, +{nbytes}) runs past the allocation [{start:#x}, +{size})",
            )
        store = self._live.get(start)
        if store is None:
            raise cuda_error(
                call,
                "cudaErrorIllegalAddress",
                f"[{ptr:#x}, +{nbytes}) lies in freed memory [{start:#x}, +{size})",
            )
        off = ptr - start
        return store[off : off + nbytes]
