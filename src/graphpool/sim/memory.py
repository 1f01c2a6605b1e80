"""The memory of one simulated device: real bytes behind every address.

Segments are bump-allocated at 2 MiB alignment and addresses are never reused, so a
stale pointer always lands in a freed range and is reported instead of silently
aliasing newer memory. Backing stores are ``np.zeros`` arrays, which the OS maps
lazily, so large segments cost nothing until touched. Not thread-safe: the device's
lock guards it.

Sharing with other processes (CUDA IPC): ``export`` moves an allocation's bytes into a file
of OS shared memory (``/dev/shm``, or ``GRAPHPOOL_IPC_DIR``), once, and another process's
``attach`` maps that file at an address of its own, so both see and change the same bytes.
NumPy views that ``view`` gave out before the export keep the old private bytes: kernels
take their views when they run, so only a caller holding a view across the export sees it.
The file goes when the allocation is released or the process exits; an importer's mapping
keeps the bytes until it detaches, as a mapped file does.
"""

from __future__ import annotations

import atexit
import itertools
import mmap
import os
import re
import sys
import tempfile
from bisect import bisect_right

import numpy as np

from graphpool.sim.cudaerr import cuda_error

SEGMENT_ALIGNMENT = 2 * 1024 * 1024
"""Every allocation starts on a 2 MiB boundary, as cudaMalloc's large allocations do."""

GRANULARITY = 2 * 1024 * 1024
"""The unit of mapped physical memory (cuMemGetAllocationGranularity on an H200)."""


_FILE_PREFIX = "graphpool-sim-"
_shared_counter = itertools.count()
_shared_paths: set[str] = set()
"""Shared files this process made and has not removed yet (removed at exit)."""
_swept = False


def shared_dir() -> str:
    """Where the simulator keeps exported memory: ``GRAPHPOOL_IPC_DIR``, else ``/dev/shm``
    (RAM) when it is a writable directory, else the temporary directory."""
    chosen = os.environ.get("GRAPHPOOL_IPC_DIR")
    if chosen:
        return chosen
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return "/dev/shm"
    return tempfile.gettempdir()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def shared_file_pid(name: str) -> int | None:
    """The process that made shared file ``name``, None if it is no such file's name."""
    m = re.fullmatch(re.escape(_FILE_PREFIX) + r"(\d+)-\d+-[0-9a-f]+", name)
    return int(m.group(1)) if m is not None else None


def _sweep_dead(where: str) -> None:
    """Remove shared files left by processes that were killed before they could (once)."""
    global _swept
    if _swept:
        return
    _swept = True
    try:
        names = os.listdir(where)
    except OSError:
        return
    for name in names:
        pid = shared_file_pid(name)
        if pid is not None and pid != os.getpid() and not _pid_alive(pid):
            try:
                os.unlink(os.path.join(where, name))
            except OSError:
                pass


def _remove_shared() -> None:
    """At exit: remove the shared files of this process (importers keep their mappings)."""
    for path in list(_shared_paths):
        try:
            os.unlink(path)
        except OSError:
            pass
        _shared_paths.discard(path)


atexit.register(_remove_shared)
# a forked child removes none of its parent's files (its copies of them stay mapped)
os.register_at_fork(after_in_child=_shared_paths.clear)


def _map_file(path: str) -> mmap.mmap:
    """The whole of shared file ``path``, mapped shared."""
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


class _Reservation:
    """A virtual address range: the granules mapped now, and the bytes behind them.

    The bytes are an anonymous memory map of the whole range made without reserving swap
    (``MAP_NORESERVE``), so only touched pages cost memory, and unmapping a granule gives
    its pages back (``madvise(MADV_DONTNEED)``: mapped again, it reads zeros, one of the
    values CUDA allows for new physical memory). Where the platform has neither, ``store``
    is an array grown geometrically up to the highest byte mapped, and unmapped granules
    keep their old bytes.
    """

    __slots__ = ("base", "size", "mapped", "store", "_mm")

    def __init__(self, base: int, size: int) -> None:
        self.base = base
        self.size = size
        self.mapped: set[int] = set()  # granule indices from base
        self._mm: mmap.mmap | None = None
        flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
        # Python 3.11's mmap lacks the name; Linux's value is 0x4000 on every architecture
        noreserve = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)
        if flags:
            try:
                self._mm = mmap.mmap(-1, size, flags=flags | noreserve)
            except (OSError, ValueError):
                self._mm = None
        self.store = (
            np.frombuffer(self._mm, dtype=np.uint8) if self._mm is not None else np.zeros(0, np.uint8)
        )

    def cover(self, end: int) -> None:
        """Make ``store`` reach offset ``end`` (the fallback store only)."""
        have = len(self.store)
        if end > have:
            grown = np.zeros(min(self.size, max(end, 2 * have)), dtype=np.uint8)
            grown[:have] = self.store
            self.store = grown

    def drop(self, offset: int, nbytes: int) -> None:
        """Give the pages of ``[offset, offset + nbytes)`` back to the host, where it can."""
        advise = getattr(self._mm, "madvise", None)
        dontneed = getattr(mmap, "MADV_DONTNEED", None)
        if advise is not None and dontneed is not None:
            advise(dontneed, offset, nbytes)


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
        self._res: dict[int, _Reservation] = {}  # start -> reservation, live ones only
        self._shared: dict[int, str] = {}  # start -> its shared file, exported live ones only
        self._imports: dict[int, np.ndarray] = {}  # start -> bytes, another process's, attached

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
        path = self._shared.pop(ptr, None)
        if path is not None:
            _shared_paths.discard(path)
            try:
                os.unlink(path)
            except OSError:
                pass
        return True

    def export(self, ptr: int) -> tuple[str, int]:
        """(shared file, size) of the live allocation starting at ``ptr``; its bytes move
        into the file on the first call (module docstring)."""
        path = self._shared.get(ptr)
        if path is not None:
            return path, self._sizes[ptr]
        store = self._live.get(ptr)
        if store is None:
            why = "it is inside a reservation" if self._reservation_at(ptr) else "no allocation starts there"
            raise cuda_error("cudaIpcGetMemHandle", "cudaErrorInvalidValue", f"{ptr:#x}: {why}")
        where = shared_dir()
        _sweep_dead(where)
        size = self._sizes[ptr]
        name = f"{_FILE_PREFIX}{os.getpid()}-{next(_shared_counter)}-{os.urandom(4).hex()}"
        path = os.path.join(where, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise cuda_error(
                "cudaIpcGetMemHandle",
                "cudaErrorMapBufferObjectFailed",
                f"{exc}; set GRAPHPOOL_IPC_DIR to a writable directory",
            ) from None
        _shared_paths.add(path)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        except BaseException:
            _shared_paths.discard(path)
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        shared = np.frombuffer(mm, dtype=np.uint8)
        shared[:] = store
        self._live[ptr] = shared
        self._shared[ptr] = path
        return path, size

    def _reservation_at(self, ptr: int) -> bool:
        i = bisect_right(self._starts, ptr) - 1
        return i >= 0 and self._starts[i] in self._res

    def attach(self, path: str) -> int:
        """Map another process's exported allocation (shared file ``path``) at a fresh address;
        it does not count against this device's capacity (it is the exporter's)."""
        try:
            mm = _map_file(path)
        except (OSError, ValueError) as exc:
            raise cuda_error(
                "cudaIpcOpenMemHandle", "cudaErrorMapBufferObjectFailed", f"{path}: {exc}"
            ) from None
        size = len(mm)
        ptr = self._next
        self._next += -(-size // SEGMENT_ALIGNMENT) * SEGMENT_ALIGNMENT
        self._starts.append(ptr)
        self._sizes[ptr] = size
        self._imports[ptr] = np.frombuffer(mm, dtype=np.uint8)
        return ptr

    def detach(self, ptr: int) -> None:
        """Unmap what ``attach`` mapped at ``ptr``; later accesses fault."""
        if self._imports.pop(ptr, None) is None:
            raise cuda_error("cudaIpcCloseMemHandle", "cudaErrorInvalidValue", f"{ptr:#x} was not opened")

    def reserve(self, nbytes: int) -> int:
        """A fresh virtual range of ``nbytes`` (a multiple of ``GRANULARITY``), nothing mapped."""
        if nbytes <= 0 or nbytes % GRANULARITY:
            raise cuda_error("cuMemAddressReserve", "cudaErrorInvalidValue", f"size {nbytes}")
        ptr = self._next
        self._next += nbytes
        self._starts.append(ptr)
        self._sizes[ptr] = nbytes
        self._res[ptr] = _Reservation(ptr, nbytes)
        return ptr

    def _granules(self, call: str, va: int, nbytes: int) -> tuple[_Reservation, range]:
        """The reservation holding ``[va, va + nbytes)`` and the granule indices it spans."""
        i = bisect_right(self._starts, va) - 1
        res = self._res.get(self._starts[i]) if i >= 0 else None
        if res is None or nbytes <= 0 or va + nbytes > res.base + res.size:
            raise cuda_error(call, "cudaErrorInvalidValue", f"[{va:#x}, +{nbytes}) is in no reservation")
        off = va - res.base
        if off % GRANULARITY or nbytes % GRANULARITY:
            raise cuda_error(call, "cudaErrorInvalidValue", f"[{va:#x}, +{nbytes}) is not granule-aligned")
        return res, range(off // GRANULARITY, (off + nbytes) // GRANULARITY)

    def map(self, va: int, nbytes: int) -> bool:
        """Back ``[va, va + nbytes)`` with physical memory; False when the capacity is used up."""
        res, granules = self._granules("cuMemMap", va, nbytes)
        if any(g in res.mapped for g in granules):
            raise cuda_error("cuMemMap", "cudaErrorInvalidValue", f"[{va:#x}, +{nbytes}) is already mapped")
        if self.used + nbytes > self.capacity:
            return False
        res.mapped.update(granules)
        res.cover(granules.stop * GRANULARITY)
        self.used += nbytes
        return True

    def unmap(self, va: int, nbytes: int) -> None:
        """Unmap ``[va, va + nbytes)``, all of it mapped, and free its physical memory."""
        res, granules = self._granules("cuMemUnmap", va, nbytes)
        if not all(g in res.mapped for g in granules):
            raise cuda_error("cuMemUnmap", "cudaErrorInvalidValue", f"[{va:#x}, +{nbytes}) is not mapped")
        res.mapped.difference_update(granules)
        res.drop(va - res.base, nbytes)
        self.used -= nbytes

    def release_reservation(self, va: int, nbytes: int) -> None:
        """Free the reservation at ``va`` (nothing may be mapped in it)."""
        res = self._res.get(va)
        if res is None or res.size != nbytes:
            why = f"{va:#x} is no reservation of {nbytes}"
            raise cuda_error("cuMemAddressFree", "cudaErrorInvalidValue", why)
        if res.mapped:
            raise cuda_error("cuMemAddressFree", "cudaErrorInvalidValue", f"{va:#x} still has mapped memory")
        del self._res[va]

    def reservations(self) -> list[tuple[int, int, int]]:
        """(start, size, mapped bytes) of every live reservation, by address."""
        return [(p, r.size, len(r.mapped) * GRANULARITY) for p, r in sorted(self._res.items())]

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
        res = self._res.get(start)
        if res is not None:
            return self._mapped_view(call, res, ptr, nbytes)
        if ptr + nbytes > start + size or (nbytes == 0 and ptr >= start + size):
            raise cuda_error(
                call,
                "cudaErrorIllegalAddress",
                f"[{ptr:#x}, +{nbytes}) runs past the allocation [{start:#x}, +{size})",
            )
        store = self._live.get(start)
        if store is None:
            store = self._imports.get(start)
        if store is None:
            raise cuda_error(
                call,
                "cudaErrorIllegalAddress",
                f"[{ptr:#x}, +{nbytes}) lies in freed memory [{start:#x}, +{size})",
            )
        off = ptr - start
        return store[off : off + nbytes]

    def _mapped_view(self, call: str, res: _Reservation, ptr: int, nbytes: int) -> np.ndarray:
        """``view`` inside a reservation: every granule of the range must be mapped."""
        off = ptr - res.base
        last = off + max(nbytes, 1) - 1
        granules = range(off // GRANULARITY, last // GRANULARITY + 1)
        if last >= res.size or not all(g in res.mapped for g in granules):
            where = f"the reservation [{res.base:#x}, +{res.size})"
            why = f"[{ptr:#x}, +{nbytes}) touches unmapped memory of {where}"
            raise cuda_error(call, "cudaErrorIllegalAddress", why)
        return res.store[off : off + nbytes]
