"""The CUDA device's ``vmm_unmap`` wait, run against a fake runtime (no GPU needed): the stream it
synchronizes is one ``create_stream`` made and nobody destroys while it is asked about and
waited for (a query or a wait on a destroyed handle is undefined behaviour in CUDA; a query of
one crashed the process on an H200), and any other stream gets a device synchronize."""

from __future__ import annotations

import threading
import types
from typing import Any

import pytest

from graphpool.device import cuda

S, OTHER = 0x5000, 0x6000


class _Runtime:
    """The runtime calls ``vmm_unmap`` and ``destroy_stream`` make, recording them; a stream
    destroyed before a call that names it fails the test (in CUDA: undefined behaviour)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.destroyed: set[int] = set()
        self.during_wait: Any = None  # run inside cudaStreamSynchronize (another thread's destroy)

    def cudaGetDevice(self) -> tuple[int, int]:
        return 0, 0

    def cudaStreamSynchronize(self, stream: int) -> tuple[int]:
        assert stream not in self.destroyed, "cudaStreamSynchronize of a destroyed stream"
        self.calls.append(("cudaStreamSynchronize", stream))
        if self.during_wait is not None:
            self.during_wait()
        return (0,)

    def cudaDeviceSynchronize(self) -> tuple[int]:
        self.calls.append(("cudaDeviceSynchronize", 0))
        return (0,)

    def cudaStreamDestroy(self, stream: int) -> tuple[int]:
        self.destroyed.add(stream)
        self.calls.append(("cudaStreamDestroy", stream))
        return (0,)


def _device(rt: _Runtime, monkeypatch: pytest.MonkeyPatch, capturing: set[int]) -> cuda.CudaDevice:
    """A CudaDevice made without CUDA: ``S`` made by it, the capture query answered from
    ``capturing`` (and refusing a destroyed stream), unmapping recorded."""
    monkeypatch.setattr(cuda, "_rt", rt)
    d = object.__new__(cuda.CudaDevice)
    d.index = 0
    d._made = {S}
    d._made_lock = threading.RLock()
    d._prop = object()
    driver = types.SimpleNamespace()
    d._vmm = lambda: (driver, d._prop)  # type: ignore[method-assign]

    def unmap_granules(drv: Any, va: int, nbytes: int) -> Any:
        rt.calls.append(("cuMemUnmap", va))
        return 0

    d._unmap_granules = unmap_granules  # type: ignore[method-assign,assignment]
    d.exchange_capture_mode = lambda mode: 0  # type: ignore[method-assign]

    def capture_id(stream: int) -> int:
        assert stream not in rt.destroyed, "capture query of a destroyed stream"
        return 7 if stream in capturing else 0

    d.capture_id = capture_id  # type: ignore[method-assign]
    return d


@pytest.mark.parametrize(
    ("stream", "capturing", "wait"),
    [
        (S, set(), ("cudaStreamSynchronize", S)),
        (S, {S}, ("cudaDeviceSynchronize", 0)),  # capturing: not its stream synchronize
        (OTHER, set(), ("cudaDeviceSynchronize", 0)),  # not made here: never passed to CUDA
        (0, set(), ("cudaDeviceSynchronize", 0)),  # the legacy stream
        (None, set(), ("cudaDeviceSynchronize", 0)),
    ],
)
def test_vmm_unmap_waits_for_a_made_streams_work_else_the_devices(
    monkeypatch: pytest.MonkeyPatch, stream: int | None, capturing: set[int], wait: tuple[str, int]
) -> None:
    rt = _Runtime()
    d = _device(rt, monkeypatch, capturing)
    d.vmm_unmap(0x1000, 4096, stream)
    assert rt.calls == [wait, ("cuMemUnmap", 0x1000)]


def test_vmm_unmap_keeps_its_stream_from_a_concurrent_destroy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another thread destroys the stream while ``vmm_unmap`` asks about it and waits for it:
    the destroy waits until the wait is over (as ``stream_idle`` holds the same lock across
    its check and query), so no call names a destroyed handle."""
    rt = _Runtime()
    d = _device(rt, monkeypatch, set())
    destroyer = threading.Thread(target=d.destroy_stream, args=(S,))
    real_query = d.capture_id

    def query_then_destroy(stream: int) -> int:
        answer = real_query(stream)
        destroyer.start()  # between the query and the wait
        destroyer.join(0.2)  # (blocked on the lock when it is held, as it must be)
        return answer

    d.capture_id = query_then_destroy  # type: ignore[method-assign]
    d.vmm_unmap(0x1000, 4096, S)
    destroyer.join(5)
    assert not destroyer.is_alive()
    assert rt.calls == [
        ("cudaStreamSynchronize", S),
        ("cudaStreamDestroy", S),
        ("cuMemUnmap", 0x1000),
    ] or rt.calls == [
        ("cudaStreamSynchronize", S),
        ("cuMemUnmap", 0x1000),
        ("cudaStreamDestroy", S),
    ]


def test_the_guarded_stream_calls_pass_cuda_only_streams_the_device_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``stream_capturing`` and ``stream_synchronize_made`` (which the out-of-memory retry calls
    instead of a device synchronize) answer from ``_made`` for any other handle, never asking
    CUDA; a made stream is asked about (and waited for where it is not capturing)."""
    rt = _Runtime()
    d = _device(rt, monkeypatch, {S})
    assert d.made_streams_capturing() is True
    assert d.stream_capturing(S) is True
    assert d.stream_synchronize_made(S) is False  # capturing: left alone
    assert d.stream_capturing(OTHER) is None and d.stream_capturing(0) is None
    assert d.stream_synchronize_made(OTHER) is False and d.stream_synchronize_made(0) is False
    assert rt.calls == []
    d2 = _device(rt, monkeypatch, set())
    assert d2.made_streams_capturing() is False
    assert d2.stream_capturing(S) is False
    assert d2.stream_synchronize_made(S) is True
    assert rt.calls == [("cudaStreamSynchronize", S)]


def _lock_free_elsewhere(d: Any) -> bool:
    """Whether another thread can take the device's made-streams lock now (it lets go at once)."""
    got: list[bool] = []

    def try_lock() -> None:
        ok = d._made_lock.acquire(blocking=False)
        if ok:
            d._made_lock.release()
        got.append(ok)

    t = threading.Thread(target=try_lock)
    t.start()
    t.join(5)
    return got == [True]


def test_the_wait_holds_the_made_streams_lock_throughout(monkeypatch: pytest.MonkeyPatch) -> None:
    """``stream_synchronize_made`` (and so ``vmm_unmap``) holds the lock that ``destroy_stream``
    takes across the check, the capture query and cudaStreamSynchronize itself: another thread
    cannot take it while the wait runs. (The race test above depends on thread scheduling: a
    wait made after the lock is released passes it unless the destroyer runs first.)"""
    rt = _Runtime()
    d = _device(rt, monkeypatch, set())
    others: list[bool] = []

    def during_wait() -> None:
        others.append(_lock_free_elsewhere(d))

    rt.during_wait = during_wait
    assert d.stream_synchronize_made(S) is True
    d.vmm_unmap(0x1000, 4096, S)
    assert others == [False, False], "another thread could take the lock during the wait"


def test_the_capture_query_holds_the_made_streams_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    """``stream_capturing`` and ``stream_synchronize_made`` ask the capture query with the lock
    held: no other thread destroys the stream between the check and the query."""
    rt = _Runtime()
    d = _device(rt, monkeypatch, set())
    real_query = d.capture_id
    others: list[bool] = []

    def query(stream: int) -> int:
        others.append(_lock_free_elsewhere(d))
        return real_query(stream)

    d.capture_id = query  # type: ignore[method-assign]
    assert d.stream_capturing(S) is False
    assert d.stream_synchronize_made(S) is True
    assert others == [False, False], "another thread could take the lock during the query"
