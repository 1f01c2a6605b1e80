"""The best-fit index alone: order by (stream, size, address) under every kind of edit."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from graphpool.policy.block import Block
from graphpool.policy.freelist import FreeList


def _order_holds(fl: FreeList, expected: dict[int, set[tuple[int, int]]]) -> None:
    """Each stream's bins list exactly the expected (size, ptr) pairs, sorted, sizes in step."""
    # every stream with blocks has bins; a stream's bins may stay behind empty
    nonempty = {s for s, bins in fl.bins.items() if bins.blocks}
    assert nonempty == {s for s, pairs in expected.items() if pairs}
    for stream, bins in fl.bins.items():
        assert bins.sizes == [b.size for b in bins.blocks]
        assert all(b.stream == stream for b in bins.blocks)
        got = [(b.size, b.ptr) for b in bins.blocks]
        assert got == sorted(expected.get(stream, set()))


def test_place_overwrites_the_entry_when_the_new_block_sorts_there() -> None:
    fl = FreeList(True)
    a, b, c = Block(0x1000, 512, 0, fl), Block(0x9000, 4096, 0, fl), Block(0x20000, 65536, 0, fl)
    for x in (a, b, c):
        fl.insert(x)
    bins = fl.bins[0]
    sizes, blocks = bins.sizes, bins.blocks
    rest = Block(0x9200, 3584, 0, fl)  # b's remainder after a 512 B split: still between a and c
    fl.place(bins, 1, rest)
    assert bins.sizes is sizes and bins.blocks is blocks
    assert blocks == [a, rest, c] and sizes == [512, 3584, 65536]


def test_place_moves_the_block_when_order_demands() -> None:
    fl = FreeList(True)
    a, b, c = Block(0x1000, 1024, 0, fl), Block(0x9000, 4096, 0, fl), Block(0x20000, 65536, 0, fl)
    for x in (a, b, c):
        fl.insert(x)
    rest = Block(0x9C00, 1024, 0, fl)  # same size as a, higher address: sorts after a
    fl.place(fl.bins[0], 1, rest)
    assert fl.bins[0].blocks == [a, rest, c]
    small = Block(0x9E00, 512, 0, fl)  # smaller than a: must move in front of it
    fl.place(fl.bins[0], 1, small)
    assert fl.bins[0].blocks == [small, a, c]


def test_replace_finds_the_old_entry_among_equal_sizes() -> None:
    fl = FreeList(False)
    blocks = [Block(0x100000 * k, 2 << 20, 0, fl) for k in range(1, 6)]
    for x in reversed(blocks):
        fl.insert(x)
    merged = blocks[2]
    old_size = merged.size
    merged.size = 6 << 20  # it absorbed a neighbour: now the largest
    fl.replace(merged, old_size, merged)
    assert fl.bins[0].blocks == [blocks[0], blocks[1], blocks[3], blocks[4], merged]
    assert fl.bins[0].sizes == [2 << 20] * 4 + [6 << 20]


_sizes = st.sampled_from([512, 1024, 1536, 4096, 8192])
_ops = st.lists(
    st.tuples(st.sampled_from(["insert", "remove", "replace", "place"]), _sizes, st.integers(0, 2)),
    max_size=80,
)


@given(_ops)
def test_every_edit_keeps_the_order(ops: list[tuple[str, int, int]]) -> None:
    fl = FreeList(True)
    expected: dict[int, set[tuple[int, int]]] = {}
    live: dict[int, list[Block]] = {}
    next_ptr = 0x1000
    for op, size, stream in ops:
        mine = live.setdefault(stream, [])
        new = Block(next_ptr, size, stream, fl)
        next_ptr += 0x10000
        if op == "insert" or not mine:
            fl.insert(new)
            mine.append(new)
            expected.setdefault(stream, set()).add((size, new.ptr))
        else:
            old = mine.pop(size % len(mine))
            expected[stream].discard((old.size, old.ptr))
            if op == "remove":
                fl.remove(old)
                _order_holds(fl, expected)
                continue
            if op == "replace":
                fl.replace(old, old.size, new)
            else:
                bins = fl.bins[stream]
                fl.place(bins, bins.blocks.index(old), new)
            mine.append(new)
            expected[stream].add((size, new.ptr))
        _order_holds(fl, expected)


def test_a_growing_pools_best_fit_spares_a_segments_free_end_for_a_hole_under_the_limit() -> None:
    """``past_tails``: a free last block is passed over for the next fitting hole (a block with
    a neighbour after it) only when that hole is under ``limit`` (the oversize bound)."""
    fl = FreeList(False)
    fl.grows = True
    end = Block(0x1000, 4096, 0, fl)  # a segment's free last block (no next)
    hole = Block(0x10000, 8192, 0, fl)
    hole.next = Block(0x12000, 512, 0, fl)  # a live neighbour after it
    for x in (end, hole):
        fl.insert(x)
    assert fl.best_fit(0, 4096, 16384) is hole
    assert fl.best_fit(0, 4096, 8192) is end  # the hole is not under the limit
    fl.grows = False
    assert fl.best_fit(0, 4096, 16384) is end
