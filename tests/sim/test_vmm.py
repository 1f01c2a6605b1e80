"""The simulator's virtual memory: reservations, granule mapping, and kernels' view of them."""

from __future__ import annotations

import mmap
import os

import pytest

from graphpool.errors import CUDAError
from graphpool.sim.memory import GRANULARITY as G
from graphpool.sim.memory import SimMemory


@pytest.fixture(params=["mmap", "array"])
def mem(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> SimMemory:
    """Both stores: the anonymous memory map, and the grown array where mmap is refused."""
    if request.param == "array":

        def refuse(*args: object, **kwargs: object) -> mmap.mmap:
            raise OSError("no anonymous maps here")

        monkeypatch.setattr(mmap, "mmap", refuse)
    return SimMemory(0x1000_0000_0000, 8 * G)


def test_map_view_unmap_release(mem: SimMemory) -> None:
    va = mem.reserve(16 * G)  # more than the capacity: address space costs nothing
    assert mem.map(va, 2 * G) and mem.used == 2 * G
    assert mem.map(va + 2 * G, G)  # contiguous with the first: one view spans both
    v = mem.view(va + 2 * G - 4, 8)
    v[:] = 7
    assert bytes(mem.view(va + 2 * G - 4, 8)) == b"\x07" * 8
    with pytest.raises(CUDAError, match="unmapped memory"):
        mem.view(va + 3 * G - 4, 8)  # runs into the unmapped rest
    assert not mem.map(va + 4 * G, 6 * G)  # past the capacity: refused, nothing mapped
    assert mem.used == 3 * G
    mem.unmap(va + G, 2 * G)
    with pytest.raises(CUDAError, match="unmapped memory"):
        mem.view(va + G, 1)
    assert mem.reservations() == [(va, 16 * G, G)]
    with pytest.raises(CUDAError, match="still has mapped memory"):
        mem.release_reservation(va, 16 * G)
    mem.unmap(va, G)
    mem.release_reservation(va, 16 * G)
    assert mem.used == 0 and mem.reservations() == []
    with pytest.raises(CUDAError, match="freed memory"):
        mem.view(va, 1)


def test_misuse_is_refused(mem: SimMemory) -> None:
    with pytest.raises(CUDAError, match="size"):
        mem.reserve(G + 1)
    va = mem.reserve(4 * G)
    with pytest.raises(CUDAError, match="not granule-aligned"):
        mem.map(va + 512, G)
    with pytest.raises(CUDAError, match="in no reservation"):
        mem.map(va + 4 * G, G)
    assert mem.map(va, G)
    with pytest.raises(CUDAError, match="already mapped"):
        mem.map(va, G)
    with pytest.raises(CUDAError, match="is not mapped"):
        mem.unmap(va + G, G)
    with pytest.raises(CUDAError, match="no reservation of"):
        mem.release_reservation(va, 8 * G)
    mem.unmap(va, G)
    mem.release_reservation(va, 4 * G)


def test_a_granule_mapped_again_reads_zeros_with_the_memory_map(mem: SimMemory) -> None:
    """The memory map gives an unmapped granule's pages back (madvise): mapped again it reads
    zeros; the fallback array keeps the old bytes (CUDA allows either for new memory)."""
    va = mem.reserve(2 * G)
    assert mem.map(va, G)
    mem.view(va, 8)[:] = 0xAB
    mem.unmap(va, G)
    assert mem.map(va, G)
    fresh = bytes(mem.view(va, 8))
    uses_map = isinstance(mmap.mmap, type)  # the fixture's "array" case replaced it
    assert fresh == (b"\x00" * 8 if uses_map else b"\xab" * 8)
    mem.view(va + G - 1, 1)[:] = 1  # the last byte of the mapped granule, and no further
    with pytest.raises(CUDAError, match="unmapped memory"):
        mem.view(va + G - 1, 2)
    mem.unmap(va, G)
    mem.release_reservation(va, 2 * G)
    with pytest.raises(CUDAError, match="size 0"):
        mem.reserve(0)


def test_an_exported_allocation_attached_by_another_memory_reads_the_same_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``attach`` (what ipc_open does in the importing process), in this process on a second
    SimMemory: the exporter's shared file mapped at a fresh, aligned address; two attaches
    lie apart; a missing file is cudaErrorMapBufferObjectFailed; ``detach`` unmaps."""
    from graphpool.sim import memory as simmem

    exporter = SimMemory(0x1000_0000_0000, 8 * G)
    importer = SimMemory(0x2000_0000_0000, 8 * G)
    ptr = exporter.allocate(3000)
    assert ptr is not None
    exporter.view(ptr, 3000)[:] = 9
    path, size = exporter.export(ptr)
    assert size == 3000 and simmem.shared_file_pid(path.rsplit("/", 1)[-1]) == os.getpid()
    first, second = importer.attach(path), importer.attach(path)
    assert second >= first + simmem.SEGMENT_ALIGNMENT and first % simmem.SEGMENT_ALIGNMENT == 0
    assert bytes(importer.view(first, 3000)) == b"\x09" * 3000
    importer.detach(first)
    importer.detach(second)
    with pytest.raises(CUDAError) as info:
        importer.attach(path + "-gone")
    assert (info.value.call, info.value.name) == ("cudaIpcOpenMemHandle", "cudaErrorMapBufferObjectFailed")
    assert simmem._pid_alive(os.getpid()) and not simmem._pid_alive(2**22 + 12345)
    exporter.release(ptr)
    mine = simmem._shared_paths
    monkeypatch.setattr(simmem, "_shared_paths", {path})  # (only this test's file)
    simmem._remove_shared()  # what the exporter does at exit: its files go
    mine.discard(path)
    assert not os.path.exists(path)
