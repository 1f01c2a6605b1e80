"""Device memory shared with other processes: ``DeviceBuffer.ipc_handle()``, ``open_ipc``,
``IpcBuffer``, and the reducer that sends a DeviceBuffer through ``multiprocessing``.

CUDA exports whole driver allocations (cudaIpcGetMemHandle takes the start of one), and a
graphpool buffer is one block of a segment, so a handle names the segment and carries the
buffer's offset in it, as PyTorch does. The device does the mapping (``IpcDevice`` of the
device protocol: CUDA's IPC calls, or the simulator's files of shared memory); this module
keeps the lifetime rules (docs/behaviour.rst, "IPC and multiple processes"):

* **Records.** Each exported buffer has a record, a small file (``/dev/shm`` or
  ``GRAPHPOOL_IPC_DIR``) that every process reads and writes under ``flock``: whether it is
  revoked, how many handles sent through ``multiprocessing`` are still unopened
  (``pending``), and which processes hold it open (pid and start time; a process that has
  exited no longer counts, whether or not it closed).
* **Parking.** Freeing an exported buffer (``free``, ``with``, collection) does not give
  its block to the allocator: the block stays allocated, so neither another allocation nor
  ``empty_cache`` can take its memory, and goes back once its record says nobody holds it.
  Then the record is revoked and removed, so a handle opened later is refused instead of
  mapping memory that someone else may get. The check runs at cheap moments: the free
  itself, every IPC call, ``gp.empty_cache()`` (``reclaim``). The allocator's malloc and
  free are untouched.
* **Mappings.** A process maps each exported segment once, however many buffers of it it
  opens and however often; the last ``close`` unmaps it. A handle opened in the process that
  exported it gives a view of the original memory (CUDA refuses to map it there).

A handle made by ``ipc_handle()`` does not hold the memory by itself: open it before the
owner frees the buffer (else ``open_ipc`` raises IpcError). A buffer sent through a
``multiprocessing`` queue or pipe is held until the receiver has opened it (the handle is
pending), since the sender cannot know when that happens.
"""

from __future__ import annotations

import atexit
import fcntl
import itertools
import json
import logging
import os
import re
import tempfile
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from graphpool import runtime
from graphpool.device.protocol import Device, IpcDevice
from graphpool.errors import CUDAError, GraphpoolError, IpcError
from graphpool.policy import interrupts

if TYPE_CHECKING:
    from graphpool.buffer import DeviceBuffer
    from graphpool.policy.allocator import CachingAllocator
    from graphpool.policy.block import Block

_log = logging.getLogger("graphpool")

_PREFIX: Final = "graphpool-ipc-"


# ------------------------------------------------------------------ processes
def _start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot, from /proc), 0 where the system
    does not say; None when no such process runs (an exited child not yet reaped included)."""
    if os.path.isdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                data = fh.read()
        except FileNotFoundError:
            return None
        except OSError:
            return 0
        fields = data[data.rindex(b")") + 2 :].split()
        if fields[0] in (b"Z", b"X"):  # a zombie has exited
            return None
        return int(fields[19])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except OSError:
        return 0
    return 0


def _alive(pid: int, start: int) -> bool:
    """Whether the process ``(pid, start)`` still runs (a reused pid does not count)."""
    now = _start_time(pid)
    return now is not None and (now == start or not now or not start)


_me_cache: list[tuple[int, int]] = []


def _me() -> tuple[int, int]:
    """This process as (pid, start time)."""
    pid = os.getpid()
    if not _me_cache or _me_cache[0][0] != pid:
        _me_cache[:] = [(pid, _start_time(pid) or 0)]
    return _me_cache[0]


def _record_dir() -> str:
    """Where records live: ``GRAPHPOOL_IPC_DIR``, else ``/dev/shm``, else the temporary directory."""
    chosen = os.environ.get("GRAPHPOOL_IPC_DIR")
    if chosen:
        return chosen
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return "/dev/shm"
    return tempfile.gettempdir()


# -------------------------------------------------------------------- records
class _Gone(Exception):
    """The record file does not exist (revoked and removed, or its exporter exited)."""


def _edit(path: str, change: Any) -> Any:
    """Run ``change(state)`` on record ``path`` under an exclusive lock and write the state
    back; returns what ``change`` returned. Raises _Gone when there is no such record."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        raise _Gone(path) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        raw = os.pread(fd, 1 << 16, 0)
        state = json.loads(raw) if raw else {"revoked": True, "pending": 0, "holders": []}
        before = json.dumps(state, sort_keys=True)
        out = change(state)
        after = json.dumps(state, sort_keys=True)
        if after != before:
            data = after.encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
        return out
    finally:
        os.close(fd)  # releases the lock


def _live_holders(state: dict[str, Any]) -> list[list[int]]:
    """The holders of ``state`` that still run (the dead are dropped from it)."""
    holders = [h for h in state["holders"] if _alive(h[0], h[1])]
    state["holders"] = holders
    return holders


# ------------------------------------------------------------------- handles
@dataclass(frozen=True)
class IpcHandle:
    """Names one exported DeviceBuffer for other processes of this machine; picklable.

    ``segment`` is the device's handle of the segment (driver allocation) holding the buffer,
    ``base`` and ``size`` that segment in the exporting process, ``offset`` and ``nbytes``
    the buffer in it; ``pid`` and ``start`` identify the exporting process, ``record`` the
    file that counts who holds the memory. Open it with ``graphpool.open_ipc``.
    """

    backend: str
    device: int
    segment: bytes
    base: int
    size: int
    offset: int
    nbytes: int
    pid: int
    start: int
    record: str

    def __repr__(self) -> str:
        return (
            f"IpcHandle(backend={self.backend!r}, device={self.device}, nbytes={self.nbytes}, "
            f"offset={self.offset}, pid={self.pid})"
        )


# ------------------------------------------------------------ the registry
_lock = threading.Lock()
"""Guards the dicts below. Finalizers only try it (never wait): see ``IpcBuffer.__del__``."""


class _Export:
    """One exported DeviceBuffer of this process: its block, and whether its owner freed it.

    ``owner_free`` is what the buffer's free calls instead of the allocator's: lock-free, so
    finalizers may call it; ``reclaim`` gives the block back once nobody holds it.
    """

    __slots__ = ("alloc", "block", "handle", "freed", "stream")

    def __init__(self, alloc: CachingAllocator, block: Block, handle: IpcHandle) -> None:
        self.alloc = alloc
        self.block = block
        self.handle = handle
        self.freed = False
        self.stream: int | None = None

    def owner_free(self, stream: int | None, now: bool) -> None:
        """The owner let go of the buffer (``stream``: reuse only after that stream's work
        queued so far). ``now``: try to give the block back at once (not from a finalizer)."""
        self.stream = stream
        self.freed = True
        if now:
            reclaim()


_exports: dict[str, _Export] = {}  # record path -> export, while the block is held
_maps: dict[tuple[int, int, bytes], list[int]] = {}  # (pid, base, segment) -> [local base, opens]
_holds: dict[str, int] = {}  # record path -> IpcBuffers of this process open on it
_closing: list[IpcBuffer] = []  # dropped IpcBuffers whose close waits for the lock
_owner_pid = os.getpid()
_counter = itertools.count()


def _reset_after_fork() -> None:
    """A forked child owns none of its parent's exports or mappings."""
    global _lock, _owner_pid
    _lock = threading.Lock()
    _exports.clear()
    _maps.clear()
    _holds.clear()
    _closing.clear()
    _owner_pid = os.getpid()


os.register_at_fork(after_in_child=_reset_after_fork)


def export(alloc: CachingAllocator, block: Block, device: int) -> _Export:
    """Export the block of a live DeviceBuffer: its segment through the device, and a new
    record. IpcError for memory that cannot be shared (stated why, and what to do)."""
    info = alloc.segment_at(block.ptr)
    if info is None:
        raise IpcError(f"0x{block.ptr:x} is in no segment of graphpool's allocator of device {device}")
    base, size, expandable, pool = info
    _refuse(block.ptr, expandable, pool)
    dev = alloc.device
    if not isinstance(dev, IpcDevice):
        raise IpcError(f"device {device} ({type(dev).__name__}) cannot share memory with other processes")
    try:
        segment = dev.ipc_export(base)
    except CUDAError as exc:
        raise IpcError(f"the device refused to export the segment at 0x{base:x}: {exc}") from exc
    where = _record_dir()
    path = os.path.join(where, f"{_PREFIX}{os.getpid()}-{next(_counter)}-{os.urandom(6).hex()}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, json.dumps({"holders": [], "pending": 0, "revoked": False}).encode())
        finally:
            os.close(fd)
    except OSError as exc:
        _unlink(path)
        raise IpcError(
            f"cannot make the record of an export in {where} ({exc}): set GRAPHPOOL_IPC_DIR to a "
            "writable directory that every process of the machine sees"
        ) from exc
    pid, start = _me()
    handle = IpcHandle(runtime.get().name, device, segment, base, size, block.ptr - base, 0, pid, start, path)
    entry = _Export(alloc, block, handle)
    with _lock:
        _exports[path] = entry
    _sweep_dead_records()
    return entry


def export_pointer(alloc: CachingAllocator, ptr: int) -> tuple[bytes, int]:
    """(the device's handle of the segment holding ``ptr``, ``ptr``'s offset in it), for
    integrations that make their own handle kind (Numba's). The same refusals as ``export``;
    no record: such handles are not counted (their importer maps the memory itself)."""
    info = alloc.segment_at(ptr)
    if info is None:
        raise IpcError(f"0x{ptr:x} is not memory of graphpool's allocator of device {alloc.device.index}")
    base, _, expandable, pool = info
    _refuse(ptr, expandable, pool)
    dev = alloc.device
    if not isinstance(dev, IpcDevice):
        raise IpcError(f"device {dev.index} ({type(dev).__name__}) cannot share memory with other processes")
    try:
        return dev.ipc_export(base), ptr - base
    except CUDAError as exc:
        raise IpcError(f"the device refused to export the segment at 0x{base:x}: {exc}") from exc


def _refuse(ptr: int, expandable: bool, pool: Any) -> None:
    """IpcError for memory graphpool does not share: a private pool's, an expandable segment's."""
    if pool is not None:
        raise IpcError(
            f"the buffer at 0x{ptr:x} belongs to private pool {tuple(pool)} (memory of a captured "
            "graph, or of a gp.MemPool), which graphpool does not share with other processes: a "
            "graph's replays may overwrite it at any time. Copy it into a buffer allocated "
            "outside the capture and outside gp.use_mem_pool, and share that."
        )
    if expandable:
        raise IpcError(
            f"the buffer at 0x{ptr:x} lies in an expandable segment, and graphpool exports only "
            "ordinary segments (CUDA IPC handles name whole cudaMalloc allocations). Set "
            "GRAPHPOOL_ALLOC_CONF=expandable_segments:False in the exporting process to share memory."
        )


def handle_of(entry: _Export, nbytes: int) -> IpcHandle:
    """The handle of an exported buffer of ``nbytes`` (after a look for blocks to give back)."""
    reclaim()
    h = entry.handle
    return IpcHandle(
        h.backend, h.device, h.segment, h.base, h.size, h.offset, nbytes, h.pid, h.start, h.record
    )


def reclaim() -> int:
    """Give back to the allocator every exported block whose owner freed it and that no
    process holds any more; returns how many. Cheap when nothing was exported (one test)."""
    if not _exports and not _closing:
        return 0
    if not _lock.acquire(blocking=False):
        return 0  # another thread is at it (or a finalizer interrupted this one): later
    try:
        _drain_closing()
        done = [e for e in _exports.values() if e.freed and _unheld(e.handle.record)]
        for e in done:
            del _exports[e.handle.record]
    finally:
        _lock.release()
    left = list(done)
    try:
        while left:
            _give_back(left.pop(0))
    finally:  # an exception between give-backs (a signal's handler): the rest wait for the next
        for e in left:
            _exports[e.handle.record] = e
    return len(done)


def reclaim_on(device: int) -> int:
    """``reclaim()`` for the out-of-memory path (``graphpool.cooperate``): the bytes of
    ``device``'s exported blocks it gave back to their allocator."""

    def held() -> int:
        return sum(e.block.size for e in list(_exports.values()) if e.handle.device == device)

    before = held()
    if not before:
        return 0
    reclaim()
    return max(0, before - held())


def _unheld(path: str) -> bool:
    """Revoke record ``path`` if no running process holds it and no sent handle is pending."""

    def check(state: dict[str, Any]) -> bool:
        if state["revoked"]:
            return True
        if _live_holders(state) or state["pending"] > 0:
            return False
        state["revoked"] = True
        return True

    try:
        free = bool(_edit(path, check))
    except _Gone:
        free = True
    if free:
        _unlink(path)
    return free


def _give_back(e: _Export) -> None:
    try:
        if e.stream is None:
            e.alloc.free_owned(e.block)
        else:
            e.alloc.defer_free(e.block, e.stream)
    except GraphpoolError as exc:  # never lose the others to one failure
        _log.warning("graphpool: giving back exported memory at 0x%x failed: %s", e.block.ptr, exc)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


_swept = False


def _sweep_dead_records() -> None:
    """Remove records left by exporters that were killed before they could (once a process)."""
    global _swept
    if _swept:
        return
    _swept = True
    where = _record_dir()
    try:
        names = os.listdir(where)
    except OSError:
        return
    for name in names:
        m = re.fullmatch(re.escape(_PREFIX) + r"(\d+)-.*", name)
        if m is not None and _start_time(int(m.group(1))) is None:
            _unlink(os.path.join(where, name))


# ------------------------------------------------------------------- importing
class IpcBuffer:
    """Memory another process exported, mapped in this one (``graphpool.open_ipc``).

    ``ptr``, ``nbytes`` and ``device`` as a DeviceBuffer's; exported to frameworks through
    ``__cuda_array_interface__`` (no stream: synchronize with the exporter yourself) and
    DLPack. ``close()`` (or leaving a ``with`` block) lets go of it; the memory stays the
    exporter's. A dropped IpcBuffer closes itself. Using a closed one raises IpcError.
    """

    __slots__ = ("_ptr", "_nbytes", "_device", "_handle", "_key", "_dev", "_closed", "__weakref__")

    def __init__(self, ptr: int, handle: IpcHandle, key: tuple[int, int, bytes], dev: Device) -> None:
        self._ptr = ptr
        self._nbytes = handle.nbytes
        self._device = handle.device
        self._handle = handle
        self._key = key
        self._dev = dev
        self._closed = False

    def _open_ptr(self) -> int:
        if self._closed:
            raise IpcError(f"this IpcBuffer ({self._nbytes} bytes of process {self._handle.pid}) was closed")
        return self._ptr

    @property
    def ptr(self) -> int:
        """The address of the memory in this process."""
        return self._open_ptr()

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def device(self) -> int:
        return self._device

    @property
    def handle(self) -> IpcHandle:
        """The handle this buffer was opened from."""
        return self._handle

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def freed(self) -> bool:
        """Same as ``closed`` (what graphpool.dlpack asks of a buffer)."""
        return self._closed

    def close(self) -> None:
        """Let go of the memory: the last close of a segment in this process unmaps it, and
        the exporter may reuse it once no process holds it. A second call does nothing."""
        with _lock:
            _close_locked(self)
            _drain_closing()
        reclaim()

    def __enter__(self) -> IpcBuffer:
        self._open_ptr()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if self._closed:
                return
        except AttributeError:
            return
        try:
            if _lock.acquire(blocking=False):
                try:
                    _close_locked(self)
                finally:
                    _lock.release()
            else:
                _closing.append(self)  # resurrected until the lock's holder drains it
        except Exception:
            pass

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """Version 3: a 1-D array of ``nbytes`` bytes; no stream to synchronize with."""
        return {
            "shape": (self._nbytes,),
            "typestr": "|u1",
            "data": (self._open_ptr(), False),
            "version": 3,
            "strides": None,
            "stream": None,
        }

    def __dlpack__(
        self, *, stream: Any = None, max_version: Any = None, dl_device: Any = None, copy: Any = None
    ) -> Any:
        """A DLPack capsule of ``nbytes`` uint8 values (zero-copy; see graphpool.dlpack)."""
        from graphpool import dlpack

        self._open_ptr()
        me: Any = self  # graphpool.dlpack takes an IpcBuffer as it takes a DeviceBuffer
        return dlpack.export(me, stream=stream, max_version=max_version, dl_device=dl_device, copy=copy)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, self._device)

    def __reduce__(self) -> Any:
        raise TypeError("an IpcBuffer cannot be pickled: send its handle (buf.handle) and open that instead")

    def __repr__(self) -> str:
        state = ", closed" if self._closed else ""
        return (
            f"<graphpool.IpcBuffer 0x{self._ptr:x}, {self._nbytes} bytes, device {self._device}, "
            f"from process {self._handle.pid}{state}>"
        )


def _close_locked(buf: IpcBuffer) -> None:
    """Close ``buf`` (the registry lock held): unmap its segment if it was the last user here,
    then drop this process from the record if it was its last open here."""
    if buf._closed:
        return
    buf._closed = True
    h = buf._handle
    mapping = _maps.get(buf._key)
    error: BaseException | None = None
    if mapping is not None:
        mapping[1] -= 1
        if mapping[1] <= 0:
            del _maps[buf._key]
            if buf._key[0] != os.getpid():
                try:
                    dev = buf._dev
                    assert isinstance(dev, IpcDevice)
                    dev.ipc_close(mapping[0])
                except Exception as exc:  # still drop the record's hold below
                    error = exc
    left = _holds.get(h.record, 0) - 1
    if left > 0:
        _holds[h.record] = left
    else:
        _holds.pop(h.record, None)
        me = list(_me())

        def drop(state: dict[str, Any]) -> None:
            state["holders"] = [x for x in state["holders"] if x != me]

        try:
            _edit(h.record, drop)
        except _Gone:
            pass
    if error is not None:
        _log.warning(
            "graphpool: unmapping IPC memory at 0x%x failed: %s", mapping[0] if mapping else 0, error
        )


def _drain_closing() -> None:
    """Close the IpcBuffers dropped while the lock was taken (the lock held)."""
    while _closing:
        _close_locked(_closing.pop())


def open_ipc(handle: IpcHandle) -> IpcBuffer:
    """Map the memory ``handle`` names in this process (``graphpool.open_ipc``)."""
    return _open(handle, claim=False)


def _open(handle: IpcHandle, claim: bool) -> IpcBuffer:
    if not isinstance(handle, IpcHandle):
        raise TypeError(
            f"open_ipc needs a graphpool.IpcHandle (from buf.ipc_handle()), not {type(handle).__name__}"
        )
    rt = runtime.get()
    if handle.backend != rt.name:
        raise IpcError(
            f"the handle was made under graphpool's {handle.backend!r} backend and this process uses "
            f"{rt.name!r}: gp.set_backend({handle.backend!r}) first"
        )
    if not 0 <= handle.device < rt.count:
        raise IpcError(f"the handle names device {handle.device}; this process has {rt.count}")
    if not (0 <= handle.offset and 0 < handle.nbytes and handle.offset + handle.nbytes <= handle.size):
        raise IpcError(
            f"the handle's buffer ({handle.nbytes} bytes at offset {handle.offset}) does not lie "
            f"inside its segment ({handle.size} bytes): not a handle that ipc_handle() made"
        )
    dev = rt.device(handle.device)
    if not isinstance(dev, IpcDevice):
        raise IpcError(f"device {handle.device} ({type(dev).__name__}) cannot open memory of other processes")
    me = _me()
    same = me == (handle.pid, handle.start) or (me[0] == handle.pid and not (me[1] and handle.start))
    if not same and not _alive(handle.pid, handle.start):
        raise IpcError(
            f"the process that exported this memory (pid {handle.pid}) has exited: its memory is gone"
        )
    key = (handle.pid, handle.base, handle.segment)
    with _lock:
        _drain_closing()
        mapping = _maps.get(key)
        holder = [me[0], me[1]]
        first_hold = _holds.get(handle.record, 0) == 0
        made: list[int] = []

        def join(state: dict[str, Any]) -> None:
            if state["revoked"]:
                raise _Gone(handle.record)
            if mapping is None:
                if same:
                    made.append(handle.base)
                else:
                    try:
                        made.append(dev.ipc_open(handle.segment))
                    except CUDAError as exc:
                        raise IpcError(f"the device could not map the exported memory: {exc}") from exc
            if first_hold and holder not in state["holders"]:
                state["holders"].append(holder)
            if claim and state["pending"] > 0:
                state["pending"] -= 1

        try:
            _edit(handle.record, join)
        except _Gone:
            raise IpcError(
                f"the memory is no longer shared: its owner (pid {handle.pid}) freed it and no process "
                "held it open, or the exporter ended. Open a handle before the owner frees the buffer "
                "(a buffer sent through multiprocessing is held until it is opened)."
            ) from None
        if mapping is None:
            mapping = [made[0], 0]
            _maps[key] = mapping
        mapping[1] += 1
        _holds[handle.record] = _holds.get(handle.record, 0) + 1
        buf = IpcBuffer(mapping[0] + handle.offset, handle, key, dev)
    reclaim()
    return buf


def _open_sent(handle: IpcHandle) -> IpcBuffer:
    """The receiving side of ``reduce_buffer``: open, and count the sent handle as arrived."""
    return _open(handle, claim=True)


def reduce_buffer(buf: DeviceBuffer) -> tuple[Any, tuple[IpcHandle]]:
    """``multiprocessing``'s reducer for DeviceBuffer: it arrives as an IpcBuffer.

    The buffer's stream is synchronized first (what it queued is in the bytes the receiver
    sees), and the handle counts as pending until the receiver opened it, so the sender may
    drop the buffer at once.
    """
    handle = buf.ipc_handle()
    buf.stream.synchronize()

    def pend(state: dict[str, Any]) -> None:
        if state["revoked"]:
            raise _Gone(handle.record)
        state["pending"] += 1

    try:
        _edit(handle.record, pend)
    except _Gone:
        raise IpcError("the buffer's export was revoked while it was being sent") from None
    return _open_sent, (handle,)


def _at_exit() -> None:
    """Drop this process from the records it holds and remove its own records (importers then
    learn that the exporter is gone). The device unmaps everything with the process."""
    if os.getpid() != _owner_pid:
        return
    me = list(_me())

    def drop(state: dict[str, Any]) -> None:
        state["holders"] = [x for x in state["holders"] if x != me]

    for path in list(_holds):
        try:
            _edit(path, drop)
        except (_Gone, OSError, ValueError):
            pass
    _holds.clear()
    _maps.clear()
    for path in list(_exports):
        _unlink(path)


atexit.register(_at_exit)


def exported_count() -> int:
    """Exported buffers of this process whose blocks graphpool still holds (for tests)."""
    return len(_exports)


__all__ = ["IpcBuffer", "IpcHandle", "open_ipc", "reclaim", "reduce_buffer"]


# Plain build: a guarded signal landing while a freed export changes hands (the owner's free
# reaching its record; reclaim giving blocks back) is delivered after that code returned
# (policy/interrupts.py, "Handoffs"), so no block is left neither exported nor given back.
interrupts.handoff(_Export.owner_free, reclaim, _give_back)
