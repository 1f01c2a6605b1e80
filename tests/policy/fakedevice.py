"""A tiny scripted device for policy unit tests: a bump allocator with a byte budget,
events the test completes by hand, and capture status the test sets by hand.

Events, two ways:

* By default (``FakeDevice()``) every recorded event stays pending until the test
  completes it (``complete_all()``, ``event_synchronize`` or ``dev.events[ev] = True``),
  whatever its stream: the test scripts completion by hand.
* ``FakeDevice(streams=True)`` honours streams: a stream runs the "slow work" a test
  queues on it (``queue_work(stream)``) until the test finishes it (``finish_work(stream)``),
  and an event recorded on a stream completes exactly when the work queued on that stream
  before the record is done. An event recorded on an idle stream is complete at once, so
  an event recorded on the wrong stream shows.

``recorded`` logs every ``(event, stream)`` record in order. An event recorded on a capturing
stream becomes part of the capture, as in CUDA: querying or synchronizing it raises
cudaErrorCapturedEvent until it is recorded again outside a capture (``captured`` holds them).
While ``implicit`` is set (a blocking stream captures, in CUDA's terms), the legacy stream (0)
is unusable: its capture status and an event record on it raise cudaErrorStreamCaptureImplicit.
"""

from __future__ import annotations

import itertools

from graphpool.device.protocol import CAPTURE_MODE_GLOBAL, CAPTURE_STATUS_ACTIVE, CAPTURE_STATUS_NONE
from graphpool.errors import CUDAError
from graphpool.policy.pools import SizeConfig

# Shrunken tunables: splitting, merging, growth and out-of-memory happen in every test.
SHRUNK = SizeConfig(
    min_block=512,
    small_size=4096,
    small_segment=8192,
    large_segment=40960,
    min_large_alloc=20480,
    round_large=8192,
)


class FakeDevice:
    index = 0
    name = "fake"

    def __init__(self, total: int = 1 << 34, *, streams: bool = False) -> None:
        self.total = total
        self.used = 0
        self.live: dict[int, int] = {}
        self._next = 1 << 40
        self.calls: list[str] = []
        self.events: dict[int, bool] = {}
        self._ids = itertools.count(1)
        self.capturing: dict[int, int] = {}  # stream -> capture id
        self.mode = CAPTURE_MODE_GLOBAL
        self.mode_log: list[int] = []
        self.id_calls = 0
        self.queried: list[int] = []  # streams the capture query was asked about, in order
        self.attached: dict[int, int] = {}  # token -> stream
        self.released: list[int] = []
        self.streams = streams
        self.queued: dict[int, int] = {}  # stream -> units of work ever queued on it
        self.done: dict[int, int] = {}  # stream -> units of it finished
        self.targets: dict[int, tuple[int, int]] = {}  # event -> (stream, work it waits for)
        self.recorded: list[tuple[int, int]] = []
        self.event_stream: dict[int, int] = {}  # event -> the stream it was last recorded on
        self.captured: set[int] = set()  # events last recorded on a capturing stream
        self.implicit = False  # a blocking stream captures: the legacy stream refuses use
        self.destroyed: set[int] = set()  # streams destroyed by the test: record_event fails
        self.refuse_end: set[int] = set()  # streams whose end_capture fails (thread-bound, thread gone)
        self.refused = 0  # driver allocations refused (out of memory)
        self.graphs: set[int] = set()  # graph handles made by end_capture, not destroyed
        self.reserved: dict[int, tuple[int, set[int]]] = {}  # va -> (size, mapped granules)
        self._next_va = 1 << 46
        self.made: set[int] = set()  # streams stream_idle may report idle (the device made them)
        self.idle_asked: list[int] = []
        self.synced_made: list[int] = []  # streams stream_synchronize_made was asked to wait for

    # memory
    def malloc(self, nbytes: int) -> int | None:
        self.calls.append("malloc")
        if self.used + nbytes > self.total:
            self.refused += 1
            return None
        ptr = self._next
        self._next += (nbytes + (1 << 21) - 1) // (1 << 21) * (1 << 21) + (1 << 21)
        self.live[ptr] = nbytes
        self.used += nbytes
        return ptr

    def free(self, ptr: int) -> None:
        self.calls.append("free")
        self.used -= self.live.pop(ptr)

    def mem_info(self) -> tuple[int, int]:
        return self.total - self.used, self.total

    # virtual memory: a granule of 8 KiB (SHRUNK's scale, as 2 MiB is a real device's);
    # reservations come from their own address range
    GRAN = 8192

    def vmm_granularity(self) -> int:
        return self.GRAN

    def vmm_reserve(self, nbytes: int) -> int:
        self.calls.append("reserve")
        assert nbytes > 0 and nbytes % self.GRAN == 0
        va = self._next_va
        self._next_va += nbytes + self.GRAN
        self.reserved[va] = (nbytes, set())
        return va

    def _granules(self, va: int, nbytes: int) -> tuple[set[int], range]:
        for base, (size, mapped) in self.reserved.items():
            if base <= va and va + nbytes <= base + size:
                assert (va - base) % self.GRAN == 0 and nbytes % self.GRAN == 0 and nbytes > 0
                first = (va - base) // self.GRAN
                return mapped, range(first, first + nbytes // self.GRAN)
        raise AssertionError(f"[{va:#x}, +{nbytes}) is in no reservation")

    def vmm_map(self, va: int, nbytes: int) -> bool:
        self.calls.append("map")
        mapped, granules = self._granules(va, nbytes)
        assert not any(g in mapped for g in granules), "mapped twice"
        if self.used + nbytes > self.total:
            self.refused += 1
            return False
        mapped.update(granules)
        self.used += nbytes
        return True

    def vmm_unmap(self, va: int, nbytes: int, stream: int | None = None) -> None:
        """Waits for all queued work first, as the protocol says (CUDA: a device synchronize)."""
        self.calls.append("unmap")
        self.complete_all()
        mapped, granules = self._granules(va, nbytes)
        assert all(g in mapped for g in granules), "unmapping unmapped memory"
        mapped.difference_update(granules)
        self.used -= nbytes

    def vmm_release(self, va: int, nbytes: int) -> None:
        self.calls.append("release")
        size, mapped = self.reserved.pop(va)
        assert size == nbytes and not mapped

    # events
    def create_event(self) -> int:
        ev = next(self._ids)
        self.events[ev] = True
        return ev

    def record_event(self, event: int, stream: int) -> None:
        self.calls.append("record")
        if stream == 0 and self.implicit:
            raise CUDAError("cudaEventRecord", 906, "cudaErrorStreamCaptureImplicit")
        if stream in self.destroyed:
            raise CUDAError("cudaEventRecord", 400, "cudaErrorInvalidResourceHandle")
        self.recorded.append((event, stream))
        self.event_stream[event] = stream
        if self.capturing.get(stream):
            self.captured.add(event)  # a node of the capture now, not a mark on the stream
            return
        self.captured.discard(event)
        if self.streams:
            target = self.queued.get(stream, 0)
            self.targets[event] = (stream, target)
            self.events[event] = self.done.get(stream, 0) >= target
        else:
            self.events[event] = False

    def complete_stream(self, stream: int) -> None:
        """The work queued so far on ``stream`` is done: its recorded events complete."""
        for ev, s in self.event_stream.items():
            if s == stream:
                self.events[ev] = True

    def _check_captured(self, call: str, event: int) -> None:
        if event in self.captured:
            raise CUDAError(call, 907, "cudaErrorCapturedEvent")

    def query_event(self, event: int) -> bool:
        self.calls.append("query")
        self._check_captured("cudaEventQuery", event)
        self._refresh(event)
        return self.events[event]

    def event_synchronize(self, event: int) -> None:
        """Wait for the event: its stream's work queued before the record finishes."""
        self.calls.append("sync")
        self._check_captured("cudaEventSynchronize", event)
        if event in self.targets:
            stream, target = self.targets[event]
            self.done[stream] = max(self.done.get(stream, 0), target)
        self.events[event] = True

    def _refresh(self, event: int) -> None:
        if event in self.targets and not self.events[event]:
            stream, target = self.targets[event]
            self.events[event] = self.done.get(stream, 0) >= target

    # slow work on streams (``streams=True``)
    def queue_work(self, stream: int, units: int = 1) -> None:
        """Queue ``units`` of slow work on ``stream``; it runs until ``finish_work``."""
        self.queued[stream] = self.queued.get(stream, 0) + units

    def finish_work(self, stream: int, units: int | None = None) -> None:
        """Finish ``units`` (default: all) of the work queued on ``stream``, in order."""
        queued = self.queued.get(stream, 0)
        done = self.done.get(stream, 0)
        self.done[stream] = queued if units is None else min(queued, done + units)

    def busy(self, stream: int) -> bool:
        return self.done.get(stream, 0) < self.queued.get(stream, 0)

    def stream_idle(self, stream: int) -> bool:
        """A stream the test declared made by the device (``made``), not destroyed, not
        capturing and with no slow work left; the allocator asks it before mapping more."""
        self.idle_asked.append(stream)
        if stream not in self.made or stream in self.destroyed or self.capturing.get(stream):
            return False
        return not self.busy(stream)

    def stream_synchronize_made(self, stream: int) -> bool:
        """A stream the test declared made by the device (``made``), not destroyed and not
        capturing: its work finishes (True); any other is left alone (False)."""
        self.synced_made.append(stream)
        if stream not in self.made or stream in self.destroyed or self.capturing.get(stream):
            return False
        self.done[stream] = self.queued.get(stream, 0)
        return True

    def made_streams_capturing(self) -> bool:
        """Whether a stream the test declared made (``made``), not destroyed, is capturing."""
        return any(self.capturing.get(s) for s in self.made if s not in self.destroyed)

    def stream_capturing(self, stream: int) -> bool | None:
        """A stream the test declared made by the device (``made``) and not destroyed: whether
        it captures; None for any other (never asked, as CUDA's device never asks)."""
        if stream not in self.made or stream in self.destroyed:
            return None
        return bool(self.capturing.get(stream))

    def complete_all(self) -> None:
        for stream, queued in self.queued.items():
            self.done[stream] = queued
        for ev in self.events:
            self.events[ev] = True

    # capture
    def capture_info(self, stream: int) -> tuple[int, int]:
        if stream == 0 and self.implicit:
            raise CUDAError("cudaStreamIsCapturing", 906, "cudaErrorStreamCaptureImplicit")
        cid = self.capturing.get(stream, 0)
        return (CAPTURE_STATUS_ACTIVE if cid else CAPTURE_STATUS_NONE), cid

    def exchange_capture_mode(self, mode: int) -> int:
        prev, self.mode = self.mode, mode
        self.mode_log.append(mode)
        return prev

    def begin(self, stream: int) -> int:
        cid = next(self._ids) + 1000
        self.capturing[stream] = cid
        return cid

    def end(self, stream: int) -> None:
        self.capturing.pop(stream, None)

    def end_capture(self, stream: int) -> int:
        """End the capture begun on ``stream`` (and every stream that joined it): a graph handle."""
        cid = self.capturing.get(stream, 0)
        if not cid or stream in self.refuse_end:
            raise CUDAError("cudaStreamEndCapture", 901, "cudaErrorStreamCaptureWrongThread")
        for s, c in list(self.capturing.items()):
            if c == cid:
                del self.capturing[s]
        handle = next(self._ids) + 5000
        self.graphs.add(handle)
        return handle

    def destroy_graph(self, graph: int) -> None:
        self.graphs.discard(graph)

    def destroy_graph_exec(self, graph_exec: int) -> None:
        pass

    def capture_id(self, stream: int) -> int:
        self.id_calls += 1
        self.queried.append(stream)
        if stream in self.destroyed:  # as record_event does; CUDA may crash
            raise CUDAError("cudaStreamGetCaptureInfo", 400, "cudaErrorInvalidResourceHandle")
        return self.capturing.get(stream, 0)

    # user objects: the test releases tokens by hand (release()), as a destroyed graph would
    def attach_release(self, stream: int, token: int) -> None:
        if stream not in self.capturing:
            raise AssertionError(f"attach_release on stream {stream}, which is not capturing")
        self.attached[token] = stream

    def release(self, token: int) -> None:
        del self.attached[token]
        self.released.append(token)

    def take_released(self) -> list[int]:
        out, self.released = self.released, []
        return out

    def device_synchronize(self) -> None:
        self.calls.append("device_sync")
        self.complete_all()
