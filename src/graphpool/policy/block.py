"""Blocks: address ranges of a segment, linked in address order.

A segment (one driver allocation) is a doubly linked chain of blocks that tile it
exactly: ``b.next.ptr == b.ptr + b.size`` and ``b.next.prev is b``. Blocks split when
a request takes the front of a larger free block and merge when adjacent free blocks
meet (``CachingAllocator.malloc`` and ``_free_block`` do both); blocks of different
segments never merge.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # typed, so that compiled reads of these fields are native
    from mypy_extensions import i64

    from graphpool.policy.freelist import FreeList
    from graphpool.policy.private_pools import CaptureRecord


class Block:
    """One range of device memory: allocated, free (in a free list), or waiting.

    An allocation is filed by address in the allocator's ``_active`` when ``malloc`` made it
    (a raw address); ``owned`` when ``malloc_owned`` made it: its DeviceBuffer holds the
    block itself and frees it by it, with no lookup (policy/heap.py, "Ownership").
    ``free_list`` is the free list the block returns to (it fixes small/large and which
    private pool owns the memory); ``stream`` is the stream it was allocated on and
    the only stream whose requests may reuse it. ``holds`` counts what keeps a freed
    block out of its free list: outstanding events of extra stream users, a graph that
    must keep the memory, a deferred event recording. ``allocated_in`` is the capture
    that allocated it, if any; ``serial`` tells its allocations apart for the replay checker.
    ``returns_with`` (first blocks of segments made during a capture) is that capture while
    the segment may still go back with it: cleared when the capture succeeds or another
    capture uses the segment. A segment whose capture failed may return to the driver
    although its pool lives on (failed captures leak nothing). O(1) per segment,
    whatever the number of captures.
    """

    __slots__ = (
        "ptr",
        "size",
        "requested",
        "stream",
        "free_list",
        "prev",
        "next",
        "allocated",
        "owned",
        "stream_uses",
        "holds",
        "allocated_in",
        "serial",
        "returns_with",
        "gc_base",
    )

    def __init__(self, ptr: int, size: int, stream: int, free_list: FreeList) -> None:
        self.ptr: i64 = ptr
        self.size: i64 = size
        self.requested: i64 = 0
        self.stream = stream
        self.free_list = free_list
        self.prev: Block | None = None
        self.next: Block | None = None
        self.allocated = False
        self.owned = False  # allocated for a DeviceBuffer (malloc_owned): not in ``_active``
        self.stream_uses: set[int] | None = None
        self.holds = 0
        self.allocated_in: CaptureRecord | None = None  # the capture that allocated it
        self.serial = 0
        self.returns_with: CaptureRecord | None = None  # first blocks: see the class doc
        self.gc_base = 0  # its free list's ``calls`` when it went in (garbage_collection_threshold)

    def __repr__(self) -> str:
        state = "allocated" if self.allocated else ("held" if self.holds else "free")
        return f"Block(0x{self.ptr:x}, {self.size}, stream={self.stream}, {state})"


def merges(neighbour: Block | None, stream: int) -> bool:
    """The one merge rule: a block of ``stream`` given back merges with ``neighbour`` when that
    is free, nothing holds it, and it is of the same stream (blocks are cached per stream)."""
    return (
        neighbour is not None
        and not neighbour.allocated
        and neighbour.holds == 0
        and neighbour.stream == stream
    )


def iter_segment(head: Block) -> list[Block]:
    """All blocks of the segment that starts at ``head``, in address order."""
    out = []
    b: Block | None = head
    while b is not None:
        out.append(b)
        b = b.next
    return out


class ExpandableSegment:
    """An expandable segment (``expandable_segments:True``): a reserved virtual range whose
    mapped prefix ``[base, base + mapped)`` is one segment of blocks. It grows at its end,
    granule by granule, when no free block of its stream fits, and gives whole free granules
    at its end back on ``empty_cache``. One per stream and kind (small or large) of the
    ordinary pool; private pools keep ordinary segments.
    """

    __slots__ = ("base", "reserved", "mapped", "stream", "is_small")

    def __init__(self, base: int, reserved: int, mapped: int, stream: int, is_small: bool) -> None:
        self.base = base
        self.reserved = reserved
        self.mapped = mapped
        self.stream = stream
        self.is_small = is_small

    def __repr__(self) -> str:
        return f"ExpandableSegment(0x{self.base:x}, mapped={self.mapped}, reserved={self.reserved})"
