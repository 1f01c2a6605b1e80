"""CUDA error names, codes and meanings the simulator raises, and one helper to raise them.

Codes and names are CUDA's own, so a test written against the simulator reads the same
failures as one run on a GPU.
"""

from __future__ import annotations

from graphpool.errors import CUDAError

ERRORS: dict[str, tuple[int, str]] = {
    "cudaErrorInvalidValue": (1, "invalid argument"),
    "cudaErrorInvalidDevice": (101, "invalid device ordinal"),
    "cudaErrorInvalidContext": (201, "invalid device context"),
    "cudaErrorMapBufferObjectFailed": (205, "mapping of buffer object failed"),
    "cudaErrorInvalidResourceHandle": (400, "invalid resource handle"),
    "cudaErrorIllegalState": (
        401,
        "the operation cannot be performed in the present state",
    ),
    "cudaErrorIllegalAddress": (700, "an illegal memory access was encountered"),
    "cudaErrorStreamCaptureUnsupported": (
        900,
        "operation not permitted when stream is capturing",
    ),
    "cudaErrorStreamCaptureInvalidated": (
        901,
        "operation failed due to a previous error during capture",
    ),
    "cudaErrorStreamCaptureMerge": (
        902,
        "operation would result in a merge of separate capture sequences",
    ),
    "cudaErrorStreamCaptureUnjoined": (
        904,
        "capture sequence contains a fork that was not joined to the primary stream",
    ),
    "cudaErrorStreamCaptureIsolation": (
        905,
        "dependency created on uncaptured work in another stream",
    ),
    "cudaErrorCapturedEvent": (
        907,
        "operation not permitted on an event last recorded in a capturing stream",
    ),
    "cudaErrorStreamCaptureWrongThread": (
        908,
        "attempt to terminate a thread-local capture sequence from another thread",
    ),
}


def cuda_error(call: str, name: str, detail: str = "") -> CUDAError:
    """The CUDAError for ``call`` failing with CUDA error ``name`` (``raise cuda_error(...)``)."""
    code, meaning = ERRORS[name]
    if detail:
        meaning = f"{meaning} ({detail})"
    return CUDAError(call, code, name, meaning)
