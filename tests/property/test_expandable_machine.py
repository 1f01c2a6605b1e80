"""Stateful property test of expandable segments on the simulated device, with real bytes.

``ExpandableMachine`` drives an allocator with ``expandable_segments:True`` on a small
simulated device (64 MiB, so growth, shrink and out-of-memory happen in most runs), on two
streams, with ``max_split_size`` on or off: allocations of small and large sizes, frees in
any order, ``empty_cache``, and captures begun on the device outside graphpool (adopted by
detection, served from a private pool with ordinary segments), ended and destroyed. Every
eager allocation is filled with its own byte pattern; after every step each live
allocation still holds its pattern (no growth, merge, unmap or reuse ever touched live
memory), the allocator's invariants hold, mapped bytes equal reserved ordinary bytes and
the device's own count of mapped memory, and no capture ever mapped or unmapped memory.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from graphpool.device.protocol import CAPTURE_MODE_GLOBAL, CAPTURE_MODE_RELAXED
from graphpool.errors import OutOfMemoryError
from graphpool.policy.allocator import CachingAllocator
from graphpool.policy.pools import DEFAULT
from graphpool.sim import SimBackend

MiB = 1 << 20
CAPACITY = 64 * MiB
SIZES = st.one_of(
    st.integers(1, 4096),  # small pool
    st.integers(4097, 1 * MiB),  # small pool, up to its largest request
    st.integers(1 * MiB + 1, 24 * MiB),  # large pool
)
CI = bool(os.environ.get("CI"))


class ExpandableMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.backend = SimBackend(memory_bytes=CAPACITY)
        self.dev = self.backend.get_device(0)
        self.max_split: int | None = None
        self.a: CachingAllocator | None = None
        self.streams = [self.dev.create_stream(), self.dev.create_stream()]
        self.live: dict[int, tuple[int, int, bytes]] = {}  # ptr -> (size, stream, pattern head)
        self.n = 0
        self.capture: tuple[int, list[int]] | None = None  # (stream, its allocations)
        self.graphs: list[int] = []
        self.vmm_calls_in_capture = 0

    @property
    def alloc(self) -> CachingAllocator:
        if self.a is None:
            sizes = dataclasses.replace(DEFAULT, expandable_segments=True, max_split_size=self.max_split)
            self.a = CachingAllocator(self.dev, sizes=sizes)
            self._spy()
        return self.a

    def _spy(self) -> None:
        """Count unmappings made while graphpool knows a capture is underway (there must be none:
        the graph may use the memory). A capture begun outside graphpool becomes known at its
        first allocation (detection); before that graphpool releases memory as it would with no
        capture, under the relaxed capture mode, as it does with ordinary segments. Mapping
        during a capture is allowed for eager streams (the ordinary pool grows under the relaxed
        mode); the capture's own pool never maps (asserted at each of its allocations)."""
        dev = self.dev
        for name in ("vmm_unmap",):  # (a release gives back address space, nothing mapped)
            real = getattr(dev, name)

            def spy(*args: Any, _real: Any = real) -> Any:
                if self.a is not None and self.a._world.active:
                    self.vmm_calls_in_capture += 1
                return _real(*args)

            setattr(dev, name, spy)

    @rule(on=st.booleans())
    @precondition(lambda self: self.a is None)
    def choose_max_split(self, on: bool) -> None:
        self.max_split = 40 * MiB if on else None

    @rule(size=SIZES, which=st.integers(0, 1))
    def malloc(self, size: int, which: int) -> None:
        stream = self.streams[which]
        capturing = self.capture is not None and self.capture[0] == stream
        try:
            ptr = self.alloc.malloc(size, stream=stream)
        except OutOfMemoryError:
            event("out of memory" + (" during a capture" if self.capture is not None else ""))
            return
        assert ptr not in self.live
        if capturing:
            assert self.capture is not None
            self.capture[1].append(ptr)
            event("allocation by a capture")
            self.live[ptr] = (size, stream, b"")  # written by the graph: no pattern
            assert not any(s <= ptr < s + n for s, n, _ in self._mapped()), "a capture got expandable memory"
            return
        self.n += 1
        head = bytes([(self.n * 7 + i) % 251 for i in range(min(size, 64))])
        # straight into the simulated memory (no stream work: a copy would break a global capture)
        self.dev.view(ptr, len(head))[:] = memoryview(head)
        if size >= 128:  # the last 64 bytes too, apart from the first
            self.dev.view(ptr + size - 64, 64)[:] = memoryview(head)
        self.live[ptr] = (size, stream, head)

    @rule(data=st.data())
    @precondition(lambda self: bool(self.live))
    def free(self, data: st.DataObject) -> None:
        ptr = data.draw(st.sampled_from(sorted(self.live)))
        self.live.pop(ptr)
        self.alloc.free(ptr)

    @rule()
    @precondition(lambda self: self.capture is None)
    def empty_cache(self) -> None:
        self.dev.device_synchronize()
        before = self.alloc.memory_stats()["expandable_mapped_bytes"]
        self.alloc.empty_cache()
        after = self.alloc.memory_stats()["expandable_mapped_bytes"]
        if after < before:
            event("empty_cache unmapped " + ("all" if after == 0 else "a free end"))

    @rule(which=st.integers(0, 1), relaxed=st.booleans())
    @precondition(lambda self: self.capture is None)
    def begin_capture(self, which: int, relaxed: bool) -> None:
        stream = self.streams[which]
        self.dev.begin_capture(stream, CAPTURE_MODE_RELAXED if relaxed else CAPTURE_MODE_GLOBAL)
        self.capture = (stream, [])

    @rule()
    @precondition(lambda self: self.capture is not None)
    def end_capture(self) -> None:
        assert self.capture is not None
        stream, _ = self.capture
        self.graphs.append(self.dev.end_capture(stream))
        self.capture = None
        self.alloc.memory_stats()  # the next call notices the end (detection)

    @rule()
    @precondition(lambda self: self.capture is None and bool(self.graphs))
    def destroy_graph(self) -> None:
        self.dev.destroy_graph(self.graphs.pop(0))
        self.alloc.memory_stats()

    def _mapped(self) -> list[tuple[int, int, int]]:
        """(start, size, mapped bytes) of every live reservation, as ranges of addresses."""
        return self.dev.reservations()

    @invariant()
    def patterns_intact(self) -> None:
        for ptr, (size, _, head) in self.live.items():
            if head:
                assert bytes(self.dev.view(ptr, len(head))) == head, f"live block 0x{ptr:x} overwritten"
                if size >= 128:
                    assert bytes(self.dev.view(ptr + size - 64, 64)) == head

    @invariant()
    def sound(self) -> None:
        if self.a is None:
            return
        self.a.check_invariants()
        stats = self.a.memory_stats()
        mapped = stats["expandable_mapped_bytes"]
        private = sum(p.stats.current("reserved_bytes") for p in self.a._pools.values())
        assert mapped == stats["reserved_bytes.all.current"] - private  # every ordinary segment maps
        assert mapped == sum(m for _, _, m in self.dev.reservations())  # the device agrees
        assert self.vmm_calls_in_capture == 0, "unmapped while a capture was underway"

    def teardown(self) -> None:
        if self.capture is not None:
            self.graphs.append(self.dev.end_capture(self.capture[0]))
        for g in self.graphs:
            self.dev.destroy_graph(g)
        if self.a is not None:
            for ptr in list(self.live):
                self.a.free(ptr)
            self.dev.device_synchronize()
            self.a.empty_cache()
            self.a.check_invariants()
            assert self.a.memory_stats()["reserved_bytes.all.current"] == 0
            assert self.dev.reservations() == []


TestExpandableMachine = ExpandableMachine.TestCase
TestExpandableMachine.settings = settings(
    max_examples=150 if CI else 60,
    stateful_step_count=40,
    deadline=None,
    derandomize=CI,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
