"""Simulator fidelity: every CUDA rule the simulated device claims, checked through the Device
protocol alone, so the same test runs on the simulator and, marked gpu, against CUDA itself.

A test here fails when the simulator stops enforcing its rule (each one was checked against
a simulator broken by hand: tests/mutation/handmade.py), and on the GPU it checks that the
rule is CUDA's. The rules (docs/behaviour.rst, "The simulated device"; graphpool/sim):

* memory is finite: an allocation or a mapping past it is refused (None / False), not raised;
* ``free`` and ``vmm_unmap`` (of any mapped granules) wait for all queued work first
  (cudaFree synchronizes; graphpool's CUDA device synchronizes before cuMemUnmap);
* a stream runs its work in order; ``stream_wait_event`` orders another stream after it; an
  event never recorded stands for no work; a destroyed stream's queued work still runs;
* ``stream_idle`` is True only for a live stream the device made, not capturing, with no
  work left: never for the legacy stream, a handle made elsewhere or a destroyed stream, and
  asking never disturbs a capture;
* capture: the legacy stream cannot capture or join a capture; a stream cannot capture
  twice; ids are unique and shared by the streams that joined; a stream joins by waiting on
  an event recorded in the capture, and every stream that joined must be joined back before
  the end (a captured event marks the capture as it was when recorded); two captures never
  merge; a capture never waits on work outside it; only the stream that began a capture ends
  it, on its own thread unless relaxed;
* capture modes: in "global" mode an unsafe call (allocation, free, event query, any
  synchronize, instantiation) from any thread in global thread mode fails and invalidates
  the capture, in "thread_local" only from the capturing thread, on any device (the rules
  are the process's); a thread in relaxed mode is never refused, but synchronizing the
  device while one of its streams captures (so ``vmm_unmap`` too), synchronizing the
  capturing stream itself, or copying between it and the host, is illegal in every mode;
  ``capture_info`` is legal at any time; an invalidated capture stays in capture mode until
  ended, and ending it fails;
* events recorded in a capture cannot be queried, even after it ended (cudaErrorCapturedEvent);
  synchronizing one during the capture fails (cudaErrorInvalidValue) and invalidates it;
* graphs replay their work on the same addresses (an empty capture gives a graph of no
  nodes); launches of one executable run in launch order, whatever their streams; a graph
  launched into a capture is refused (cudaErrorStreamCaptureUnsupported);
* user objects (``attach_release``): a token is reported once, when the graph and every
  executable instance are destroyed, an executable's in-flight launches included, or at
  once when the capture fails.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

import graphpool as gp
from gpu_guard import TOO_FEW_GPUS, cuda_unusable
from graphpool import runtime
from graphpool.device.protocol import (
    CAPTURE_MODE_GLOBAL,
    CAPTURE_MODE_RELAXED,
    CAPTURE_MODE_THREAD_LOCAL,
    CAPTURE_STATUS_ACTIVE,
    CAPTURE_STATUS_INVALIDATED,
    CAPTURE_STATUS_NONE,
    LEGACY_STREAM,
)
from graphpool.errors import CUDAError
from graphpool.policy.private_pools import new_release_token
from graphpool.sim import SimBackend

MiB = 1024 * 1024
GLOBAL, THREAD_LOCAL, RELAXED = CAPTURE_MODE_GLOBAL, CAPTURE_MODE_THREAD_LOCAL, CAPTURE_MODE_RELAXED
MODES = {"global": GLOBAL, "thread_local": THREAD_LOCAL, "relaxed": RELAXED}
N = MiB


@dataclass
class Dev:
    """The device under test, and what it made (given back at the end)."""

    kind: str
    d: Any  # a graphpool.device.protocol.Device
    spin: Callable[[int], None]  # queue long-running work on a stream handle
    foreign: Callable[[], int]  # a live stream handle this device object did not make
    streams: list[int] = field(default_factory=list)
    events: list[int] = field(default_factory=list)
    ptrs: list[int] = field(default_factory=list)
    keep: list[Any] = field(default_factory=list)
    other: Any = None  # the simulator's second device (CUDA: runtime.get().device(1))

    def stream(self) -> int:
        h = int(self.d.create_stream())
        self.streams.append(h)
        return h

    def event(self) -> int:
        e = int(self.d.create_event())
        self.events.append(e)
        return e

    def malloc(self, nbytes: int = N) -> int:
        p = self.d.malloc(nbytes)
        assert p is not None
        self.ptrs.append(p)
        return int(p)

    def wait_released(self, token: int, seconds: float = 10.0) -> list[int]:
        """Every token reported until ``token`` is: CUDA reports from a driver thread, a while
        after the release; the simulator at once (asked once)."""
        got: list[int] = list(self.d.take_released())
        deadline = time.monotonic() + (seconds if self.kind == "cuda" else 0.0)
        while token not in got and time.monotonic() < deadline:
            time.sleep(0.01)
            got += self.d.take_released()
        return got


def _cuda_spin(handle: int) -> None:
    from graphpool.tools.benchkit import cuda_spin

    cuda_spin(gp.Stream._wrap(0, handle))


def _cupy_foreign(keep: list[Any]) -> Callable[[], int]:
    def make() -> int:
        import cupy

        s = cupy.cuda.Stream(non_blocking=True)  # made by CuPy, not by graphpool's device
        keep.append(s)
        return int(s.ptr)

    return make


@pytest.fixture(params=["sim", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request: pytest.FixtureRequest) -> Iterator[Dev]:
    keep: list[Any] = []
    if request.param == "cuda":
        reason = cuda_unusable()
        if reason is not None:
            pytest.skip(reason)
        pytest.importorskip("cupy")
        if runtime.get().name != "cuda":
            gp.set_backend("cuda")
        d = runtime.get().device(0)
        dev = Dev("cuda", d, _cuda_spin, _cupy_foreign(keep), keep=keep)
    else:
        backend = SimBackend(device_count=2, memory_bytes=64 * MiB)
        d = backend.get_device(0)
        other = backend.get_device(1)
        dev = Dev("sim", d, lambda h: d.launch_sleep(h, rounds=50), other.create_stream, other=other)
    d.exchange_capture_mode(GLOBAL)
    try:
        yield dev
    finally:
        d.exchange_capture_mode(GLOBAL)
        for s in dev.streams:
            if d.capture_info(s)[0] != CAPTURE_STATUS_NONE:
                _end_quietly(d, s)
        d.device_synchronize()
        for p in dev.ptrs:
            d.free(p)
        for e in dev.events:
            d.destroy_event(e)
        for s in dev.streams:  # (tests destroy only streams they did not file here)
            d.destroy_stream(s)
        d.take_released()


def _end_quietly(d: Any, stream: int) -> None:
    try:
        d.destroy_graph(d.end_capture(stream))
    except CUDAError:
        pass


def _fails(fn: Callable[[], object], name: str | None = None) -> CUDAError:
    """Run ``fn``, expecting a CUDAError (named ``name``, if given)."""
    with pytest.raises(CUDAError) as info:
        fn()
    if name is not None:
        assert info.value.name == name, str(info.value)
    return info.value


def _in_thread(fn: Callable[[], object]) -> BaseException | None:
    box: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            box.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return box[0] if box else None


def _status(d: Any, stream: int) -> int:
    return int(d.capture_info(stream)[0])


# =========================================================================== memory
def test_memory_is_finite(device: Dev) -> None:
    d = device.d
    free, total = d.mem_info()
    assert d.malloc(total + 2 * MiB) is None  # refused, not raised
    gran = d.vmm_granularity()
    size = -(-(total + gran) // gran) * gran
    va = d.vmm_reserve(size)
    try:
        assert d.vmm_map(va, size) is False
    finally:
        d.vmm_release(va, size)
    # What an allocation takes is gone for the next one. (Free memory need not drop by the
    # exact size on CUDA: the driver may place a small allocation in pages it already holds.)
    free = d.mem_info()[0]
    half = free // 2 // gran * gran
    p = device.malloc(half)
    assert d.mem_info()[0] <= free - half // 2 and d.mem_info()[1] == total
    assert d.malloc(free - half // 2) is None  # would fit, were the half not taken
    assert p % 512 == 0


def test_free_waits_for_the_queued_work(device: Dev) -> None:
    d = device.d
    s = device.stream()
    p = d.malloc(N)
    e = device.event()
    device.spin(s)
    d.memset(p, 3, N, s)
    d.record_event(e, s)
    assert d.query_event(e) is False  # still running
    d.free(p)  # cudaFree synchronizes: the memset ran first
    assert d.query_event(e) is True


def test_vmm_unmap_waits_for_the_queued_work(device: Dev) -> None:
    d = device.d
    gran = d.vmm_granularity()
    s = device.stream()
    va = d.vmm_reserve(2 * gran)
    try:
        assert d.vmm_map(va, 2 * gran) is True
        e = device.event()
        device.spin(s)
        d.memset(va + gran, 5, gran, s)  # queued behind long work, into the granule unmapped below
        d.record_event(e, s)
        assert d.query_event(e) is False
        d.vmm_unmap(va + gran, gran)
        assert d.query_event(e) is True, "unmapped while work queued on the memory still ran"
        d.memset(va, 6, gran, s)  # the granule still mapped is usable
        assert d.read(va, 4, s) == bytes([6]) * 4
        d.vmm_unmap(va, gran)
    finally:
        d.device_synchronize()
        d.vmm_release(va, 2 * gran)


def test_vmm_unmap_given_a_stream_waits_for_it_and_spares_a_capture_elsewhere(device: Dev) -> None:
    """``vmm_unmap(va, n, stream)`` of a stream the device made waits for that stream's work
    (a stream synchronize, under the relaxed capture mode), so a global-mode capture underway
    on another stream stays valid; without a stream it would synchronize the device, which
    invalidates the capture (the allocator's out-of-memory retry unmaps this way)."""
    d = device.d
    gran = d.vmm_granularity()
    s, other = device.stream(), device.stream()
    va = d.vmm_reserve(gran)
    graph = None
    try:
        assert d.vmm_map(va, gran) is True
        e = device.event()
        device.spin(s)
        d.memset(va, 5, gran, s)  # queued behind long work, into the granule unmapped below
        d.record_event(e, s)
        d.begin_capture(other, GLOBAL)
        prev = d.exchange_capture_mode(RELAXED)  # as the allocator calls it
        try:
            d.vmm_unmap(va, gran, s)
            done = d.query_event(e)
        finally:
            d.exchange_capture_mode(prev)
        assert done is True, "unmapped while work queued on the memory still ran"
        assert d.capture_info(other)[0] == CAPTURE_STATUS_ACTIVE, "the capture elsewhere was invalidated"
        graph = d.end_capture(other)
    finally:
        if graph is not None:
            d.destroy_graph(graph)
        elif d.capture_info(other)[0]:
            _end_quietly(d, other)
        d.device_synchronize()
        d.vmm_release(va, gran)


@pytest.mark.parametrize("mode", ["global", "relaxed"])
def test_vmm_unmap_given_a_capturing_stream_waits_for_the_device_which_the_capture_refuses(
    device: Dev, mode: str
) -> None:
    """A stream that is capturing cannot be synchronized: ``vmm_unmap`` given one waits for the
    whole device instead (graphpool's CUDA device: cudaDeviceSynchronize), which is illegal
    while the stream captures, in every mode: the unmap fails, nothing is unmapped, and the
    capture is invalidated. The allocator must not unmap a capturing stream's memory."""
    d = device.d
    gran = d.vmm_granularity()
    s = device.stream()
    va = d.vmm_reserve(gran)
    try:
        assert d.vmm_map(va, gran) is True
        d.begin_capture(s, MODES[mode])
        prev = d.exchange_capture_mode(RELAXED)  # as the allocator calls it
        try:
            _fails(lambda: d.vmm_unmap(va, gran, s), "cudaErrorStreamCaptureUnsupported")
        finally:
            d.exchange_capture_mode(prev)
        assert _status(d, s) == CAPTURE_STATUS_INVALIDATED
        _fails(lambda: d.end_capture(s), "cudaErrorStreamCaptureInvalidated")
        d.memset(va, 1, gran, s)  # still mapped: the refused unmap left it
        assert d.read(va, 4, s) == bytes([1]) * 4
    finally:
        if _status(d, s) != CAPTURE_STATUS_NONE:
            _end_quietly(d, s)
        d.device_synchronize()
        d.vmm_unmap(va, gran)
        d.vmm_release(va, gran)


def test_the_guarded_stream_calls_ask_only_streams_the_device_made(device: Dev) -> None:
    """``stream_synchronize_made`` waits for a stream the device made that is not capturing
    (True), and leaves alone a capturing one (its capture stays valid), the legacy stream and
    a stream made elsewhere (False); ``stream_capturing`` answers for the device's own streams
    (True, False) and None for the others, which it never passes to CUDA."""
    d = device.d
    s, cap = device.stream(), device.stream()
    foreign = device.foreign()
    e = device.event()
    device.spin(s)
    d.record_event(e, s)
    graph = None
    try:
        assert d.stream_capturing(s) is False
        assert d.stream_capturing(LEGACY_STREAM) is None and d.stream_capturing(foreign) is None
        gone = d.create_stream()
        device.spin(gone)
        d.destroy_stream(gone)  # a destroyed stream, its work still queued: never asked either
        assert d.stream_capturing(gone) is None and d.stream_synchronize_made(gone) is False
        if device.other is not None:  # another device's stream
            o = device.other.create_stream()
            try:
                assert d.stream_capturing(o) is None and d.stream_synchronize_made(o) is False
            finally:
                device.other.destroy_stream(o)
        assert d.made_streams_capturing() is False
        d.begin_capture(cap, GLOBAL)
        prev = d.exchange_capture_mode(RELAXED)  # as the allocator calls them
        try:
            assert d.stream_capturing(cap) is True
            assert d.made_streams_capturing() is True
            assert d.stream_synchronize_made(cap) is False
            assert d.stream_synchronize_made(LEGACY_STREAM) is False
            assert d.stream_synchronize_made(foreign) is False
            assert d.stream_synchronize_made(s) is True
            done = d.query_event(e)
        finally:
            d.exchange_capture_mode(prev)
        assert done is True, "stream_synchronize_made returned before the stream's work finished"
        assert d.capture_info(cap)[0] == CAPTURE_STATUS_ACTIVE, "the capture was invalidated"
        graph = d.end_capture(cap)
    finally:
        if graph is not None:
            d.destroy_graph(graph)
        elif d.capture_info(cap)[0]:
            _end_quietly(d, cap)


# =========================================================================== ordering
def test_a_stream_waiting_on_an_event_runs_after_the_recorded_work(device: Dev) -> None:
    d = device.d
    s1, s2 = device.stream(), device.stream()
    p = device.malloc()
    e = device.event()
    device.spin(s1)
    d.memset(p, 1, N, s1)  # after long work on s1 ...
    d.record_event(e, s1)
    d.stream_wait_event(s2, e)
    d.memset(p, 2, N, s2)  # ... and this one after it
    assert d.read(p, N, s2) == bytes([2]) * N
    assert d.query_event(e) is True


def test_an_event_never_recorded_stands_for_no_work(device: Dev) -> None:
    d = device.d
    s = device.stream()
    e = device.event()
    assert d.query_event(e) is True
    d.event_synchronize(e)
    device.spin(s)
    d.stream_wait_event(s, e)  # waits for nothing
    d.device_synchronize()


def test_an_event_on_a_busy_stream_completes_with_its_work(device: Dev) -> None:
    d = device.d
    s = device.stream()
    e = device.event()
    device.spin(s)
    d.record_event(e, s)
    assert d.query_event(e) is False
    d.event_synchronize(e)
    assert d.query_event(e) is True
    assert d.stream_idle(s) is True


def test_a_destroyed_streams_queued_work_still_runs(device: Dev) -> None:
    d = device.d
    s = d.create_stream()
    p = device.malloc()
    d.memset(p, 0, N, s)
    device.spin(s)
    d.memset(p, 9, N, s)
    d.destroy_stream(s)  # work queued on it still runs, as in CUDA (its handle is never used again)
    d.device_synchronize()
    assert d.read(p, N, LEGACY_STREAM) == bytes([9]) * N


# =========================================================================== stream_idle
def test_stream_idle_only_for_a_live_idle_stream_the_device_made(device: Dev) -> None:
    d = device.d
    s = device.stream()
    assert d.stream_idle(s) is True
    device.spin(s)
    assert d.stream_idle(s) is False  # work left
    d.stream_synchronize(s)
    assert d.stream_idle(s) is True
    assert d.stream_idle(LEGACY_STREAM) is False  # never the legacy stream
    assert d.stream_idle(device.foreign()) is False  # nor a stream made elsewhere
    gone = d.create_stream()
    assert d.stream_idle(gone) is True
    d.destroy_stream(gone)
    assert d.stream_idle(gone) is False  # nor a destroyed one (no error either)


@pytest.mark.parametrize("mode", ["global", "thread_local", "relaxed"])
def test_stream_idle_is_false_for_a_capturing_stream_and_disturbs_no_capture(device: Dev, mode: str) -> None:
    d = device.d
    s, other = device.stream(), device.stream()
    d.begin_capture(s, MODES[mode])
    try:
        assert d.stream_idle(s) is False  # no work queued, but capturing
        assert d.stream_idle(other) is True  # asking about another stream is legal too
        assert _status(d, s) == CAPTURE_STATUS_ACTIVE
    finally:
        d.destroy_graph(d.end_capture(s))  # not invalidated
    assert d.stream_idle(s) is True


def test_a_stream_that_joined_a_capture_is_not_idle(device: Dev) -> None:
    d = device.d
    s, side = device.stream(), device.stream()
    fork, join = device.event(), device.event()
    d.begin_capture(s, GLOBAL)
    try:
        d.record_event(fork, s)
        d.stream_wait_event(side, fork)
        assert d.stream_idle(side) is False
        d.record_event(join, side)
        d.stream_wait_event(s, join)
    finally:
        d.destroy_graph(d.end_capture(s))
    assert d.stream_idle(side) is True


# =========================================================================== capture
def test_the_legacy_stream_cannot_capture(device: Dev) -> None:
    d = device.d
    _fails(lambda: d.begin_capture(LEGACY_STREAM, GLOBAL))
    assert d.capture_info(LEGACY_STREAM) == (CAPTURE_STATUS_NONE, 0)


def test_a_stream_cannot_begin_a_second_capture(device: Dev) -> None:
    d = device.d
    s = device.stream()
    d.begin_capture(s, GLOBAL)
    try:
        _fails(lambda: d.begin_capture(s, GLOBAL), "cudaErrorIllegalState")
    finally:
        _end_quietly(d, s)
    assert _status(d, s) == CAPTURE_STATUS_NONE


def test_capture_ids_are_unique_and_shared_by_joined_streams(device: Dev) -> None:
    d = device.d
    s1, s2, side = device.stream(), device.stream(), device.stream()
    assert d.capture_info(s1) == (CAPTURE_STATUS_NONE, 0) and d.capture_id(s1) == 0
    fork, join = device.event(), device.event()
    d.begin_capture(s1, RELAXED)
    d.begin_capture(s2, RELAXED)
    try:
        (st1, id1), (st2, id2) = d.capture_info(s1), d.capture_info(s2)
        assert st1 == st2 == CAPTURE_STATUS_ACTIVE and id1 and id2 and id1 != id2
        assert d.capture_id(s1) == id1
        d.record_event(fork, s1)
        d.stream_wait_event(side, fork)  # side joins s1's capture
        assert d.capture_info(side) == (CAPTURE_STATUS_ACTIVE, id1) and d.capture_id(side) == id1
        d.record_event(join, side)
        d.stream_wait_event(s1, join)
    finally:
        d.destroy_graph(d.end_capture(s1))
        d.destroy_graph(d.end_capture(s2))
    assert d.capture_info(side) == (CAPTURE_STATUS_NONE, 0)
    d.begin_capture(s1, RELAXED)
    try:
        assert d.capture_id(s1) not in (0, id1, id2)  # never reused
    finally:
        d.destroy_graph(d.end_capture(s1))


def test_a_joined_fork_captures_both_streams_and_replays(device: Dev) -> None:
    d = device.d
    s, side = device.stream(), device.stream()
    p, q = device.malloc(), device.malloc()
    fork, join = device.event(), device.event()
    d.begin_capture(s, GLOBAL)
    try:
        d.memset(p, 4, N, s)
        d.record_event(fork, s)
        d.stream_wait_event(side, fork)
        d.memset(q, 5, N, side)
        d.record_event(join, side)
        d.stream_wait_event(s, join)
    except BaseException:
        _end_quietly(d, s)
        raise
    graph = d.end_capture(s)
    assert _status(d, s) == _status(d, side) == CAPTURE_STATUS_NONE
    assert d.graph_node_count(graph) >= 2
    exe = d.instantiate(graph)
    try:
        d.memset(p, 0, N, s)
        d.memset(q, 0, N, s)
        d.launch(exe, s)  # the same addresses again
        assert d.read(p, N, s) == bytes([4]) * N and d.read(q, N, s) == bytes([5]) * N
    finally:
        d.device_synchronize()
        d.destroy_graph_exec(exe)
        d.destroy_graph(graph)


def test_only_the_stream_that_began_a_capture_ends_it(device: Dev) -> None:
    d = device.d
    s, side = device.stream(), device.stream()
    fork, join = device.event(), device.event()
    d.begin_capture(s, GLOBAL)
    try:
        d.record_event(fork, s)
        d.stream_wait_event(side, fork)
        d.record_event(join, side)
        d.stream_wait_event(s, join)
        _fails(lambda: d.end_capture(side))  # joined, not begun there
    finally:
        _end_quietly(d, s)
    assert _status(d, s) == _status(d, side) == CAPTURE_STATUS_NONE


@pytest.mark.parametrize("after", ["no join", "work after the join"])
def test_an_unjoined_fork_fails_the_capture(device: Dev, after: str) -> None:
    d = device.d
    s, side = device.stream(), device.stream()
    p = device.malloc()
    fork, join = device.event(), device.event()
    d.begin_capture(s, GLOBAL)
    d.record_event(fork, s)
    d.stream_wait_event(side, fork)
    if after == "work after the join":
        d.memset(p, 1, N, side)
        d.record_event(join, side)
        d.stream_wait_event(s, join)
    d.memset(p, 2, N, side)  # never joined back
    _fails(lambda: d.end_capture(s), "cudaErrorStreamCaptureUnjoined")
    assert _status(d, s) == _status(d, side) == CAPTURE_STATUS_NONE


def test_a_captured_event_marks_the_capture_as_it_was_when_recorded(device: Dev) -> None:
    """side records an event, then works: the origin waiting on that event does not wait for
    the later work, so the fork is unjoined (the event must not follow the stream's later
    work, as a structure shared with the stream would)."""
    d = device.d
    s, side = device.stream(), device.stream()
    p = device.malloc()
    fork, early = device.event(), device.event()
    d.begin_capture(s, GLOBAL)
    d.record_event(fork, s)
    d.stream_wait_event(side, fork)
    d.memset(p, 1, N, side)
    d.record_event(early, side)
    d.memset(p, 2, N, side)  # after the record
    d.stream_wait_event(s, early)
    _fails(lambda: d.end_capture(s), "cudaErrorStreamCaptureUnjoined")
    assert _status(d, s) == _status(d, side) == CAPTURE_STATUS_NONE


def test_the_legacy_stream_cannot_join_a_capture(device: Dev) -> None:
    d = device.d
    s = device.stream()
    e = device.event()
    d.begin_capture(s, RELAXED)
    try:
        d.record_event(e, s)
        _fails(lambda: d.stream_wait_event(LEGACY_STREAM, e))
        assert d.capture_info(LEGACY_STREAM) == (CAPTURE_STATUS_NONE, 0)
    finally:
        _end_quietly(d, s)


def test_two_captures_never_merge(device: Dev) -> None:
    d = device.d
    s1, s2 = device.stream(), device.stream()
    e = device.event()
    d.begin_capture(s1, RELAXED)
    d.begin_capture(s2, RELAXED)
    try:
        assert d.capture_info(s2)[1] != d.capture_info(s1)[1]  # (CUDA: id 0 once invalidated)
        d.record_event(e, s1)
        _fails(lambda: d.stream_wait_event(s2, e))
        assert _status(d, s2) == CAPTURE_STATUS_INVALIDATED
    finally:
        _end_quietly(d, s2)
        _end_quietly(d, s1)


def test_a_capture_never_waits_on_work_outside_it(device: Dev) -> None:
    d = device.d
    s, eager = device.stream(), device.stream()
    e = device.event()
    device.spin(eager)
    d.record_event(e, eager)
    d.begin_capture(s, GLOBAL)
    try:
        _fails(lambda: d.stream_wait_event(s, e))
        assert _status(d, s) == CAPTURE_STATUS_INVALIDATED
    finally:
        _fails(lambda: d.end_capture(s), "cudaErrorStreamCaptureInvalidated")
    assert _status(d, s) == CAPTURE_STATUS_NONE


def test_ending_a_capture_that_was_not_begun_fails(device: Dev) -> None:
    d = device.d
    s = device.stream()
    _fails(lambda: d.end_capture(s), "cudaErrorIllegalState")
    _fails(lambda: d.end_capture(LEGACY_STREAM))


@pytest.mark.parametrize("mode", ["global", "thread_local"])
def test_only_the_capturing_thread_ends_a_capture_unless_relaxed(device: Dev, mode: str) -> None:
    d = device.d
    s = device.stream()
    d.begin_capture(s, MODES[mode])
    err = _in_thread(lambda: d.end_capture(s))
    assert isinstance(err, CUDAError) and err.name == "cudaErrorStreamCaptureWrongThread"
    assert _status(d, s) == CAPTURE_STATUS_NONE  # ended all the same, without a graph
    d.begin_capture(s, RELAXED)
    box: list[int] = []
    assert _in_thread(lambda: box.append(d.end_capture(s))) is None
    d.destroy_graph(box[0])


# ------------------------------------------------------------- capture modes and unsafe calls
def _unsafe_calls(device: Dev) -> dict[str, Callable[[], object]]:
    d = device.d
    other = device.stream()
    p = device.malloc()
    e = device.event()

    def free() -> None:
        d.free(p)
        device.ptrs.remove(p)

    return {
        "malloc": lambda: device.ptrs.append(d.malloc(N)),
        "free": free,
        "query_event": lambda: d.query_event(e),
        "event_synchronize": lambda: d.event_synchronize(e),
        "stream_synchronize": lambda: d.stream_synchronize(other),
        "device_synchronize": d.device_synchronize,
    }


UNSAFE = ["malloc", "free", "query_event", "event_synchronize", "stream_synchronize", "device_synchronize"]


@pytest.mark.parametrize("call", UNSAFE)
def test_an_unsafe_call_in_a_global_capture_fails_and_invalidates_it(device: Dev, call: str) -> None:
    d = device.d
    calls = _unsafe_calls(device)
    s = device.stream()
    d.begin_capture(s, GLOBAL)
    try:
        _fails(calls[call], "cudaErrorStreamCaptureUnsupported")
        assert _status(d, s) == CAPTURE_STATUS_INVALIDATED  # still in capture mode: "capturing"
    finally:
        _fails(lambda: d.end_capture(s), "cudaErrorStreamCaptureInvalidated")
    assert _status(d, s) == CAPTURE_STATUS_NONE


@pytest.mark.parametrize("call", [c for c in UNSAFE if c != "device_synchronize"])
@pytest.mark.parametrize("mode", ["global", "thread_local"])
def test_a_thread_in_relaxed_mode_may_make_unsafe_calls(device: Dev, call: str, mode: str) -> None:
    d = device.d
    calls = _unsafe_calls(device)
    s = device.stream()
    d.begin_capture(s, MODES[mode])
    try:
        assert d.exchange_capture_mode(RELAXED) == GLOBAL
        try:
            calls[call]()
        finally:
            assert d.exchange_capture_mode(GLOBAL) == RELAXED
        assert _status(d, s) == CAPTURE_STATUS_ACTIVE
    finally:
        d.destroy_graph(d.end_capture(s))


@pytest.mark.parametrize("mode", ["global", "thread_local", "relaxed"])
def test_synchronizing_the_device_fails_in_every_mode_while_a_stream_captures(device: Dev, mode: str) -> None:
    """cudaDeviceSynchronize waits for the capturing stream too: illegal even when relaxed."""
    d = device.d
    s = device.stream()
    d.begin_capture(s, MODES[mode])
    try:
        d.exchange_capture_mode(RELAXED)
        try:
            _fails(d.device_synchronize, "cudaErrorStreamCaptureUnsupported")
        finally:
            d.exchange_capture_mode(GLOBAL)
        assert _status(d, s) == CAPTURE_STATUS_INVALIDATED
    finally:
        _fails(lambda: d.end_capture(s), "cudaErrorStreamCaptureInvalidated")
    d.device_synchronize()  # legal again


@pytest.mark.parametrize(("mode", "refused"), [("global", True), ("thread_local", False), ("relaxed", False)])
def test_another_threads_unsafe_call_is_refused_only_by_a_global_capture(
    device: Dev, mode: str, refused: bool
) -> None:
    d = device.d
    s = device.stream()
    got: list[int | None] = []
    d.begin_capture(s, MODES[mode])
    try:
        err = _in_thread(lambda: got.append(d.malloc(N)))  # that thread's mode: global
        if refused:
            assert isinstance(err, CUDAError) and err.name == "cudaErrorStreamCaptureUnsupported"
            assert _status(d, s) == CAPTURE_STATUS_INVALIDATED
        else:
            assert err is None and got and got[0] is not None
            device.ptrs.append(int(got[0]))
            assert _status(d, s) == CAPTURE_STATUS_ACTIVE
    finally:
        if refused:
            _fails(lambda: d.end_capture(s), "cudaErrorStreamCaptureInvalidated")
        else:
            d.destroy_graph(d.end_capture(s))


def test_capture_modes_are_per_thread(device: Dev) -> None:
    d = device.d
    assert d.exchange_capture_mode(RELAXED) == GLOBAL
    try:
        seen: list[int] = []
        assert _in_thread(lambda: seen.append(d.exchange_capture_mode(THREAD_LOCAL))) is None
        assert seen == [GLOBAL]  # the other thread's own mode
    finally:
        assert d.exchange_capture_mode(GLOBAL) == RELAXED


@pytest.mark.parametrize("mode", ["global", "thread_local", "relaxed"])
def test_synchronizing_the_capturing_stream_is_illegal_in_every_mode(device: Dev, mode: str) -> None:
    d = device.d
    s = device.stream()
    d.begin_capture(s, MODES[mode])
    d.exchange_capture_mode(RELAXED)  # not a refusal of this thread's unsafe calls: the stream's own
    try:
        _fails(lambda: d.stream_synchronize(s))
        assert _status(d, s) == CAPTURE_STATUS_INVALIDATED
    finally:
        d.exchange_capture_mode(GLOBAL)
        _fails(lambda: d.end_capture(s), "cudaErrorStreamCaptureInvalidated")


def test_capture_queries_are_legal_during_a_global_capture(device: Dev) -> None:
    d = device.d
    s, other = device.stream(), device.stream()
    d.begin_capture(s, GLOBAL)
    try:
        for _ in range(3):
            assert d.capture_info(s)[0] == CAPTURE_STATUS_ACTIVE
            assert d.capture_info(other) == (CAPTURE_STATUS_NONE, 0)
            assert d.capture_id(s) == d.capture_info(s)[1]
            assert d.capture_id(other) == 0
        assert _status(d, s) == CAPTURE_STATUS_ACTIVE
    finally:
        d.destroy_graph(d.end_capture(s))


def test_instantiating_during_a_global_capture_is_refused(device: Dev) -> None:
    d = device.d
    s, t = device.stream(), device.stream()
    d.begin_capture(t, RELAXED)
    graph = d.end_capture(t)
    d.begin_capture(s, GLOBAL)
    try:
        _fails(lambda: d.instantiate(graph))
        assert _status(d, s) == CAPTURE_STATUS_INVALIDATED
    finally:
        _end_quietly(d, s)
        d.destroy_graph(graph)


# ------------------------------------------------------------- events in captures
def test_an_event_recorded_in_a_capture_cannot_be_queried(device: Dev) -> None:
    d = device.d
    s = device.stream()
    e = device.event()
    d.begin_capture(s, GLOBAL)
    try:
        d.record_event(e, s)
        d.exchange_capture_mode(RELAXED)
        try:
            _fails(lambda: d.query_event(e), "cudaErrorCapturedEvent")
        finally:
            d.exchange_capture_mode(GLOBAL)
        assert _status(d, s) == CAPTURE_STATUS_INVALIDATED  # the query cost the capture (H200)
    finally:
        _fails(lambda: d.end_capture(s), "cudaErrorStreamCaptureInvalidated")
    _fails(lambda: d.query_event(e), "cudaErrorInvalidValue")  # after the failed capture's end (H200)
    d.record_event(e, s)  # recorded eagerly again: an ordinary event
    d.event_synchronize(e)
    assert d.query_event(e) is True


def test_synchronizing_an_event_recorded_in_a_capture_fails_and_invalidates_it(device: Dev) -> None:
    d = device.d
    s = device.stream()
    e = device.event()
    d.begin_capture(s, GLOBAL)
    try:
        d.record_event(e, s)
        d.exchange_capture_mode(RELAXED)
        try:
            _fails(lambda: d.event_synchronize(e), "cudaErrorCapturedEvent")
        finally:
            d.exchange_capture_mode(GLOBAL)
        assert _status(d, s) == CAPTURE_STATUS_INVALIDATED
    finally:
        _fails(lambda: d.end_capture(s), "cudaErrorStreamCaptureInvalidated")


def test_an_empty_capture_gives_a_graph_of_no_nodes(device: Dev) -> None:
    d = device.d
    s = device.stream()
    d.begin_capture(s, GLOBAL)
    graph = d.end_capture(s)
    assert d.graph_node_count(graph) == 0
    exe = d.instantiate(graph)
    d.launch(exe, s)
    d.stream_synchronize(s)
    d.destroy_graph_exec(exe)
    d.destroy_graph(graph)


def test_launches_of_one_executable_run_in_launch_order_on_any_stream(device: Dev) -> None:
    """A launch waits for the executable's previous launch, whatever its stream: the second
    launch, on an idle stream, completes only after the first one, queued behind long work,
    has started (so after the event recorded just before it)."""
    d = device.d
    s1, s2 = device.stream(), device.stream()
    p = device.malloc()
    d.begin_capture(s1, GLOBAL)
    d.memset(p, 7, N, s1)
    graph = d.end_capture(s1)
    exe = d.instantiate(graph)
    before, after = device.event(), device.event()
    try:
        device.spin(s1)
        d.record_event(before, s1)
        d.launch(exe, s1)
        d.launch(exe, s2)
        d.record_event(after, s2)
        d.event_synchronize(after)
        assert d.query_event(before) is True, "a second launch ran before the first"
    finally:
        d.device_synchronize()
        d.destroy_graph_exec(exe)
        d.destroy_graph(graph)


@pytest.mark.parametrize("call", ["write", "read"])
def test_a_host_copy_on_the_capturing_stream_is_refused(device: Dev, call: str) -> None:
    d = device.d
    s = device.stream()
    p = device.malloc()
    d.begin_capture(s, GLOBAL)
    d.exchange_capture_mode(RELAXED)  # the stream's own rule, not the thread's
    try:
        if call == "write":
            _fails(lambda: d.write(p, b"\x01" * 64, s))
        else:
            _fails(lambda: d.read(p, 64, s))
        assert _status(d, s) == CAPTURE_STATUS_INVALIDATED
    finally:
        d.exchange_capture_mode(GLOBAL)
        _fails(lambda: d.end_capture(s), "cudaErrorStreamCaptureInvalidated")


@pytest.mark.parametrize("call", ["malloc", "device_synchronize"])
def test_capture_rules_are_process_wide(device: Dev, call: str) -> None:
    """A global capture on device 0 refuses an unsafe call made for device 1 (CUDA keeps the
    capture state per process, not per device): an allocation, or a synchronize of device 1,
    which has no capture of its own to refuse it."""
    if device.kind == "cuda":
        if gp.device_count() < 2:
            pytest.skip(f"{TOO_FEW_GPUS} needs two devices")
        other = runtime.get().device(1)
    else:
        other = device.other
    d = device.d
    s = device.stream()
    d.begin_capture(s, GLOBAL)
    try:
        unsafe = (lambda: other.malloc(N)) if call == "malloc" else other.device_synchronize
        _fails(unsafe, "cudaErrorStreamCaptureUnsupported")
        assert _status(d, s) == CAPTURE_STATUS_INVALIDATED
    finally:
        _fails(lambda: d.end_capture(s), "cudaErrorStreamCaptureInvalidated")


def test_a_graph_cannot_be_launched_into_a_capture(device: Dev) -> None:
    d = device.d
    s, t = device.stream(), device.stream()
    p = device.malloc()
    d.begin_capture(t, GLOBAL)
    d.memset(p, 8, N, t)
    inner = d.end_capture(t)
    inner_exe = d.instantiate(inner)
    try:
        d.memset(p, 0, N, s)
        d.begin_capture(s, GLOBAL)
        try:
            _fails(lambda: d.launch(inner_exe, s), "cudaErrorStreamCaptureUnsupported")
            assert _status(d, s) != CAPTURE_STATUS_NONE
        finally:
            _end_quietly(d, s)
        assert d.read(p, N, s) == bytes(N)  # not run either
    finally:
        d.device_synchronize()
        d.destroy_graph_exec(inner_exe)
        d.destroy_graph(inner)


# ------------------------------------------------------------- user objects
def _captured_with_token(device: Dev, s: int) -> tuple[int, int]:
    """A graph captured on ``s`` (one memset) holding a new token; (graph, token)."""
    d = device.d
    p = device.malloc()
    token = new_release_token()
    d.begin_capture(s, GLOBAL)
    try:
        d.attach_release(s, token)
        d.memset(p, 1, N, s)
    except BaseException:
        _end_quietly(d, s)
        raise
    return d.end_capture(s), token


def test_a_token_is_released_once_the_graph_and_every_instance_are_gone(device: Dev) -> None:
    d = device.d
    s = device.stream()
    d.take_released()
    graph, token = _captured_with_token(device, s)
    e1, e2 = d.instantiate(graph), d.instantiate(graph)
    d.launch(e1, s)
    d.device_synchronize()
    d.destroy_graph(graph)
    d.destroy_graph_exec(e1)
    time.sleep(0.05 if device.kind == "cuda" else 0)
    assert token not in d.take_released()  # e2 still holds it
    d.destroy_graph_exec(e2)
    got = device.wait_released(token)
    assert got.count(token) == 1
    assert token not in device.wait_released(token, seconds=0.1)  # reported once


def test_a_failed_capture_releases_its_token_at_its_end(device: Dev) -> None:
    d = device.d
    s = device.stream()
    d.take_released()
    token = new_release_token()
    d.begin_capture(s, GLOBAL)
    d.attach_release(s, token)
    _fails(lambda: d.stream_synchronize(s))  # invalidated
    _fails(lambda: d.end_capture(s), "cudaErrorStreamCaptureInvalidated")
    assert device.wait_released(token).count(token) == 1


def test_attach_release_needs_a_capturing_stream(device: Dev) -> None:
    d = device.d
    s = device.stream()
    _fails(lambda: d.attach_release(s, new_release_token()))


def test_an_in_flight_launch_keeps_its_executables_token(device: Dev) -> None:
    """The executable and its graph are destroyed while a launch of it still waits behind long
    work: CUDA frees the executable when the launch completes, so its user objects (the
    allocator's sign that the graph's memory may be reused) are released only then."""
    d = device.d
    s = device.stream()
    d.take_released()
    graph, token = _captured_with_token(device, s)
    exe = d.instantiate(graph)
    device.spin(s)
    d.launch(exe, s)  # queued behind the spin
    d.destroy_graph_exec(exe)
    d.destroy_graph(graph)
    assert token not in d.take_released(), "released while a launch of its executable was in flight"
    d.device_synchronize()
    assert device.wait_released(token).count(token) == 1
