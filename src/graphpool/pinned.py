"""Pinned (page-locked) host memory: a caching pool per device with graphpool's stream and
capture rules (``gp.alloc_pinned``; docs/behaviour.rst, "Pinned host memory").

The pool is a second ``CachingAllocator`` (the same policy as device memory: rounding,
segments, best fit, split and merge, events, private pools for captures, statistics and
snapshots) over ``HostMemory``, a ``Device`` whose memory calls are the device's host calls
(``host_malloc``: ``cudaHostAlloc`` on CUDA, real bytes on the simulator) and whose other
calls (streams, events, capture queries, graph user objects) go to the device itself.

Host memory differs from device memory in one way that matters: the host reads and writes
it at once, not in stream order. A device block freed on its own stream may be handed to the
next allocation on that stream at once (later kernels queue behind earlier ones); a pinned
block may not, since the host would write it while a copy queued before the free still
reads it. So every pinned block counts the stream it was allocated for as a *user*
(``record_stream``), and its free records an event there: the block is reused only once
that event completes, on any later allocation for that stream (PyTorch's host allocator
waits the same way). For the policy to do that with its own machinery, the pool files each
block under a key that is not the stream itself: ``key = handle + 1`` (stream handles are
even: CUDA's are pointers, the simulator's multiples of 16, the legacy stream 0), which
``HostMemory`` turns back into the stream for every device call.

Captures: a pinned block freed while a capture is underway is kept for the graph until the
graph is destroyed (the seed's rule, as for device memory: a captured copy reads or writes
it on every replay). The pool learns of a capture when graphpool begins it (``gp.graph``,
and CuPy's and cuda.core's capture calls once their integration is installed:
``capture_begun``), and detects one at a pinned allocation on a capturing stream; each
such capture is tied to its graph by a CUDA user object, as a capture begun outside
graphpool is for device memory. A pinned allocation on the capturing stream comes from a
private pool of that capture. The limits are those of detection (README, "Captures begun
outside graphpool"): a capture no hook announced and no pinned allocation on its stream saw
is unknown to the pool.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING, Any, Final

from graphpool import _warnings, runtime
from graphpool.device.protocol import CAPTURE_STATUS_ACTIVE, CAPTURE_STATUS_NONE, Device
from graphpool.errors import CaptureError, DoubleFreeError, GraphpoolError, OutOfMemoryError
from graphpool.policy import interrupts

if TYPE_CHECKING:  # NumPy loads only when a view is made: ``import graphpool`` does not need it
    import numpy as np
from graphpool.policy.allocator import CachingAllocator
from graphpool.streams import Stream, StreamLike, _index, as_stream, current_stream

_KEY: Final = object()
"""The private key ``PinnedBuffer`` wants: only this module makes buffers."""


def _key(stream: int) -> int:
    """The pool's key for ``stream`` (odd: never a stream handle; module docstring)."""
    return stream + 1


def _real(handle: int) -> int:
    """The stream a pool key names, or ``handle`` itself when it is a stream (even)."""
    return handle - 1 if handle & 1 else handle


class HostMemory:
    """``Device`` for the pinned pool: memory is the device's page-locked host memory, every
    stream argument is a pool key or a stream (``_real``), the rest is the device's.

    No expandable segments (host memory has no virtual-memory growth here): the pool's
    configuration turns them off, and the VMM calls refuse.
    """

    def __init__(self, device: Device) -> None:
        self.device = device
        self.index = device.index
        self.name = f"pinned host memory for {device.name}"

    # -- memory: the host's
    def malloc(self, nbytes: int) -> int | None:
        return self.device.host_malloc(nbytes)

    def free(self, ptr: int) -> None:
        self.device.host_free(ptr)

    def mem_info(self) -> tuple[int, int]:
        return self.device.host_mem_info()

    def vmm_granularity(self) -> int:
        raise GraphpoolError("pinned host memory has no expandable segments")

    def vmm_reserve(self, nbytes: int) -> int:
        raise GraphpoolError("pinned host memory has no expandable segments")

    def vmm_map(self, va: int, nbytes: int) -> bool:
        raise GraphpoolError("pinned host memory has no expandable segments")

    def vmm_unmap(self, va: int, nbytes: int, stream: int | None = None) -> None:
        raise GraphpoolError("pinned host memory has no expandable segments")

    def vmm_release(self, va: int, nbytes: int) -> None:
        raise GraphpoolError("pinned host memory has no expandable segments")

    def memset(self, ptr: int, value: int, nbytes: int, stream: int) -> None:
        self.device.memset(ptr, value, nbytes, _real(stream))

    def memcpy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.device.memcpy_host(dst, src, nbytes, _real(stream))

    def write(self, ptr: int, data: bytes, stream: int) -> None:
        self.device.write(ptr, data, _real(stream))

    def read(self, ptr: int, nbytes: int, stream: int) -> bytes:
        return self.device.read(ptr, nbytes, _real(stream))

    # -- streams, events, captures, graphs: the device's, on the real stream
    def create_stream(self) -> int:
        return self.device.create_stream()

    def destroy_stream(self, stream: int) -> None:
        self.device.destroy_stream(_real(stream))

    def owns_stream(self, stream: int) -> bool:
        return self.device.owns_stream(_real(stream))

    def stream_wait_event(self, stream: int, event: int) -> None:
        self.device.stream_wait_event(_real(stream), event)

    def stream_synchronize(self, stream: int) -> None:
        self.device.stream_synchronize(_real(stream))

    def device_synchronize(self) -> None:
        self.device.device_synchronize()

    def stream_idle(self, stream: int) -> bool:
        return self.device.stream_idle(_real(stream))

    def stream_synchronize_made(self, stream: int) -> bool:
        return self.device.stream_synchronize_made(_real(stream))

    def made_streams_capturing(self) -> bool:
        return self.device.made_streams_capturing()

    def stream_capturing(self, stream: int) -> bool | None:
        return self.device.stream_capturing(_real(stream))

    def create_event(self) -> int:
        return self.device.create_event()

    def destroy_event(self, event: int) -> None:
        self.device.destroy_event(event)

    def record_event(self, event: int, stream: int) -> None:
        self.device.record_event(event, _real(stream))

    def query_event(self, event: int) -> bool:
        return self.device.query_event(event)

    def event_synchronize(self, event: int) -> None:
        self.device.event_synchronize(event)

    def capture_info(self, stream: int) -> tuple[int, int]:
        if stream == 1:  # the legacy stream's key: it never captures, and is never asked
            return CAPTURE_STATUS_NONE, 0
        return self.device.capture_info(_real(stream))

    def capture_id(self, stream: int) -> int:
        if stream == 1:
            return 0
        return self.device.capture_id(_real(stream))

    def capture_query_address(self) -> int:
        return 0  # no native lane serves pinned memory

    def attach_release(self, stream: int, token: int) -> None:
        self.device.attach_host_release(_real(stream), token)  # never drained by the device pool

    def take_released(self) -> list[int]:
        return self.device.take_host_released()

    def exchange_capture_mode(self, mode: int) -> int:
        return self.device.exchange_capture_mode(mode)

    def begin_capture(self, stream: int, mode: int) -> None:
        self.device.begin_capture(_real(stream), mode)

    def end_capture(self, stream: int) -> int:
        return self.device.end_capture(_real(stream))

    def graph_node_count(self, graph: int) -> int:
        return self.device.graph_node_count(graph)

    def instantiate(self, graph: int) -> int:
        return self.device.instantiate(graph)

    def launch(self, graph_exec: int, stream: int) -> None:
        self.device.launch(graph_exec, _real(stream))

    def destroy_graph(self, graph: int) -> None:
        self.device.destroy_graph(graph)

    def destroy_graph_exec(self, graph_exec: int) -> None:
        self.device.destroy_graph_exec(graph_exec)

    # -- the host calls, as the device has them (a HostMemory is a Device too)
    def host_malloc(self, nbytes: int) -> int | None:
        return self.device.host_malloc(nbytes)

    def host_free(self, ptr: int) -> None:
        self.device.host_free(ptr)

    def host_mem_info(self) -> tuple[int, int]:
        return self.device.host_mem_info()

    def host_view(self, ptr: int, nbytes: int) -> memoryview:
        return self.device.host_view(ptr, nbytes)

    def memcpy_host(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.device.memcpy_host(dst, src, nbytes, _real(stream))

    def attach_host_release(self, stream: int, token: int) -> None:
        self.device.attach_host_release(_real(stream), token)

    def take_host_released(self) -> list[int]:
        return self.device.take_host_released()


# ------------------------------------------------------------------ the pools
_lock = threading.Lock()
_pools: tuple[object, dict[int, CachingAllocator]] = (None, {})
"""(the runtime, device index -> its pinned pool): pools of a replaced runtime are dropped
here (their buffers keep theirs)."""
_announced: set[tuple[int, int]] = set()
"""(device, stream) of captures announced by ``capture_begun`` and not ended:
a pool made during one of them registers it."""
_adopted: dict[tuple[int, int], Any] = {}
"""(device, stream) -> the pinned pool's record of an announced capture."""


def _existing(device: int) -> CachingAllocator | None:
    """The pinned pool of ``device`` under the current runtime, if one was made."""
    rt, pools = _pools
    if rt is not runtime.get():
        return None
    return pools.get(device)


def pool(device: int | None = None) -> CachingAllocator:
    """The pinned pool (a CachingAllocator over HostMemory) of ``device`` (default: current),
    made on first use with the allocator configuration of device memory, less expandable
    segments and memory limits (those cap device memory)."""
    global _pools
    index = runtime.current_device_index() if device is None else device
    rt = runtime.get()
    found = _existing(index)
    if found is not None:
        return found
    dev = rt.device(index)  # ValueError for a bad index
    announced: list[tuple[int, int]] = []  # set only by the thread that makes the pool
    with _lock:
        old_rt, pools = _pools
        if old_rt is not rt:
            pools = {}
            _pools = (rt, pools)
        a = pools.get(index)
        if a is None:
            sizes = dataclasses.replace(
                runtime.configured_sizes(rt.sizes, runtime.alloc_conf()), expandable_segments=False
            )
            a = CachingAllocator(
                HostMemory(dev), sizes=sizes, world=rt.world, detect=runtime.capture_detection()
            )
            pools[index] = a
            announced = [k for k in _announced if k[0] == index]
    if announced:
        for d, s in announced:  # captures underway before the pool existed
            _adopt(a, d, s)
    return a


def _adopt(a: CachingAllocator, device: int, stream: int) -> None:
    """Register the capture underway on ``stream`` with pinned pool ``a`` (never raises: the
    capture goes on; a warning says what failed). A stream that is gone or no longer
    capturing is skipped quietly: its capture ended without being announced (a graph
    collected mid-capture ends it in a finalizer, which may not take this module's lock)."""
    try:
        status = a.device.capture_info(stream)[0]
    except Exception:  # the stream was destroyed: no capture to keep frees for
        return
    if status != CAPTURE_STATUS_ACTIVE:
        return
    try:
        rec = a.adopt_capture(stream, label=f"capture on stream 0x{stream:x} (pinned)")
        with _lock:
            _adopted[(device, stream)] = rec
    except Exception as exc:
        _warnings.warn(f"graphpool: the pinned pool could not register a capture: {exc}", RuntimeWarning)


def capture_begun(device: int, stream: int) -> None:
    """Graphpool (or a framework hook) began a capture on ``stream``: the pinned pool of
    ``device``, if any, keeps what is freed during it for its graph. Cheap when no pinned
    memory was ever allocated."""
    with _lock:
        _announced.add((device, stream))
    a = _existing(device)
    if a is not None:
        _adopt(a, device, stream)


def capture_ended(device: int, stream: int) -> None:
    """The capture begun on ``stream`` ended (or failed): the pinned pool stops routing to its
    private pool; what it kept stays kept until the graph is destroyed."""
    with _lock:
        _announced.discard((device, stream))
        rec = _adopted.pop((device, stream), None)
    a = _existing(device)
    if rec is not None and a is not None:
        try:
            a.end_adopted(rec)
        except Exception as exc:
            _warnings.warn(f"graphpool: the pinned pool could not end a capture: {exc}", RuntimeWarning)


# ------------------------------------------------------------------ buffers
class PinnedBuffer:
    """``nbytes`` of page-locked host memory at ``ptr``, allocated for work on ``stream``.

    Made by ``gp.alloc_pinned`` only. ``numpy()`` (or ``np.asarray(buf)``, through
    ``__array_interface__``) views the bytes; the view keeps the buffer alive. Freed by
    ``free()``, on leaving a ``with`` block, or when collected; the block is reused only
    once the stream work queued before the free (on ``stream`` and every stream named with
    ``record_stream``) is done, and never while a graph captured during its free lives.
    """

    __slots__ = ("_ptr", "_nbytes", "_stream", "_block", "_alloc", "_host", "_live", "__weakref__")

    def __init__(
        self, block: Any, nbytes: int, stream: Stream, alloc: CachingAllocator, key: object = None
    ) -> None:
        if key is not _KEY:
            raise TypeError(
                "graphpool.PinnedBuffer cannot be made directly; allocate one with "
                "gp.alloc_pinned(nbytes, stream=None)"
            )
        self._ptr: int = 0 if block is None else block.ptr
        self._block = block
        self._nbytes = nbytes
        self._stream = stream
        self._alloc = alloc
        self._host: memoryview | None = None
        self._live = True

    @property
    def ptr(self) -> int:
        """The host address (the one CUDA copies take; 0 for a null buffer). Read-only."""
        return self._ptr

    @property
    def nbytes(self) -> int:
        """How many bytes the buffer owns (what was asked for). Read-only."""
        return self._nbytes

    @property
    def stream(self) -> Stream:
        """The stream the memory was allocated for. Read-only."""
        return self._stream

    @property
    def device(self) -> int:
        """Index of the device whose pinned pool holds it."""
        return self._stream.device

    @property
    def freed(self) -> bool:
        """True once the memory was given back."""
        return not self._live

    def _view(self) -> memoryview:
        if not self._live:
            raise DoubleFreeError(f"pinned buffer at 0x{self._ptr:x} was freed")
        view = self._host
        if view is None:
            dev = self._alloc.device
            assert isinstance(dev, HostMemory)
            view = dev.host_view(self._ptr, self._nbytes)
            self._host = view
        return view

    @property
    def __array_interface__(self) -> dict[str, Any]:
        """NumPy's array interface: ``nbytes`` bytes (uint8) at the memory's host address."""
        import numpy as np

        if self._nbytes == 0:
            if not self._live:
                raise DoubleFreeError("pinned buffer was freed")
            return np.empty(0, np.uint8).__array_interface__
        address = np.frombuffer(self._view(), dtype=np.uint8).ctypes.data
        return {"shape": (self._nbytes,), "typestr": "|u1", "data": (address, False), "version": 3}

    def numpy(self, dtype: Any = "uint8", shape: Any = None) -> np.ndarray:
        """A writable NumPy view of the memory as ``dtype`` (1-D, or ``shape``); it keeps the
        buffer alive (``free()`` still frees it: do not use a view after that)."""
        import numpy as np

        arr: np.ndarray = np.asarray(self).view(dtype)
        return arr if shape is None else arr.reshape(shape)

    def record_stream(self, stream: StreamLike) -> None:
        """``stream`` uses this memory too: its work queued before the free completes before
        the memory is reused."""
        s = as_stream(stream, "record_stream", self.device)
        if s.device != self.device:
            raise ValueError(f"pinned buffer of device {self.device} used by a stream of device {s.device}")
        if not self._live:
            raise DoubleFreeError(f"pinned buffer at 0x{self._ptr:x} was already freed")
        if self._block is not None:
            self._alloc.record_stream(self._block, s.handle)

    def copy_to(self, dst: Any, nbytes: int | None = None, stream: StreamLike | None = None) -> None:
        """Queue a copy of the first ``nbytes`` (default: all) into device memory ``dst`` (an
        address, or any object with ``.ptr``) on ``stream`` (default: the buffer's);
        capturable: a replay copies the buffer's bytes of that moment again."""
        self._copy(dst, nbytes, stream, to_device=True)

    def copy_from(self, src: Any, nbytes: int | None = None, stream: StreamLike | None = None) -> None:
        """Queue a copy of ``nbytes`` (default: the buffer's size) from device memory ``src``
        into this buffer on ``stream`` (default: the buffer's); capturable."""
        self._copy(src, nbytes, stream, to_device=False)

    def _copy(self, other: Any, nbytes: int | None, stream: StreamLike | None, to_device: bool) -> None:
        if not self._live:
            raise DoubleFreeError(f"pinned buffer at 0x{self._ptr:x} was freed")
        n = self._nbytes if nbytes is None else int(nbytes)
        if not 0 <= n <= self._nbytes:
            raise ValueError(f"cannot copy {n} bytes of a pinned buffer of {self._nbytes}")
        s = self._stream if stream is None else as_stream(stream, "copy", self.device)
        if s.device != self.device:
            raise ValueError(f"pinned buffer of device {self.device} copied on a stream of device {s.device}")
        if n == 0:
            return
        address = other if isinstance(other, int) else getattr(other, "ptr", None)
        if not isinstance(address, int) or isinstance(address, bool) or address <= 0:
            what = "dst" if to_device else "src"
            raise TypeError(f"{what} must be a device address or an object with .ptr, not {other!r}")
        ptr = address
        if s.handle != self._stream.handle:
            self.record_stream(s)
        dev = self._alloc.device
        if to_device:
            dev.memcpy_host(ptr, self._ptr, n, s.handle)
        else:
            dev.memcpy_host(self._ptr, ptr, n, s.handle)

    def free(self) -> None:
        """Give the memory back now (reused once its streams' work so far is done). A second
        call raises DoubleFreeError."""
        if not self._live:
            raise DoubleFreeError(f"pinned buffer at 0x{self._ptr:x} was already freed")
        self._live = False  # (``_host`` stays: on the simulator it keeps the bytes of old views)
        if self._block is not None:
            self._alloc.free_owned(self._block)

    def __enter__(self) -> PinnedBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live:
            self.free()

    def __del__(self) -> None:
        try:
            live = self._live
        except AttributeError:
            return
        if live:
            self._live = False
            if self._block is not None:
                self._alloc.defer_free(self._block)

    def __reduce__(self) -> Any:
        raise TypeError("a graphpool PinnedBuffer cannot be pickled: copy its numpy() view instead")

    def __repr__(self) -> str:
        state = "" if self._live else ", freed"
        return f"<graphpool.PinnedBuffer 0x{self._ptr:x}, {self._nbytes} bytes, device {self.device}{state}>"


def alloc_pinned(nbytes: int, stream: StreamLike | None = None) -> PinnedBuffer:
    """``nbytes`` of pinned host memory for copies on ``stream`` (default: the current stream),
    from the pinned pool of that stream's device. 0 gives a null buffer. OutOfMemoryError
    when the host refuses page-locked memory even after the pool's cache was released."""
    if isinstance(nbytes, bool) or not hasattr(nbytes, "__index__"):
        raise TypeError(f"size must be an int number of bytes, not {type(nbytes).__name__}")
    n = int(nbytes.__index__())
    if n < 0:
        raise ValueError(f"cannot allocate a negative number of bytes ({n})")
    s = current_stream() if stream is None else as_stream(stream, "gp.alloc_pinned")
    s._check_backend()
    a = pool(s.device)
    detect = runtime.capture_detection()
    if a.detect != detect:  # gp.set_capture_detection reaches the device pools only
        a.detect = detect
    if n == 0:
        return PinnedBuffer(None, 0, s, a, _KEY)
    try:
        block = a.malloc_owned(n, stream=_key(s.handle))
    except OutOfMemoryError as exc:
        raise OutOfMemoryError(
            f"pinned host memory (device {s.device}'s pinned pool; the figures are host memory): {exc}"
        ) from None
    buf = PinnedBuffer(block, n, s, a, _KEY)
    try:
        a.record_stream(block, s.handle)  # its free waits for this stream's work (docstring)
    except BaseException:
        buf.free()
        raise
    return buf


def pinned_memory_stats(device: object = None) -> dict[str, int]:
    """The pinned pool's statistics, named as ``gp.memory_stats()``'s (host bytes)."""
    return pool(None if device is None else _index(device)).memory_stats()


def pinned_memory_snapshot(device: object = None) -> list[dict[str, Any]]:
    """The pinned pool's segments and blocks, in ``gp.memory_snapshot()``'s layout (each
    segment's ``stream`` is the stream it serves, not the pool's key for it)."""
    segments = pool(None if device is None else _index(device)).snapshot()
    for seg in segments:
        if isinstance(seg.get("stream"), int):
            seg["stream"] = _real(seg["stream"])
    return segments


def empty_pinned_cache(device: object = None) -> None:
    """Give the pinned pool's unsplit free segments back to the host (``cudaFreeHost``), after
    waiting for the events of freed blocks. CaptureError while a capture is underway."""
    try:
        pool(None if device is None else _index(device)).empty_cache()
    except CaptureError as exc:
        raise CaptureError(str(exc).replace("empty_cache()", "empty_pinned_cache()")) from None


__all__ = [
    "HostMemory",
    "PinnedBuffer",
    "alloc_pinned",
    "capture_begun",
    "capture_ended",
    "empty_pinned_cache",
    "pinned_memory_snapshot",
    "pinned_memory_stats",
    "pool",
]


# A guarded signal landing while a pinned block changes hands (made and not yet a PinnedBuffer;
# marked freed and not yet with its pool) is delivered after that code returned (policy/
# interrupts.py, "Handoffs"): this module is Python in both builds.
interrupts.handoff(
    alloc_pinned, PinnedBuffer.__init__, PinnedBuffer.free, PinnedBuffer.__exit__, PinnedBuffer.__del__
)
