"""The best-fit index: free blocks ordered by (stream, size, address).

One ``FreeList`` per pool kind (small or large) of the ordinary pools and of each
private pool. For each stream it keeps a plain sorted list of integer keys
``size << 64 | ptr``, so the best fit (smallest size that fits, lowest address on
ties) is one ``bisect`` in C. Insertion and removal are O(log n) comparisons plus a
memmove of the list tail, which measures faster than a balanced tree at the sizes a
pool reaches (CuPy made the same trade: "not faster, but a lot simpler").
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    from graphpool.policy.block import Block

KEY_SHIFT = 64
PTR_MASK = (1 << KEY_SHIFT) - 1


class FreeList:
    """Free blocks of one pool kind, by stream. ``owner`` is the private pool or None."""

    __slots__ = ("is_small", "owner", "keys", "blocks")

    def __init__(self, is_small: bool, owner: Any = None) -> None:
        self.is_small = is_small
        self.owner = owner
        self.keys: dict[int, list[int]] = {}
        self.blocks: dict[int, Block] = {}

    def __len__(self) -> int:
        return len(self.blocks)

    def __iter__(self) -> Iterator[Block]:
        return iter(list(self.blocks.values()))

    def insert(self, block: Block) -> None:
        """Add a free block. O(log n) + memmove."""
        key = block.size << KEY_SHIFT | block.ptr
        self.blocks[key] = block
        keys = self.keys.get(block.stream)
        if keys is None:
            self.keys[block.stream] = [key]
        else:
            insort(keys, key)

    def remove(self, block: Block) -> None:
        """Take a free block out of the index. O(log n) + memmove."""
        key = block.size << KEY_SHIFT | block.ptr
        del self.blocks[key]
        keys = self.keys[block.stream]
        del keys[bisect_left(keys, key)]

    def take_best_fit(self, size: int, stream: int) -> Block | None:
        """Remove and return the smallest free block of ``stream`` with at least ``size`` bytes."""
        keys = self.keys.get(stream)
        if not keys:
            return None
        i = bisect_left(keys, size << KEY_SHIFT)
        if i == len(keys):
            return None
        key = keys.pop(i)
        return self.blocks.pop(key)

    def contains(self, block: Block) -> bool:
        """True when ``block`` is indexed under its current size and address."""
        return self.blocks.get(block.size << KEY_SHIFT | block.ptr) is block
