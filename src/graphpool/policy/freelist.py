"""The best-fit index: free blocks ordered by (stream, size, address).

One ``FreeList`` per pool kind (small or large) of the ordinary pools and of each
private pool. For each stream it keeps two parallel lists sorted by (size, address):
``sizes`` and ``blocks`` (``sizes[i] == blocks[i].size``). The best fit (smallest size
that fits, lowest address on ties) is ``blocks[bisect_left(sizes, size)]``, one bisect
in C. Insertion and removal are O(log n) comparisons plus a memmove of the list tails,
which measures faster than a balanced tree at the sizes a pool reaches (CuPy made the
same trade: "not faster, but a lot simpler").

Why not one list of keys ``size << 64 | ptr``: those keys pass 63 bits, and compiled
with mypyc every one is a boxed big int. Sizes alone are
small ints; equal sizes, rare, are ordered by address with a bisect over their run.

The bisect for a size is ``bisect_sizes``: compiled by mypyc, a loop written out in native
code; in the plain-Python build, the C ``bisect_left``.

The best-fit lookup itself is written out in ``CachingAllocator._malloc`` (a call would cost
more than the bisect; Note [The hand-written hot path] in policy/allocator.py). A split
remainder or a merged block usually sorts exactly where the block it came from was filed:
``place`` and ``replace`` then overwrite that entry, so the steady cached malloc/free cycle
never resizes a list (resizing a list of one or two entries reallocates it).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # typed, so that compiled reads of ``private_pool`` are native
    from graphpool.policy.block import Block
    from graphpool.policy.private_pools import PrivatePool


class Bins:
    """The free blocks of one stream: ``sizes`` and ``blocks``, sorted by (size, address)."""

    __slots__ = ("sizes", "blocks")

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.blocks: list[Block] = []


def bisect_sizes(sizes: list[int], size: int) -> int:
    """``bisect_left(sizes, size)``: the first entry of ``sizes`` not below ``size``.

    Written out so that mypyc compiles it to native code: a direct C call with unboxed
    comparisons, no module-global lookup of ``bisect_left`` and no generic comparison per
    step (about 30 ns less per call). The plain-Python build
    rebinds the name to the C ``bisect_left`` (end of this module), faster there.
    """
    lo = 0
    hi = len(sizes)
    while lo < hi:
        mid = (lo + hi) >> 1
        if sizes[mid] < size:
            lo = mid + 1
        else:
            hi = mid
    return lo


def tie_index(blocks: list[Block], ptr: int, lo: int, hi: int) -> int:
    """Bisect ``blocks[lo:hi]`` (one size, ascending addresses) for address ``ptr``."""
    while lo < hi:
        mid = (lo + hi) >> 1
        if blocks[mid].ptr < ptr:
            lo = mid + 1
        else:
            hi = mid
    return lo


class FreeList:
    """Free blocks of one pool kind, by stream. ``private_pool`` is the private pool the list
    belongs to, None for the ordinary pool; ``eager``: the list is a MemPool's eager side
    (private_pools.py), whose blocks captures never take."""

    __slots__ = (
        "is_small",
        "private_pool",
        "eager",
        "grows",
        "idle_at",
        "bins",
        "calls",
        "_last_stream",
        "_last_bins",
        "_placed",
        "_placed_at",
    )

    def __init__(self, is_small: bool, private_pool: PrivatePool | None = None, eager: bool = False) -> None:
        self.is_small = is_small
        self.private_pool = private_pool
        self.eager = eager
        # The pool's segments grow at their end (expandable segments, the ordinary pools only):
        # the best fit then spares a segment's free last block (``past_tails``) and a large
        # block splits off any remainder (CachingAllocator.malloc). Set by the allocator.
        self.grows = False
        # Stream -> ``calls`` when that stream last answered that all its work was done
        # (CachingAllocator._take_idle): its blocks filed before then (``gc_base`` below it)
        # had their last use finished, whatever the stream does since.
        self.idle_at: dict[int, int] = {}
        self.bins: dict[int, Bins] = {}  # stream -> its free blocks
        # Searches so far (malloc counts them): a free block's age is ``calls - gc_base``,
        # PyTorch's ``gc_count`` (garbage_collection_threshold, CachingAllocator._collect).
        self.calls = 0
        # The bins ``find`` found last, and their stream (-1: none; handles are never negative).
        # A stream's bins, once made, stay in ``bins`` for the list's life, so this never goes
        # stale.
        self._last_stream = -1
        self._last_bins: Bins | None = None
        # The block ``place`` filed last and its index: a cached pair's free merges that very
        # block (the split remainder) and finds it here without a bisect. Only a
        # hint: ``replace`` checks that the entry still holds that block.
        self._placed: Block | None = None
        self._placed_at = 0

    def find(self, stream: int) -> Bins | None:
        """``bins.get(stream)``, with the last answer kept: compiled, a hit compares two unboxed
        ints, where the lookup boxes the handle (a new int object: CUDA's handles are pointers)
        and hashes it."""
        if stream == self._last_stream:
            return self._last_bins
        bins = self.bins.get(stream)
        if bins is not None:
            self._last_stream = -1  # no moment where the kept pair disagrees (interrupts)
            self._last_bins = bins
            self._last_stream = stream
        return bins

    def __iter__(self) -> Iterator[Block]:
        """A snapshot of every free block, so the caller may remove while iterating. O(n)."""
        return iter([b for bins in self.bins.values() for b in bins.blocks])

    def best_fit(self, stream: int, size: int, limit: int) -> Block | None:
        """The smallest free block of ``stream`` with at least ``size`` bytes, lowest address on
        ties, sparing a growing pool's last blocks (``past_tails``, blocks under ``limit``);
        None if none fits. O(log n). (``CachingAllocator.malloc`` writes this out.)"""
        bins = self.find(stream)
        if bins is None:
            return None
        i = bisect_sizes(bins.sizes, size)
        if i == len(bins.sizes):
            return None
        if self.grows and bins.blocks[i].next is None:
            i = past_tails(bins, i, limit)
        return bins.blocks[i]

    def insert(self, block: Block) -> None:
        """Add a free block. O(log n) + memmove."""
        block.gc_base = self.calls
        bins = self.find(block.stream)
        if bins is None:
            bins = self.bins[block.stream] = Bins()
        size = block.size
        sizes = bins.sizes
        i = bisect_sizes(sizes, size)  # first entry of this size
        if i < len(sizes) and sizes[i] == size:
            i = tie_index(bins.blocks, block.ptr, i, bisect_right(sizes, size, i))
        sizes.insert(i, size)
        bins.blocks.insert(i, block)

    def remove(self, block: Block) -> None:
        """Take a free block out of the index. O(log n) + memmove."""
        bins = self.find(block.stream)
        if bins is None:
            bins = self.bins[block.stream]  # KeyError: the block's stream has no bins
        i = _index_of(bins, block, block.size)
        del bins.sizes[i]
        del bins.blocks[i]

    def replace(self, old: Block, old_size: int, new: Block) -> None:
        """File ``new`` in place of ``old``, filed under ``old_size``. Same stream. O(log n)."""
        bins = self.find(old.stream)
        if bins is None:
            bins = self.bins[old.stream]  # KeyError: the block's stream has no bins
        i = self._placed_at
        blocks = bins.blocks
        if old is not self._placed or i >= len(blocks) or blocks[i] is not old:
            i = _index_of(bins, old, old_size)
        self.place(bins, i, new)

    def place(self, bins: Bins, i: int, new: Block | None) -> None:
        """Drop entry ``i`` of ``bins`` and file ``new`` (if any, of the same stream).

        O(1) when ``new`` sorts at ``i``, the usual case; else a removal and an insertion.
        """
        sizes = bins.sizes
        blocks = bins.blocks
        if new is not None:
            size = new.size
            ptr = new.ptr
            j = i - 1
            k = i + 1
            if (j < 0 or sizes[j] < size or (sizes[j] == size and blocks[j].ptr < ptr)) and (
                k == len(sizes) or sizes[k] > size or (sizes[k] == size and blocks[k].ptr > ptr)
            ):
                sizes[i] = size
                blocks[i] = new
                new.gc_base = self.calls
                self._placed = new
                self._placed_at = i
                return
        del sizes[i]
        del blocks[i]
        if new is not None:
            self.insert(new)


def past_tails(bins: Bins, i: int, limit: int) -> int:
    """Wilderness preservation (Korn and Vo; dlmalloc's top chunk): in a growing pool, where
    the best fit ``bins.blocks[i]`` is the free last block of a segment, the index of the next
    fitting block that is not (the smallest larger one under ``limit``, the oversize bound),
    else ``i``. A segment's free end is the one block that can grow to fit any request;
    filling the holes between live blocks first keeps it whole, so a later request too large
    for every hole maps only what the end lacks. Beside the split rule it took the ResNet
    trace's peak reserved / peak live from 1.084 to 1.034 (Note [Expandable segments and the
    wilderness rule] in policy/expandable.py).
    O(tails skipped)."""
    blocks = bins.blocks
    n = len(blocks)
    j = i + 1
    while j < n and blocks[j].next is None:
        j += 1
    return j if j < n and bins.sizes[j] < limit else i


def _index_of(bins: Bins, block: Block, size: int) -> int:
    """Where ``block``, filed under ``size``, sits in ``bins``. O(log n)."""
    sizes = bins.sizes
    blocks = bins.blocks
    i = bisect_sizes(sizes, size)  # first entry of this size
    if blocks[i] is not block:
        i = tie_index(blocks, block.ptr, i, bisect_right(sizes, size, i))
    return i


if __file__.endswith(".py"):  # plain Python (graphpool.build.compiled): the C bisect is faster
    globals()["bisect_sizes"] = bisect_left  # than an interpreted loop; compiled calls are direct
