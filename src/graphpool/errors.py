"""graphpool's exceptions: one base class and a kind for each way a call can fail.

Every error is raised before any state changes (validate, then mutate), so catching
one leaves the allocator consistent and its memory recoverable.
"""

from __future__ import annotations


class GraphpoolError(Exception):
    """Base class of every error graphpool raises on purpose."""


class OutOfMemoryError(GraphpoolError, MemoryError):
    """The device refused a segment even after the cache was released."""


class CaptureError(GraphpoolError, RuntimeError):
    """A graph capture was misused or failed (wrong stream, invalidated, not captured)."""


class DoubleFreeError(GraphpoolError, ValueError):
    """A pointer inside graphpool's memory was freed while not allocated."""


class ForeignPointerError(GraphpoolError, ValueError):
    """A pointer graphpool never handed out was given back to it, or one it handed out in a
    DeviceBuffer was freed by its address instead of through the buffer."""


class ReplayHazardError(GraphpoolError, RuntimeError):
    """A replay would read or overwrite memory another graph of its pool still needs."""


class BackendReplacedError(GraphpoolError, RuntimeError):
    """An object made under a backend that ``set_backend`` has since replaced was used.

    Its handles and addresses belong to the old backend's devices: using them with the new
    backend would act on the wrong device (on the simulator, silently on other memory).
    """


class BackendUnavailableError(GraphpoolError, RuntimeError):
    """The backend asked for cannot run here (for "cuda": no CUDA driver or GPU found)."""


class IpcError(GraphpoolError, RuntimeError):
    """Memory could not be shared with, or opened from, another process (``buf.ipc_handle()``,
    ``gp.open_ipc``): what cannot be exported, an exporter that is gone, a closed buffer."""


class CUDAError(GraphpoolError, RuntimeError):
    """A CUDA call (real or simulated) failed; ``code`` and ``name`` identify the error."""

    def __init__(self, call: str, code: int, name: str, meaning: str = "") -> None:
        self.call = call
        self.code = code
        self.name = name
        self.meaning = meaning
        text = f"{call} failed: {name} ({code})"
        if meaning:
            text += f": {meaning}"
        super().__init__(text)


class CaptureRefusedError(CUDAError, CaptureError):
    """CUDA refused a call because a graph capture is underway (cudaErrorStreamCapture*).

    Both a ``CUDAError`` (what failed) and a ``CaptureError`` (why): ``hint`` says what to
    do instead, in plain words.
    """

    def __init__(self, error: CUDAError, hint: str) -> None:
        if not isinstance(error, CUDAError) or not isinstance(hint, str):
            raise TypeError("CaptureRefusedError(error, hint) wants the refused CUDAError and a str")
        super().__init__(error.call, error.code, error.name, f"{error.meaning}. {hint}".lstrip(". "))
        self.hint = hint


__all__ = [
    "BackendReplacedError",
    "BackendUnavailableError",
    "CUDAError",
    "CaptureError",
    "CaptureRefusedError",
    "DoubleFreeError",
    "ForeignPointerError",
    "GraphpoolError",
    "IpcError",
    "OutOfMemoryError",
    "ReplayHazardError",
]
