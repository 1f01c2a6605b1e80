"""DeviceBuffer: the handle ``gp.alloc`` returns, owning one allocation.

The buffer frees its memory on ``free()``, on leaving a ``with`` block, or when it is
collected. Its finalizer never raises and never takes the allocator's lock: it queues
the free, which the allocator's next call carries out.

Compiled (setup.py), ``DeviceBuffer`` is a native class and cannot be weakly referenced;
the plain-Python build declares no ``__weakref__`` either, so both behave alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from graphpool.errors import DoubleFreeError

if TYPE_CHECKING:
    from graphpool.policy.allocator import CachingAllocator
    from graphpool.streams import Stream


class DeviceBuffer:
    """``nbytes`` of device memory at ``ptr`` on ``device``, allocated for ``stream``."""

    __slots__ = ("ptr", "nbytes", "stream", "_alloc", "_live")

    ptr: int
    nbytes: int
    stream: Stream

    def __init__(self, ptr: int, nbytes: int, stream: Stream, alloc: CachingAllocator) -> None:
        self.ptr = ptr
        self.nbytes = nbytes
        self.stream = stream
        self._alloc = alloc
        self._live = True

    @property
    def device(self) -> int:
        """Index of the device that holds the memory."""
        return self.stream.device

    @property
    def freed(self) -> bool:
        """True once the memory was given back."""
        return not self._live

    def free(self) -> None:
        """Give the memory back now. A second call raises DoubleFreeError."""
        if not self._live:
            raise DoubleFreeError(f"buffer at 0x{self.ptr:x} was already freed")
        self._live = False
        self._alloc.free_owned(self.ptr)

    def record_stream(self, stream: Stream) -> None:
        """Declare that ``stream`` uses this memory too (docs/behaviour.rst, "Streams")."""
        from graphpool.streams import Stream

        if not isinstance(stream, Stream):
            raise TypeError(f"record_stream needs a graphpool Stream, not {type(stream).__name__}")
        if stream.device != self.device:
            raise ValueError(f"buffer of device {self.device} used by a stream of device {stream.device}")
        if not self._live:
            raise DoubleFreeError(f"buffer at 0x{self.ptr:x} was already freed")
        self._alloc.record_stream(self.ptr, stream.handle)

    def __enter__(self) -> DeviceBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live:
            self.free()

    def __del__(self) -> None:
        if self._live:
            self._live = False
            self._alloc.defer_free(self.ptr)

    def _free_after(self, stream: int) -> None:
        """Queue the free of a buffer that stream handle ``stream`` used too: the block is reused
        only after that stream's work queued so far (``record_stream`` semantics). Lock-free
        and no device call, so it is safe from finalizers and while ``stream`` captures."""
        if self._live:
            self._live = False
            self._alloc.defer_free(self.ptr, stream)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """Version 3 of Numba's CUDA array interface: a 1-D array of ``nbytes`` bytes."""
        if not self._live:
            raise DoubleFreeError(f"buffer at 0x{self.ptr:x} was freed")
        handle = self.stream.handle
        return {
            "shape": (self.nbytes,),
            "typestr": "|u1",
            "data": (self.ptr, False),
            "version": 3,
            "strides": None,
            # 1 names the legacy default stream in this protocol; 0 is not allowed.
            "stream": handle if handle != 0 else 1,
        }

    def __dlpack__(
        self,
        *,
        stream: int | None = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any:
        """Export as a DLPack capsule of ``nbytes`` uint8 values (zero-copy)."""
        from graphpool import dlpack

        return dlpack.export(self, stream=stream, max_version=max_version, dl_device=dl_device, copy=copy)

    def __dlpack_device__(self) -> tuple[int, int]:
        """(kDLCUDA, device index)."""
        return (2, self.device)

    def __repr__(self) -> str:
        state = "" if self._live else ", freed"
        return f"<graphpool.DeviceBuffer 0x{self.ptr:x}, {self.nbytes} bytes, device {self.device}{state}>"
