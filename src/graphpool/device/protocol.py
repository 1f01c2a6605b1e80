"""What a device must do for graphpool: the one contract between policy and hardware.

Two implementations exist: ``graphpool.device.cuda`` (real CUDA through cuda.bindings)
and ``graphpool.sim`` (a CPU model). Nothing above this layer knows which one it has.

Preconditions, stated once for every method below:

* Handles (streams, events, graphs, graph execs) are plain ints made by the same
  device object; stream ``LEGACY_STREAM`` (0) is the legacy default stream.
* Every call acts on its own device, whatever device is current on the calling thread.
* Failures raise ``graphpool.errors.CUDAError`` naming the CUDA error, with one
  exception: ``malloc`` returns ``None`` when the device is out of memory, because the
  allocator treats that as an expected outcome (release the cache and retry).
* "Unsafe during capture" calls (``malloc``, ``free``, ``query_event``, every
  synchronize) follow CUDA's capture-mode rules: in a prohibited mode they fail and
  invalidate the capture. The allocator never makes them while a capture is underway,
  except ``malloc`` under ``CAPTURE_MODE_RELAXED``.
* ``capture_info`` and ``capture_id`` are cheap and legal at any time, on any stream.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

LEGACY_STREAM = 0
"""Handle of the legacy default stream (CUDA's NULL stream)."""

CAPTURE_MODE_GLOBAL = 0
CAPTURE_MODE_THREAD_LOCAL = 1
CAPTURE_MODE_RELAXED = 2
CAPTURE_MODES = {
    "global": CAPTURE_MODE_GLOBAL,
    "thread_local": CAPTURE_MODE_THREAD_LOCAL,
    "relaxed": CAPTURE_MODE_RELAXED,
}

CAPTURE_STATUS_NONE = 0
CAPTURE_STATUS_ACTIVE = 1
CAPTURE_STATUS_INVALIDATED = 2


@runtime_checkable
class Device(Protocol):
    """One device: memory, streams, events, stream capture and graphs."""

    index: int
    name: str

    # -- memory ---------------------------------------------------------------
    def malloc(self, nbytes: int) -> int | None:
        """Allocate ``nbytes`` (> 0) of device memory; ``None`` if the device is out of memory."""
        ...

    def free(self, ptr: int) -> None:
        """Return memory from ``malloc``. Unsafe during capture."""
        ...

    def mem_info(self) -> tuple[int, int]:
        """(free bytes, total bytes) of the device."""
        ...

    # -- virtual memory (expandable segments) ----------------------------------
    def vmm_granularity(self) -> int:
        """The unit of mapped physical memory: sizes and offsets below are multiples of it."""
        ...

    def vmm_reserve(self, nbytes: int) -> int:
        """Reserve ``nbytes`` of virtual address space, backed by nothing yet."""
        ...

    def vmm_map(self, va: int, nbytes: int) -> bool:
        """Back ``[va, va + nbytes)`` of a reservation with new physical memory that this device
        may read and write; False (nothing mapped) if the device is out of memory. Unsafe
        during capture, like ``malloc``."""
        ...

    def vmm_unmap(self, va: int, nbytes: int, stream: int | None = None) -> None:
        """Wait for queued work, then unmap ``[va, va + nbytes)`` and give its physical memory
        back (unsafe during capture, like ``free``). The wait is for ``stream``'s work where
        ``stream`` is one ``create_stream`` made and is not capturing (the caller knows the
        memory's last uses were ordered on it), else for all the device's work (a device
        synchronize, which invalidates a capture underway on any stream)."""
        ...

    def vmm_release(self, va: int, nbytes: int) -> None:
        """Give back the reservation at ``va`` of ``nbytes``, all of it unmapped."""
        ...

    def memset(self, ptr: int, value: int, nbytes: int, stream: int) -> None:
        """Queue a byte fill on ``stream`` (capturable)."""
        ...

    def memcpy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Queue a device-to-device copy on ``stream`` (capturable)."""
        ...

    def write(self, ptr: int, data: bytes, stream: int) -> None:
        """Copy host bytes to ``ptr`` in ``stream`` order; returns when ``data`` may be reused."""
        ...

    def read(self, ptr: int, nbytes: int, stream: int) -> bytes:
        """Wait for ``stream``'s work so far, then copy ``nbytes`` at ``ptr`` to the host."""
        ...

    # -- pinned host memory (the pinned pool, graphpool.pinned) ----------------
    # Page-locked host memory that this device's copies read and write without staging.
    # Host memory belongs to the process: the simulator's devices of one backend share it.
    def host_malloc(self, nbytes: int) -> int | None:
        """Allocate ``nbytes`` (> 0) of page-locked host memory, usable by every device's copies
        (``cudaHostAlloc``, portable); ``None`` when the host refuses (out of memory). Unsafe
        during capture, like ``malloc``."""
        ...

    def host_free(self, ptr: int) -> None:
        """Return memory from ``host_malloc`` (``cudaFreeHost``: it first waits for the device's
        queued work). Unsafe during capture."""
        ...

    def host_mem_info(self) -> tuple[int, int]:
        """(available, total) bytes of host memory."""
        ...

    def host_view(self, ptr: int, nbytes: int) -> memoryview:
        """A writable byte view (format ``B``) of ``[ptr, ptr + nbytes)``, which lies in one live
        ``host_malloc`` allocation: what the host reads and writes there."""
        ...

    def memcpy_host(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Queue a copy on ``stream`` where either side may be ``host_malloc`` memory and the other
        device memory (``cudaMemcpyAsync`` with ``cudaMemcpyDefault``). Capturable: a replay
        copies from or to the same host addresses again."""
        ...

    def attach_host_release(self, stream: int, token: int) -> None:
        """``attach_release`` for the pinned pool, a second allocator on this device: ``token``
        is reported by ``take_host_released`` only, never by ``take_released`` (each allocator
        drains its own tokens)."""
        ...

    def take_host_released(self) -> list[int]:
        """Tokens of ``attach_host_release`` whose graphs are gone since the last call."""
        ...

    # -- streams --------------------------------------------------------------
    def create_stream(self) -> int:
        """A new non-blocking stream (it does not synchronize with the legacy stream)."""
        ...

    def destroy_stream(self, stream: int) -> None: ...

    def owns_stream(self, stream: int) -> bool:
        """Whether ``stream`` is a live stream of this device's context (on CUDA its primary
        context, the one the runtime API, CuPy and PyTorch use); the legacy stream always is.
        Asked of streams made outside graphpool (``__cuda_stream__`` objects), never on the
        allocator's paths."""
        ...

    def stream_wait_event(self, stream: int, event: int) -> None:
        """Later work on ``stream`` waits for ``event``'s recorded work (capturable: joins a capture)."""
        ...

    def stream_synchronize(self, stream: int) -> None:
        """Block the host until ``stream``'s work is done. Unsafe during capture."""
        ...

    def device_synchronize(self) -> None:
        """Block the host until all work on the device is done. Unsafe during capture."""
        ...

    def stream_idle(self, stream: int) -> bool:
        """Whether ``stream`` is a stream this device object made (``create_stream``) and has
        not destroyed, is not capturing, and has finished all its work. False for any other
        stream without asking CUDA about it: a handle made elsewhere may have been destroyed
        (undefined behaviour to query), the legacy stream's status covers captures on other
        streams, and a query of a capturing stream would invalidate its capture. Legal at any
        time: the query runs under ``CAPTURE_MODE_RELAXED`` on the calling thread."""
        ...

    def stream_synchronize_made(self, stream: int) -> bool:
        """Wait for the work of ``stream`` where it is a stream this device object made
        (``create_stream``), has not destroyed, and that is not capturing; whether it waited
        (False: nothing was asked or waited for). For callers that must never wait for the
        whole device nor pass CUDA a handle made elsewhere. Run it under
        ``CAPTURE_MODE_RELAXED`` while a capture may be underway on another stream."""
        ...

    def made_streams_capturing(self) -> bool:
        """Whether any stream this device object made (``create_stream``) and has not destroyed
        takes part in a capture now (the capture query of each; no other handle is asked).
        Legal at any time."""
        ...

    def stream_capturing(self, stream: int) -> bool | None:
        """Whether ``stream``, a stream this device object made (``create_stream``) and has not
        destroyed, takes part in a capture now (the capture query); None for any other stream,
        which is never passed to CUDA (a handle made elsewhere may have been destroyed). Legal
        at any time."""
        ...

    # -- events (timing disabled) ---------------------------------------------
    def create_event(self) -> int: ...

    def destroy_event(self, event: int) -> None: ...

    def record_event(self, event: int, stream: int) -> None:
        """Mark ``stream``'s work queued so far; on a capturing stream it becomes a capture node."""
        ...

    def query_event(self, event: int) -> bool:
        """True when the recorded work is done (or nothing was recorded). Unsafe during capture."""
        ...

    def event_synchronize(self, event: int) -> None:
        """Block the host until the recorded work is done. Unsafe during capture."""
        ...

    # -- capture and graphs ---------------------------------------------------
    def capture_info(self, stream: int) -> tuple[int, int]:
        """(status, capture id) of ``stream``; id is 0 when status is ``CAPTURE_STATUS_NONE``.

        A stream that joined a capture by waiting on an event recorded in it reports that
        capture's id. Ids are unique for the life of the process.
        """
        ...

    def capture_id(self, stream: int) -> int:
        """The id of the capture ``stream`` takes part in (active or invalidated), 0 when none.

        The allocator asks this on every allocation while detection of outside captures is
        on, so it is the cheapest query the device has (on CUDA, one driver call from C).
        """
        ...

    def capture_query_address(self) -> int:
        """The address of a C function ``int query(void *stream, unsigned long long *id)``
        that answers ``capture_id`` (0 on success, ``*id`` 0 when not capturing; nonzero on
        failure), callable from any thread without the GIL; 0 when the device has none. The
        PyTorch shim's native lane asks it before it hands a parked block out."""
        ...

    def attach_release(self, stream: int, token: int) -> None:
        """Tie ``token`` to the graph being captured on ``stream`` (a CUDA user object).

        Once that graph and every executable graph instantiated from it are destroyed (or
        the capture fails and its graph is discarded), ``token`` is reported once by
        ``take_released``. The report may come from any thread, even a driver thread, so it
        is only queued there. Raises unless ``stream`` is capturing.
        """
        ...

    def take_released(self) -> list[int]:
        """Tokens of ``attach_release`` whose graphs are gone since the last call (drains them)."""
        ...

    def exchange_capture_mode(self, mode: int) -> int:
        """Set the calling thread's capture mode; return the previous one."""
        ...

    def begin_capture(self, stream: int, mode: int) -> None:
        """Start capturing ``stream`` (not the legacy stream) in ``mode``."""
        ...

    def end_capture(self, stream: int) -> int:
        """End the capture begun on ``stream``; return the graph. Raises if it was invalidated.

        The stream (and every stream that joined) leaves capture mode even when this raises.
        """
        ...

    def graph_node_count(self, graph: int) -> int: ...

    def instantiate(self, graph: int) -> int:
        """An executable graph for ``graph``."""
        ...

    def launch(self, graph_exec: int, stream: int) -> None:
        """Queue one replay of ``graph_exec`` on ``stream``."""
        ...

    def destroy_graph(self, graph: int) -> None: ...

    def destroy_graph_exec(self, graph_exec: int) -> None: ...


@runtime_checkable
class IpcDevice(Protocol):
    """A device that shares memory with other processes of the machine (CUDA IPC).

    Apart from ``Device`` so that a device without it still is one; graphpool's CUDA device
    and the simulator implement both. CUDA exports whole driver allocations: ``ipc_export``
    takes the start of one, and the importer adds the offset of the part it wants.
    """

    def ipc_export(self, ptr: int) -> bytes:
        """An opaque handle naming the live ``malloc`` allocation that starts at ``ptr``,
        valid in other processes of this machine (cudaIpcGetMemHandle). The same allocation
        always gives the same handle. Raises ``CUDAError`` for any other address (an
        address inside an allocation, a reservation of ``vmm_reserve``)."""
        ...

    def ipc_open(self, handle: bytes) -> int:
        """Map the allocation ``handle`` names (exported by another process) into this
        process; returns the address of its start here (cudaIpcOpenMemHandle). CUDA refuses a
        handle of the calling process itself, and a handle whose allocation was freed."""
        ...

    def ipc_close(self, ptr: int) -> None:
        """Unmap an allocation ``ipc_open`` mapped at ``ptr`` (cudaIpcCloseMemHandle)."""
        ...


@runtime_checkable
class ManagedDevice(Protocol):
    """A device with managed memory (``cudaMallocManaged``): a MemPool's built-in upstream
    for oversubscription. Apart from ``Device``, as ``IpcDevice`` is."""

    def malloc_managed(self, nbytes: int) -> int | None:
        """Allocate ``nbytes`` (> 0) of managed memory, which this device's work and the host
        (``host_view``) both read and write; ``None`` when it cannot. ``free`` gives it back.
        Unsafe during capture, like ``malloc``."""
        ...


@runtime_checkable
class Backend(Protocol):
    """A set of devices of one kind ("cuda" or "sim")."""

    name: str

    def device_count(self) -> int: ...

    def get_device(self, index: int) -> Device:
        """The device object for ``index`` (the same object on every call)."""
        ...

    def set_current_device(self, index: int) -> None:
        """Make ``index`` the calling thread's current device (for frameworks that follow it)."""
        ...
