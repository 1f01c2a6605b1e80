"""Devices, streams and events of the public API (see docs/api.rst).

Streams are never destroyed: the allocator files free blocks by stream handle, and a
handle reused by a new stream could otherwise inherit blocks whose last use is still
running (PyTorch pools its streams for the same reason).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

from graphpool import runtime
from graphpool.device.protocol import CAPTURE_STATUS_NONE, LEGACY_STREAM, Device
from graphpool.errors import CaptureRefusedError, CUDAError

record_listeners: list[Callable[[Event, Stream], None]] = []
"""Called as ``listener(event, stream)`` after ``event`` is recorded on ``stream``.

The replay checker (graphs.py) registers here, so streams need not import graphs: the
import arrows point one way (as with ``runtime.stream_listeners``)."""

wait_listeners: list[Callable[[Stream, Event], None]] = []
"""Called as ``listener(stream, event)`` after ``stream`` is made to wait for ``event``."""


def _index(device: Any) -> int:
    """The device index ``device`` names: None is the current device, a Stream its device."""
    rt = runtime.get()
    if device is None:
        return runtime.thread_state().device
    if isinstance(device, Stream):
        return device.device
    if type(device) is not int:
        if isinstance(device, bool) or not hasattr(device, "__index__"):
            raise TypeError(
                f"device must be a device index (an int from 0 to {rt.count - 1}) or None for the "
                f"current device, not {type(device).__name__} {device!r}"
            )
        device = int(device.__index__())  # a numpy integer
    index = int(device)
    rt.check_index(index)
    return index


def _no_pickle(what: str) -> TypeError:
    return TypeError(
        f"a graphpool {what} cannot be pickled: its handle is valid in this process only. "
        f"Make a new {what} where it is needed."
    )


class Stream:
    """A non-blocking stream on one device. ``handle`` is the driver's stream (an int)."""

    __slots__ = ("device", "handle", "_space", "__weakref__")

    device: int
    handle: int
    _space: object
    """The handle space (``runtime.Runtime.space``) of the backend the stream was made under."""

    def __init__(self, device: int | None = None) -> None:
        index = _index(device)
        rt = runtime.get()
        self.device = index
        self.handle = rt.device(index).create_stream()
        self._space = rt.space

    @classmethod
    def _wrap(cls, device: int, handle: int) -> Stream:
        s = cls.__new__(cls)
        s.device = device
        s.handle = handle
        s._space = runtime.space()
        return s

    def _check_backend(self) -> None:
        """Raise BackendReplacedError if the backend this stream was made under was replaced."""
        if self._space is not runtime.space():
            raise runtime.replaced(repr(self), self._space)

    def _dev(self) -> Device:
        rt = runtime.get()
        if self._space is not rt.space:
            raise runtime.replaced(repr(self), self._space)
        return rt.device(self.device)

    def synchronize(self) -> None:
        """Wait until all work queued on this stream is done."""
        _unsafe("synchronize a stream", self._dev().stream_synchronize, self.handle)

    def wait_event(self, event: Event) -> None:
        """Make later work on this stream wait for ``event``."""
        if not isinstance(event, Event):
            raise TypeError(f"wait_event needs a graphpool Event, not {type(event).__name__}")
        dev = self._dev()
        event._check_backend()
        # CUDA lets a stream wait on an event of another device: the waiting stream's device
        # makes the call.
        dev.stream_wait_event(self.handle, event.handle)
        for listener in wait_listeners:
            listener(self, event)

    def wait_stream(self, other: Stream) -> None:
        """Make later work on this stream wait for the work queued on ``other`` so far."""
        if not isinstance(other, Stream):
            raise TypeError(f"wait_stream needs a graphpool Stream, not {type(other).__name__}")
        self._check_backend()
        other._check_backend()
        if other == self:
            return
        self.wait_event(other.record_event())

    def record_event(self, event: Event | None = None) -> Event:
        """Record ``event`` (a new one by default) on this stream and return it."""
        if event is not None and not isinstance(event, Event):
            raise TypeError(f"record_event needs a graphpool Event or None, not {type(event).__name__}")
        self._check_backend()
        e = Event(device=self.device) if event is None else event
        e.record(self)
        return e

    def query_capturing(self) -> bool:
        """True when this stream is being captured into a graph."""
        return self._dev().capture_info(self.handle)[0] != CAPTURE_STATUS_NONE

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stream) and other.device == self.device and other.handle == self.handle

    def __hash__(self) -> int:
        return hash((self.device, self.handle))

    def __copy__(self) -> Stream:
        return self  # a stream is a handle: a copy would name the same stream

    def __deepcopy__(self, memo: dict[int, Any]) -> Stream:
        return self

    def __reduce__(self) -> Any:
        raise _no_pickle("Stream")

    def __repr__(self) -> str:
        return f"<graphpool.Stream device={self.device} handle=0x{self.handle:x}>"


class Event:
    """A (timing-disabled) event on one device."""

    __slots__ = ("device", "handle", "clock", "_space", "_dev", "__weakref__")

    def __init__(self, device: int | None = None) -> None:
        index = _index(device)
        rt = runtime.get()
        dev = rt.device(index)
        self.device = index
        self.handle = dev.create_event()
        self.clock: dict[tuple[int, int], int] | None = None
        self._space = rt.space
        self._dev = dev  # the finalizer destroys the event where it was made

    def _check_backend(self) -> None:
        """Raise BackendReplacedError if the backend this event was made under was replaced."""
        if self._space is not runtime.space():
            raise runtime.replaced(repr(self), self._space)

    def record(self, stream: Stream | None = None) -> None:
        """Mark the work queued so far on ``stream`` (default: the current stream)."""
        s = current_stream(self.device) if stream is None else stream
        if not isinstance(s, Stream):
            raise TypeError(f"record needs a graphpool Stream, not {type(s).__name__}")
        self._check_backend()
        s._check_backend()
        if s.device != self.device:
            raise ValueError(f"event of device {self.device} recorded on a stream of device {s.device}")
        runtime.get().device(self.device).record_event(self.handle, s.handle)
        for listener in record_listeners:
            listener(self, s)

    def query(self) -> bool:
        """True when the recorded work is done."""
        self._check_backend()
        return bool(_unsafe("query an event", runtime.get().device(self.device).query_event, self.handle))

    def synchronize(self) -> None:
        """Wait until the recorded work is done."""
        self._check_backend()
        _unsafe("synchronize an event", runtime.get().device(self.device).event_synchronize, self.handle)

    def __copy__(self) -> Event:
        raise TypeError(
            "a graphpool Event cannot be copied: it owns its CUDA event, which would be destroyed "
            "twice. Record a new Event instead (stream.record_event())."
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> Event:
        return self.__copy__()

    def __reduce__(self) -> Any:
        raise _no_pickle("Event")

    def __del__(self) -> None:
        try:
            self._dev.destroy_event(self.handle)
        except Exception:  # finalizers never raise (nor does one of an event whose __init__ failed)
            pass

    def __repr__(self) -> str:
        return f"<graphpool.Event device={self.device} handle=0x{self.handle:x}>"


def device_count() -> int:
    """Number of devices of the current backend."""
    return runtime.get().count


def current_device() -> int:
    """This thread's current device index."""
    return runtime.current_device_index()


def set_device(index: int) -> None:
    """Make ``index`` this thread's current device."""
    rt = runtime.get()
    rt.check_index(index)
    tls = runtime.thread_state()
    tls.device = index
    tls.hot = None
    rt.backend.set_current_device(index)


@contextlib.contextmanager
def device(index: int) -> Iterator[None]:
    """Make ``index`` the current device inside the block."""
    prev = current_device()
    set_device(index)
    try:
        yield
    finally:
        set_device(prev)


def default_stream(device: int | None = None) -> Stream:
    """The legacy default stream of ``device`` (handle 0)."""
    return Stream._wrap(_index(device), LEGACY_STREAM)


def current_stream(device: int | None = None) -> Stream:
    """This thread's current stream on ``device`` (the default stream unless set)."""
    tls = runtime.thread_state()
    index = tls.device if device is None else _index(device)
    s = tls.streams.get(index)
    if s is None:
        s = tls.streams[index] = Stream._wrap(index, LEGACY_STREAM)
    return s


def set_stream(s: Stream) -> None:
    """Make ``s`` the current stream of its device on this thread, and tell listeners."""
    if not isinstance(s, Stream):
        raise TypeError(f"expected a graphpool Stream, not {type(s).__name__}")
    s._check_backend()
    tls = runtime.thread_state()
    tls.streams[s.device] = s
    tls.hot = None
    for listener in runtime.stream_listeners:
        listener(s)


@contextlib.contextmanager
def stream(s: Stream | None) -> Iterator[Stream | None]:
    """Make ``s`` the current stream (and its device the current device) inside the block."""
    if s is None:
        yield None
        return
    if not isinstance(s, Stream):
        raise TypeError(f"gp.stream needs a graphpool Stream, not {type(s).__name__}")
    s._check_backend()
    prev_device = current_device()
    prev_stream = current_stream(s.device)
    cupy_prev = _cupy_current_stream(s.device)
    if s.device != prev_device:
        set_device(s.device)
    set_stream(s)
    try:
        yield s
    finally:
        if prev_stream._space is runtime.space():
            set_stream(prev_stream)
        # else set_backend ran inside the block: the thread's streams started over already
        if cupy_prev is not None:
            _cupy_restore_stream(cupy_prev, s.device)
        if s.device != prev_device:
            set_device(prev_device)


def _cupy_current_stream(device: int) -> Any:
    """CuPy's current stream of ``device`` while graphpool is CuPy's allocator, else None.

    ``gp.stream`` makes CuPy follow graphpool's stream on entry; on exit it must give CuPy
    back the stream CuPy had, which graphpool may not know: inside ``with
    cupy.cuda.Stream():`` graphpool's own previous stream is the legacy default, and
    following that would leave CuPy on ``Stream.null`` for the rest of the user's block.
    """
    mod = sys.modules.get("graphpool.cupy")
    if mod is None or not mod.is_installed() or runtime.get().name != "cuda":
        return None
    cp = mod._cp
    with cp.cuda.Device(device):
        return cp.cuda.get_current_stream()


def _cupy_restore_stream(cs: Any, device: int) -> None:
    """Make ``cs`` CuPy's current stream of ``device`` again (see _cupy_current_stream)."""
    mod = sys.modules.get("graphpool.cupy")
    if mod is None or not mod.is_installed():
        return
    with mod._cp.cuda.Device(device):
        cs.use()


def synchronize(device: int | None = None) -> None:
    """Wait until all work on ``device`` (default: current) is done."""
    _unsafe("synchronize the device", runtime.get().device(_index(device)).device_synchronize)


_CAPTURE_REFUSALS = (
    "cudaErrorStreamCaptureUnsupported",
    "cudaErrorStreamCaptureImplicit",
    "cudaErrorStreamCaptureInvalidated",
)


def _unsafe(what: str, call: Any, *args: Any) -> Any:
    """Make a call CUDA prohibits during capture; say why in plain words when it is refused."""
    try:
        return call(*args)
    except CUDAError as exc:
        if exc.name not in _CAPTURE_REFUSALS:
            raise
        raise CaptureRefusedError(
            exc,
            f"graphpool: cannot {what} while a graph capture is underway. A capture in "
            "capture_error_mode='global' (the default) forbids every thread to synchronize, "
            "query events or allocate device memory outside graphpool, and this call "
            "invalidated it; a 'thread_local' capture forbids it on its own thread. Capture "
            "with capture_error_mode='thread_local' or 'relaxed' to let other threads "
            "synchronize, or wait until capture_end().",
        ) from exc


def is_current_stream_capturing() -> bool:
    """True when this thread's current stream is being captured into a graph."""
    return current_stream().query_capturing()
