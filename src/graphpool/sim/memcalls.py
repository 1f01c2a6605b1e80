"""The simulated device's memory calls: device, managed and pinned host memory, the
virtual-memory (VMM) calls of expandable segments, and IPC.

``SimDevice`` (``graphpool.sim.device``) inherits them from ``MemoryCalls``. They live apart
from the streams, events, captures and graphs because they form one self-contained group:
they read and write only the device's address ranges (``SimMemory``,
``graphpool.sim.memory``), which this class makes (``_init_memory``), and ask just two things
of the device's queues, both for the calls that give memory back: wait for all queued work
first (``_wait_uninterrupted``: ``free`` and ``host_free``, as cudaFree waits), and, for
``vmm_unmap``, wait for the work of the stream it is given or else of the whole device,
refused then while a stream of the device captures (``_wait_for_unmap``). The copies
(``memcpy``, ``read``, ...) are work on a stream and stay with the device.

Like the rest of the simulator, this module imports only the device layer and the
simulator, never the policy.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING

import numpy as np

from graphpool.sim import capture
from graphpool.sim.cudaerr import cuda_error
from graphpool.sim.memory import GRANULARITY, SimMemory, shared_dir, shared_file_pid

IPC_HANDLE_SIZE = 64
"""Bytes in an IPC handle, as CUDA's cudaIpcMemHandle_t."""

ADDRESS_BASE = 0x7F00_0000_0000
ADDRESS_SPAN = 1 << 44
"""Device ``i`` hands out addresses from ``ADDRESS_BASE + i * ADDRESS_SPAN`` upward."""
HOST_ADDRESS_BASE = 0x1000_0000_0000
"""Pinned host memory (``host_malloc``) of a backend's devices, from here upward: below every
device's range, so an address tells host from device memory."""

MANAGED_ADDRESS_BASE = 0x4000_0000_0000
MANAGED_ADDRESS_SPAN = 1 << 42
"""Managed memory (``malloc_managed``) of device ``i``, from ``MANAGED_ADDRESS_BASE + i *
MANAGED_ADDRESS_SPAN`` upward: between the host's range and the devices'."""


class MemoryCalls:
    """The memory calls of ``SimDevice``, a base class of it (see the module's docstring).

    The device makes ``_lock`` (its one lock, which these calls share with the queues) and
    calls ``_init_memory``; ``SimBackend`` then gives all its devices the first one's host
    memory and its lock (the process's pinned memory is one).
    """

    memory_bytes: int
    _lock: threading.RLock
    _mem: SimMemory  # device memory: malloc and the VMM reservations
    _host: SimMemory  # pinned host memory, shared by the backend's devices
    _host_lock: threading.Lock
    _managed: SimMemory

    if TYPE_CHECKING:  # the device's queue calls (graphpool.sim.device.SimDevice)

        def _wait_uninterrupted(self) -> BaseException | None: ...

        def _wait_for_unmap(self, stream: int | None) -> BaseException | None: ...

        def _refuse_if_device_capturing(self, call: str) -> None: ...

    def _init_memory(self, index: int, memory_bytes: int, host_memory_bytes: int) -> None:
        """The address ranges of device ``index``, with ``memory_bytes`` of device memory."""
        self.memory_bytes = memory_bytes
        self._mem = SimMemory(ADDRESS_BASE + index * ADDRESS_SPAN, memory_bytes)
        # Pinned host memory: the process's, so a backend gives its devices one (SimBackend);
        # its own lock, never held while taking a device's.
        self._host = SimMemory(HOST_ADDRESS_BASE, host_memory_bytes)
        # Managed memory: its own range, as large as the host's memory (oversubscription: it does
        # not count in mem_info); kernels and the host (host_view) both reach its bytes.
        self._managed = SimMemory(MANAGED_ADDRESS_BASE + index * MANAGED_ADDRESS_SPAN, host_memory_bytes)
        self._host_lock = threading.Lock()

    # -- device memory: cudaMalloc, managed memory --------------------------
    def malloc(self, nbytes: int) -> int | None:
        """Allocate ``nbytes``; None when the finite memory is exhausted. Unsafe in capture."""
        if nbytes <= 0:
            raise cuda_error("cudaMalloc", "cudaErrorInvalidValue", f"size {nbytes}")
        ptr: int | None = None
        try:
            with self._lock:
                capture.check_unsafe("cudaMalloc")
                ptr = self._mem.allocate(nbytes)
        except BaseException:
            # A signal handler that raises as the lock is released (Python runs handlers after a
            # call returns): the allocation would be lost with the return value, so it goes
            # back, as if cudaMalloc had not run (on CUDA the call is C: no handler runs inside).
            if ptr is not None:
                with self._lock:
                    self._mem.release(ptr)
            raise
        return ptr

    def malloc_managed(self, nbytes: int) -> int | None:
        """cudaMallocManaged(cudaMemAttachGlobal): ``nbytes`` that kernels and the host both read
        and write (``host_view``); None when the managed range is used up. It does not lower
        ``mem_info``'s free memory (the driver migrates pages on demand). Unsafe in capture."""
        if nbytes <= 0:
            raise cuda_error("cudaMallocManaged", "cudaErrorInvalidValue", f"size {nbytes}")
        with self._lock:
            capture.check_unsafe("cudaMallocManaged")
            return self._managed.allocate(nbytes)

    def _is_managed(self, ptr: int) -> bool:
        base = self._managed.base
        return base <= ptr < base + MANAGED_ADDRESS_SPAN

    def free(self, ptr: int) -> None:
        """Free memory from ``malloc`` (or ``malloc_managed``). Like cudaFree it first waits for
        all queued work."""
        with self._lock:
            capture.check_unsafe("cudaFree")
            if self._is_managed(ptr) and self._managed.is_live(ptr):
                interrupted = self._wait_uninterrupted()
                self._managed.release(ptr)
                if interrupted is not None:
                    raise interrupted
                return
            if not self._mem.is_live(ptr):
                raise cuda_error(
                    "cudaFree",
                    "cudaErrorInvalidValue",
                    f"{ptr:#x} is not an allocation",
                )
            interrupted = self._wait_uninterrupted()
            self._mem.release(ptr)
            if interrupted is not None:
                raise interrupted

    def mem_info(self) -> tuple[int, int]:
        with self._lock:
            return self.memory_bytes - self._mem.used, self.memory_bytes

    def managed_allocations(self) -> list[tuple[int, int]]:
        """(address, size) of every live ``malloc_managed`` allocation, by address."""
        with self._lock:
            return self._managed.allocations()

    def allocations(self) -> list[tuple[int, int]]:
        """(address, size) of every live ``malloc`` allocation, by address."""
        with self._lock:
            return self._mem.allocations()

    # -- virtual memory: a reservation per expandable segment, mapped granule by granule
    def vmm_granularity(self) -> int:
        return GRANULARITY

    def vmm_reserve(self, nbytes: int) -> int:
        with self._lock:
            return self._mem.reserve(nbytes)

    def vmm_map(self, va: int, nbytes: int) -> bool:
        """cuMemCreate + cuMemMap + cuMemSetAccess; False when the memory is used up."""
        with self._lock:
            capture.check_unsafe("cuMemMap")
            return self._mem.map(va, nbytes)

    def vmm_unmap(self, va: int, nbytes: int, stream: int | None = None) -> None:
        """Waits for ``stream``'s queued work first where this device made it and it is not
        capturing, else for all queued work, as graphpool's CUDA device synchronizes the
        stream or the device (the latter illegal while any stream captures)."""
        with self._lock:
            interrupted = self._wait_for_unmap(stream)
            self._mem.unmap(va, nbytes)
            if interrupted is not None:
                raise interrupted

    def vmm_release(self, va: int, nbytes: int) -> None:
        with self._lock:
            self._mem.release_reservation(va, nbytes)

    def reservations(self) -> list[tuple[int, int, int]]:
        """(address, size, mapped bytes) of every live reservation, by address."""
        with self._lock:
            return self._mem.reservations()

    # -- IPC: exported memory lives in OS shared memory (graphpool.sim.memory)
    def ipc_export(self, ptr: int) -> bytes:
        """cudaIpcGetMemHandle of the allocation starting at ``ptr``: its bytes move into a
        shared file, whose name (NUL-padded to CUDA's 64 bytes) is the handle."""
        with self._lock:
            path, _ = self._mem.export(ptr)
        return os.path.basename(path).encode().ljust(IPC_HANDLE_SIZE, b"\0")

    def ipc_open(self, handle: bytes) -> int:
        """cudaIpcOpenMemHandle: map the exported allocation at an address of this process.
        Refused in the exporting process itself, as CUDA refuses it."""
        call = "cudaIpcOpenMemHandle"
        name = bytes(handle).rstrip(b"\0").decode(errors="replace") if isinstance(handle, bytes) else ""
        pid = shared_file_pid(name)
        if not isinstance(handle, bytes) or len(handle) != IPC_HANDLE_SIZE or pid is None:
            raise cuda_error(call, "cudaErrorInvalidValue", "not a simulated IPC handle")
        if pid == os.getpid():
            raise cuda_error(call, "cudaErrorInvalidContext", "the handle was exported by this process")
        with self._lock:
            return self._mem.attach(os.path.join(shared_dir(), name))

    def ipc_close(self, ptr: int) -> None:
        """cudaIpcCloseMemHandle of an address ``ipc_open`` returned."""
        with self._lock:
            self._mem.detach(ptr)

    def view(self, ptr: int, nbytes: int) -> np.ndarray:
        """Writable uint8 view of ``[ptr, ptr + nbytes)``; cudaErrorIllegalAddress if not live.
        Pinned host memory (``host_malloc``) too: kernels and copies reach it, as on a GPU."""
        if self._is_managed(ptr):
            with self._lock:
                return self._managed.view(ptr, nbytes)
        if HOST_ADDRESS_BASE <= ptr < ADDRESS_BASE:
            with self._host_lock:
                return self._host.view(ptr, nbytes)
        with self._lock:
            return self._mem.view(ptr, nbytes)

    # -- pinned host memory: real bytes, shared by the backend's devices --------
    def host_malloc(self, nbytes: int) -> int | None:
        """cudaHostAlloc: ``nbytes`` of host memory; None when the host capacity is used up."""
        if nbytes <= 0:
            raise cuda_error("cudaHostAlloc", "cudaErrorInvalidValue", f"size {nbytes}")
        capture.check_unsafe("cudaHostAlloc")
        with self._host_lock:
            return self._host.allocate(nbytes)

    def host_free(self, ptr: int) -> None:
        """cudaFreeHost: waits for all queued work of this device first, as cudaFree does."""
        with self._lock:
            capture.check_unsafe("cudaFreeHost")
            with self._host_lock:
                if not self._host.is_live(ptr):
                    raise cuda_error(
                        "cudaFreeHost", "cudaErrorInvalidValue", f"{ptr:#x} is not a host allocation"
                    )
            interrupted = self._wait_uninterrupted()
            with self._host_lock:
                self._host.release(ptr)
            if interrupted is not None:
                raise interrupted

    def host_mem_info(self) -> tuple[int, int]:
        with self._host_lock:
            return self._host.capacity - self._host.used, self._host.capacity

    def host_view(self, ptr: int, nbytes: int) -> memoryview:
        if self._is_managed(ptr):  # managed memory: the host reads and writes it too
            with self._lock:
                return self._managed.view(ptr, nbytes, "host_view").data
        with self._host_lock:
            return self._host.view(ptr, nbytes, "host_view").data

    def host_allocations(self) -> list[tuple[int, int]]:
        """(address, size) of every live ``host_malloc`` allocation, by address."""
        with self._host_lock:
            return self._host.allocations()
