"""DeviceBuffer: the handle ``gp.alloc`` returns, owning one allocation.

The buffer frees its memory on ``free()``, on leaving a ``with`` block, or when it is
collected. Its finalizer never raises and never takes the allocator's lock: it queues
the free, which the allocator's next call carries out.

Only ``gp.alloc`` makes buffers: the constructor wants a private key, so no caller can
wrap a pointer it does not own (a forged buffer would free someone else's block when
collected). A buffer cannot be copied shallowly or pickled (a second owner of one
pointer would free it twice); ``copy.deepcopy`` makes a real copy, a new allocation on
the same stream with the bytes copied there.

``gp.alloc(0)`` gives a null buffer (``ptr`` 0, ``nbytes`` 0): it holds no memory, and
freeing or collecting it does nothing but mark it freed.

``ptr``, ``nbytes`` and ``stream`` are read-only (the allocation's identity: a buffer whose
``nbytes`` could be changed would export, through ``__cuda_array_interface__`` or DLPack,
memory it does not own). They are properties over private fields in both builds.

Compiled (setup.py), ``DeviceBuffer`` is a native class and cannot be weakly referenced;
the plain-Python build declares no ``__weakref__`` either, so both behave alike. Compiled,
an attribute that ``__init__`` always sets is read without a check, so the finalizer
must never read one of an object whose ``__init__`` failed: ``_live`` is declared
deletable, which makes every read of it checked, and it is set last.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final, cast

from graphpool.errors import DoubleFreeError
from graphpool.policy import interrupts

if TYPE_CHECKING:
    from graphpool.ipc import IpcHandle
    from graphpool.policy.allocator import CachingAllocator
    from graphpool.policy.block import Block
    from graphpool.streams import Stream, StreamLike


_KEY: Final = object()
"""The private key ``DeviceBuffer`` wants: only graphpool.memory holds it."""


def _refuse(what: str) -> TypeError:
    return TypeError(
        f"a graphpool DeviceBuffer cannot be {what}: it owns its allocation, and a second owner "
        "would free it twice. Copy the data with your framework (cupy.copy, torch.clone, "
        "xp_array.copy()), or use copy.deepcopy(buf) for a new buffer holding the same bytes."
    )


class DeviceBuffer:
    """``nbytes`` of device memory at ``ptr`` on ``device``, allocated for ``stream``.

    Made by ``gp.alloc`` only; calling the class raises TypeError.
    """

    __slots__ = ("_ptr", "_nbytes", "_stream", "_block", "_alloc", "_ipc", "_live")
    __deletable__ = ("_live",)  # compiled: reads of _live check that it is set (module docstring)

    _ptr: int
    _nbytes: int
    _stream: Stream
    _ipc: Any  # graphpool.ipc's export record once ipc_handle() shared the buffer, else None

    def __init__(
        self, block: object, nbytes: int, stream: Stream, alloc: CachingAllocator, key: object = None
    ) -> None:
        """``block``: what ``alloc.malloc_owned`` returned (None for a null buffer), kept to
        free the allocation by (no lookup by address). Typed ``object`` so that, compiled, a
        caller without the key gets the TypeError below, not mypyc's."""
        if key is not _KEY:
            raise TypeError(
                "graphpool.DeviceBuffer cannot be made directly; allocate one with "
                "gp.alloc(nbytes, stream=None)"
            )
        b = cast("Block | None", block)
        if b is None:  # a statement, not a conditional expression: compiled, that boxes
            self._ptr = 0
        else:
            self._ptr = b.ptr
        self._block = b
        self._nbytes = nbytes
        self._stream = stream
        self._alloc = alloc
        self._ipc = None
        self._live = True  # last: the finalizer acts only on a fully made buffer

    @property
    def ptr(self) -> int:
        """The device address of the memory (0 for a null buffer). Read-only."""
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
        """Index of the device that holds the memory."""
        return self._stream.device

    @property
    def freed(self) -> bool:
        """True once the memory was given back."""
        return not self._live

    def free(self) -> None:
        """Give the memory back now. A second call raises DoubleFreeError.

        Valid even after ``set_backend``: the buffer goes back to the allocator it came from.
        """
        if not self._live:
            raise DoubleFreeError(f"buffer at 0x{self._ptr:x} was already freed")
        self._live = False
        block = self._block
        if block is not None:  # a null buffer (gp.alloc(0)) holds nothing
            if self._ipc is None:
                self._alloc.free_owned(block)
            else:  # shared with other processes: held until none has it open (graphpool.ipc)
                self._ipc.owner_free(None, True)

    def _check_backend(self) -> None:
        """Raise BackendReplacedError if the backend this buffer was made under was replaced."""
        from graphpool import runtime

        made_in = self._stream._space
        if made_in is not runtime.space():
            raise runtime.replaced(repr(self), made_in)

    def record_stream(self, stream: StreamLike) -> None:
        """Declare that ``stream`` uses this memory too (docs/behaviour.rst, "Streams").

        ``stream`` may be another library's stream (``__cuda_stream__``) of the buffer's device.
        """
        from graphpool.streams import as_stream

        self._check_backend()
        s = as_stream(stream, "record_stream", self.device)
        s._check_backend()
        if s.device != self.device:
            raise ValueError(f"buffer of device {self.device} used by a stream of device {s.device}")
        if not self._live:
            raise DoubleFreeError(f"buffer at 0x{self._ptr:x} was already freed")
        if self._block is not None:
            self._alloc.record_stream(self._block, s.handle)

    def __enter__(self) -> DeviceBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live:
            self.free()

    def __del__(self) -> None:
        try:
            live = self._live
        except AttributeError:  # __init__ failed or never ran: nothing is owned
            return
        if live:
            self._live = False
            if self._block is not None:
                if self._ipc is None:
                    self._alloc.defer_free(self._block)
                else:
                    self._ipc.owner_free(None, False)

    def _free_after(self, stream: int) -> None:
        """Queue the free of a buffer that stream handle ``stream`` used too: the block is reused
        only after that stream's work queued so far (``record_stream`` semantics). Lock-free
        and no device call, so it is safe from finalizers and while ``stream`` captures."""
        if self._live:
            self._live = False
            if self._block is not None:
                if self._ipc is None:
                    self._alloc.defer_free(self._block, stream)
                else:
                    self._ipc.owner_free(stream, False)

    # ------------------------------------------------------------------- IPC
    def ipc_handle(self) -> IpcHandle:
        """A picklable handle that another process opens with ``graphpool.open_ipc`` to map
        this memory (docs/behaviour.rst, "IPC and multiple processes").

        From then on, freeing the buffer keeps its memory from other allocations until no
        process holds it open. Open the handle before freeing the buffer. IpcError for memory
        that cannot be shared (a captured graph's or a MemPool's, an expandable segment's,
        a null buffer)."""
        from graphpool import ipc
        from graphpool.errors import IpcError

        if not self._live:
            raise DoubleFreeError(f"buffer at 0x{self._ptr:x} was freed; there is nothing to share")
        self._check_backend()
        block = self._block
        if block is None:
            raise IpcError("a null buffer (gp.alloc(0)) holds no memory to share")
        entry = self._ipc
        if entry is None:
            entry = ipc.export(self._alloc, block, self.device)
            self._ipc = entry
        return ipc.handle_of(entry, self._nbytes)

    # -------------------------------------------------------- copy and pickle
    def __copy__(self) -> DeviceBuffer:
        raise _refuse("copied with copy.copy")

    def __deepcopy__(self, memo: dict[int, Any]) -> DeviceBuffer:
        """A new buffer on the same stream holding a copy of the bytes (queued on that stream)."""
        if not self._live:
            raise DoubleFreeError(f"buffer at 0x{self._ptr:x} was freed; there is nothing to copy")
        self._check_backend()
        block = self._alloc.malloc_owned(self._nbytes, stream=self._stream.handle) if self._nbytes else None
        out = DeviceBuffer(block, self._nbytes, self._stream, self._alloc, _KEY)
        if self._nbytes:
            self._alloc.device.memcpy(out.ptr, self._ptr, self._nbytes, self._stream.handle)
        memo[id(self)] = out
        return out

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "a graphpool DeviceBuffer cannot be pickled: it is device memory of this process. "
            "Copy it to the host first (e.g. with your framework's .get() or .cpu())."
        )

    def __reduce__(self) -> Any:
        return self.__reduce_ex__(0)

    # ----------------------------------------------------------------- export
    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """Version 3 of Numba's CUDA array interface: a 1-D array of ``nbytes`` bytes."""
        if not self._live:
            raise DoubleFreeError(f"buffer at 0x{self._ptr:x} was freed")
        self._check_backend()
        handle = self._stream.handle
        return {
            "shape": (self._nbytes,),
            "typestr": "|u1",
            "data": (self._ptr, False),
            "version": 3,
            "strides": None,
            # 1 names the legacy default stream in this protocol; 0 is not allowed.
            "stream": handle if handle != 0 else 1,
        }

    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: Any = None,
        dl_device: Any = None,
        copy: Any = None,
    ) -> Any:
        """Export as a DLPack capsule of ``nbytes`` uint8 values (zero-copy).

        The array API's arguments: ``stream`` an int or None, ``max_version`` and
        ``dl_device`` tuples of two ints or None, ``copy`` a bool or None. Typed Any so that,
        compiled, a wrong one gets graphpool.dlpack's TypeError naming it, not mypyc's."""
        from graphpool import dlpack

        self._check_backend()
        return dlpack.export(self, stream=stream, max_version=max_version, dl_device=dl_device, copy=copy)

    def __dlpack_device__(self) -> tuple[int, int]:
        """(kDLCUDA, device index)."""
        return (2, self.device)

    def __repr__(self) -> str:
        state = "" if self._live else ", freed"
        return f"<graphpool.DeviceBuffer 0x{self._ptr:x}, {self._nbytes} bytes, device {self.device}{state}>"


# Plain-Python build: a guarded signal handler waits until these have handed their block on
# (policy/interrupts.py, "Handoffs"): a buffer being made, and a free on its way to the allocator.
interrupts.handoff(
    DeviceBuffer.__init__,
    DeviceBuffer.free,
    DeviceBuffer.__del__,
    DeviceBuffer._free_after,
    DeviceBuffer.__deepcopy__,
)
