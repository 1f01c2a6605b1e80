"""Devices, streams and events of the public API (see docs/api.rst).

Streams are never destroyed: the allocator files free blocks by stream handle, and a
handle reused by a new stream could otherwise inherit blocks whose last use is still
running (PyTorch pools its streams for the same reason).

Streams of other libraries (cuda.core, PyTorch, Numba) are accepted wherever a stream is
taken, through cuda.core's ``__cuda_stream__`` protocol, and CuPy streams by their
``ptr``; ``as_stream`` is the one place that turns them into graphpool Streams.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

from graphpool import routing, runtime
from graphpool.device.protocol import CAPTURE_STATUS_NONE, LEGACY_STREAM, Device
from graphpool.errors import CaptureRefusedError, CUDAError

if TYPE_CHECKING:
    from graphpool.routing import Route

record_listeners: list[Callable[[Event, Stream], None]] = []
"""Called as ``listener(event, stream)`` after ``event`` is recorded on ``stream``.

The replay checker (graphs.py) registers here, so streams need not import graphs: the
import arrows point one way (as with the stream followers of ``graphpool.routing``)."""

wait_listeners: list[Callable[[Stream, Event], None]] = []
"""Called as ``listener(stream, event)`` after ``stream`` is made to wait for ``event``."""
sync_listeners: list[Callable[[int, int | None, Event | None], None]] = []
"""Called as ``listener(device, handle, event)`` after the host waited: for the work queued so
far on stream ``handle`` of ``device`` (``Stream.synchronize``), on every stream of the device
(``synchronize``: handle None), or for ``event`` (``Event.synchronize``: handle None)."""


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


class CUDAStreamLike(Protocol):
    """A stream object of another library, by cuda.core's ``__cuda_stream__`` protocol:
    ``__cuda_stream__()`` returns ``(0, handle)``, the protocol version and the stream's
    ``cudaStream_t`` as an int (cuda.core, PyTorch and Numba streams have it)."""

    def __cuda_stream__(self) -> tuple[int, int]: ...


ACCEPTED = (
    "a graphpool Stream, a CuPy stream or a stream object with the __cuda_stream__ protocol "
    "(cuda.core, PyTorch, Numba)"
)
"""What every call taking a stream accepts, for its TypeError."""

CU_STREAM_LEGACY = 1
CU_STREAM_PER_THREAD = 2
"""CUDA's special handles for the legacy and the per-thread default stream (cuda.core hands
them out for a device's default stream)."""


class Stream:
    """A non-blocking stream on one device. ``handle`` is the driver's stream (an int).

    ``__cuda_stream__`` hands it to cuda.core and any library of that protocol.
    """

    __slots__ = ("device", "handle", "_space", "_source", "_home", "__weakref__")

    device: int
    handle: int
    _space: object
    """The handle space (``runtime.Runtime.space``) of the backend the stream was made under."""
    _source: object
    """The other library's stream object this one wraps (``as_stream``), kept alive with it:
    a buffer allocated on it keeps its handle from being destroyed and reused. None if none."""
    _home: Route | None
    """Where ``gp.alloc(n, self)`` allocates (a routing.Route), kept by its first call; None until."""

    def __init__(self, device: int | None = None) -> None:
        index = _index(device)
        rt = runtime.get()
        self.device = index
        self.handle = rt.device(index).create_stream()
        self._space = rt.space
        self._source = None
        self._home = None

    @classmethod
    def _wrap(cls, device: int, handle: int) -> Stream:
        s = cls.__new__(cls)
        s.device = device
        s.handle = handle
        s._space = runtime.space()
        s._source = None
        s._home = None
        return s

    def __cuda_stream__(self) -> tuple[int, int]:
        """cuda.core's stream protocol: ``(0, handle)`` (version 0, the ``cudaStream_t``)."""
        return (0, self.handle)

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
        for listener in sync_listeners:
            listener(self.device, self.handle, None)

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

    def wait_stream(self, other: StreamLike) -> None:
        """Make later work on this stream wait for the work queued on ``other`` so far.

        ``other`` may be another library's stream (``__cuda_stream__``) of this stream's device.
        """
        other = as_stream(other, "wait_stream", self.device)
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

    def record(self, stream: StreamLike | None = None) -> None:
        """Mark the work queued so far on ``stream`` (default: the current stream; another
        library's stream, ``__cuda_stream__``, of the event's device is taken too)."""
        s = current_stream(self.device) if stream is None else as_stream(stream, "record", self.device)
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
        for listener in sync_listeners:
            listener(self.device, None, self)

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
    routing.invalidate()
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
    """Make ``s`` the current stream of its device on this thread, and of the frameworks that
    follow graphpool's (``routing.add_follower``)."""
    if not isinstance(s, Stream):
        raise TypeError(f"expected a graphpool Stream, not {type(s).__name__}")
    s._check_backend()
    tls = runtime.thread_state()
    tls.streams[s.device] = s
    routing.invalidate()
    for follower in routing.followers():
        follower.follow(s)


@contextlib.contextmanager
def stream(s: StreamLike | None) -> Iterator[Stream | None]:
    """Make ``s`` the current stream (and its device the current device) inside the block.

    ``s`` may be another library's stream (``__cuda_stream__``) of the current device: the
    block then allocates on it, and ``as`` gives its graphpool Stream.
    """
    if s is None:
        yield None
        return
    s = as_stream(s, "gp.stream")
    s._check_backend()
    prev_device = current_device()
    prev_stream = current_stream(s.device)
    # Each follower's own stream, given back on exit: graphpool may not know it (inside
    # ``with cupy.cuda.Stream():`` graphpool's previous stream is the legacy default, and
    # following that would leave CuPy on ``Stream.null`` for the rest of the user's block).
    saved = [(f, f.save(s.device)) for f in routing.followers()]
    if s.device != prev_device:
        set_device(s.device)
    set_stream(s)
    try:
        yield s
    finally:
        if prev_stream._space is runtime.space():
            set_stream(prev_stream)
        # else set_backend ran inside the block: the thread's streams started over already
        for follower, state in saved:
            if state is not None and follower in routing.followers():  # (else removed meanwhile)
                follower.restore(state, s.device)
        if s.device != prev_device:
            set_device(prev_device)


StreamLike: TypeAlias = Stream | CUDAStreamLike
"""A graphpool Stream, or another library's stream by the ``__cuda_stream__`` protocol."""


def cuda_stream_handle(obj: object) -> int:
    """The handle ``obj.__cuda_stream__()`` gives; TypeError unless it returns ``(0, handle)``
    with ``handle`` a non-negative int (version 0 of cuda.core's protocol)."""
    method = getattr(obj, "__cuda_stream__", None)
    if method is None or not callable(method):
        raise TypeError(f"expected {ACCEPTED}, not {type(obj).__name__}")
    got = method()
    if type(got) is tuple and len(got) == 2:  # the common answer, checked without the messages
        version, handle = got
        if type(version) is int and version == 0 and type(handle) is int and handle >= 0:
            return handle
    name = f"{type(obj).__name__}.__cuda_stream__()"
    if not isinstance(got, tuple) or len(got) != 2:
        raise TypeError(f"{name} returned {got!r}: the protocol wants a tuple (version, handle)")
    version, handle = got
    if isinstance(version, bool) or not isinstance(version, int) or version != 0:
        raise TypeError(
            f"{name} returned protocol version {version!r}: graphpool knows version 0 of the "
            "__cuda_stream__ protocol"
        )
    if isinstance(handle, bool) or not isinstance(handle, int) or handle < 0:
        raise TypeError(
            f"{name} returned handle {handle!r}: the protocol wants the stream's cudaStream_t as an int"
        )
    return int(handle)


def _is_cupy_stream(obj: object) -> bool:
    """Whether ``obj`` is a CuPy ``Stream`` or ``ExternalStream`` (CuPy already imported by the
    program; graphpool never imports it for this)."""
    cuda = getattr(sys.modules.get("cupy"), "cuda", None)
    kinds = tuple(
        k
        for k in (getattr(cuda, "Stream", None), getattr(cuda, "ExternalStream", None))
        if isinstance(k, type)
    )
    return bool(kinds) and isinstance(obj, kinds)


def resolve_handle(handle: int, what: str, name: str) -> int:
    """Another library's stream ``handle`` as graphpool files blocks under it, for the call
    ``what`` on the stream ``name`` (both for the message).

    CUDA's legacy default stream handle (1) is graphpool's legacy stream. The per-thread
    default stream (2) is refused with ValueError: its handle names a different stream on
    each thread, so blocks filed under it would be reused across threads with no ordering.
    Every entry point that takes a stream handle from another library goes through here.
    """
    if handle == CU_STREAM_LEGACY:
        return LEGACY_STREAM
    if handle == CU_STREAM_PER_THREAD:
        raise ValueError(
            f"{what}: {name} is CUDA's per-thread default stream, which graphpool cannot tell "
            "apart between threads; use a stream of your own (e.g. gp.Stream()) or the legacy "
            "default stream"
        )
    return handle


def as_stream(obj: object, what: str, device: int | None = None) -> Stream:
    """``obj`` as a graphpool Stream, for the call ``what`` (for messages).

    A graphpool Stream is returned as is. An object of the ``__cuda_stream__`` protocol, or
    a CuPy stream (its ``ptr``; CuPy may not have the protocol), is wrapped on ``device``
    (default: the current device), whose context it must belong to (ValueError
    otherwise); the wrapper keeps it alive. CUDA's legacy default stream
    handle means graphpool's legacy stream; the per-thread default stream is refused (its
    handle names a different stream on each thread). Anything else: TypeError saying what
    is accepted.
    """
    if isinstance(obj, Stream):
        return obj
    if getattr(obj, "__cuda_stream__", None) is not None:
        handle = cuda_stream_handle(obj)
    elif _is_cupy_stream(obj):
        handle = int(obj.ptr)  # type: ignore[attr-defined]
    else:
        raise TypeError(f"{what} takes {ACCEPTED}, not {type(obj).__name__}")
    handle = resolve_handle(handle, what, type(obj).__name__)
    index = _index(device)
    rt = runtime.get()
    if not rt.device(index).owns_stream(handle):
        raise ValueError(
            f"{what}: {type(obj).__name__} stream 0x{handle:x} is not a live stream of device "
            f"{index}'s context on the {rt.name} backend; graphpool allocates on a stream of "
            "the device it serves: make that device current (gp.device(i)) or use a stream made on it"
        )
    s = Stream._wrap(index, handle)
    s._source = obj
    return s


def synchronize(device: int | None = None) -> None:
    """Wait until all work on ``device`` (default: current) is done."""
    index = _index(device)
    _unsafe("synchronize the device", runtime.get().device(index).device_synchronize)
    for listener in sync_listeners:
        listener(index, None, None)


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
