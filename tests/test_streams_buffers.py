"""Streams, events and buffers at the points only indirect tests reached: a capture that was
invalidated still reads as capturing, ``copy.deepcopy`` of a buffer copies in its stream's
order, ``gp.alloc(n, s)`` allocates on ``s`` whatever stream it was given before, and a
recorded event tells the replay checker what it marks.

The `backend` fixture runs each test on the simulator and, marked gpu, on a GPU.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

import graphpool as gp
from graphpool import runtime
from graphpool.device.protocol import CAPTURE_MODE_GLOBAL, CAPTURE_STATUS_INVALIDATED
from graphpool.errors import GraphpoolError
from simenv import settle

N = 1 << 16


def test_an_invalidated_capture_still_reads_as_capturing(backend: Any) -> None:
    """CUDA's status after an illegal call during a capture is "invalidated", not "none": the
    stream is still in capture mode until the capture is ended (PyTorch's
    is_current_stream_capturing says True as well)."""
    settle()
    dev = runtime.get().device(0)
    s = gp.Stream()
    dev.begin_capture(s.handle, CAPTURE_MODE_GLOBAL)
    try:
        with pytest.raises(GraphpoolError):
            s.synchronize()  # illegal while capturing: the capture is invalidated
        assert dev.capture_info(s.handle)[0] == CAPTURE_STATUS_INVALIDATED
        assert s.query_capturing() is True
        with gp.stream(s):
            assert gp.is_current_stream_capturing() is True
    finally:
        with pytest.raises(GraphpoolError):
            dev.end_capture(s.handle)  # the graph is discarded; the stream leaves capture
    assert s.query_capturing() is False
    settle()


def test_deepcopy_copies_after_the_work_queued_on_the_buffers_stream(backend: Any) -> None:
    """The copy is queued on the source's stream: it reads the bytes that stream's earlier
    work wrote, even while that work is still running (a non-blocking stream: the legacy
    stream would not wait for it)."""
    settle()
    dev = runtime.get().device(0)
    s = gp.Stream()
    src = gp.alloc(N, s)
    dev.memset(src.ptr, 0, N, s.handle)
    backend.spin(s)  # s busy ...
    dev.memset(src.ptr, 0x5A, N, s.handle)  # ... then it writes the buffer
    dup = copy.deepcopy(src)
    assert dup.stream == s and dup.ptr != src.ptr and not dup.freed
    assert dev.read(dup.ptr, N, s.handle) == bytes([0x5A]) * N
    dup.free()
    src.free()
    settle()


def test_alloc_on_a_stream_allocates_for_that_stream_whatever_came_before(backend: Any) -> None:
    """gp.alloc(n, s) keeps where each stream allocates (its device's allocator and handle):
    a call with another stream, of this device or another, never uses the last one's."""
    settle()
    s1, s2 = gp.Stream(), gp.Stream()
    streams = [s1, s2, s1, s1, s2]
    if gp.device_count() > 1:
        streams += [gp.Stream(1), s1, gp.Stream(1)]
    bufs = []
    for s in streams:
        buf = gp.alloc(4096, s)
        bufs.append(buf)
        block = runtime.allocator(s.device).lookup(buf.ptr)
        assert block is not None, f"allocated on another device's allocator than {s!r}'s"
        assert block.stream == s.handle and buf.stream is s and buf.device == s.device
    for buf in bufs:
        buf.free()
    settle()


def test_a_recorded_event_orders_replays_for_the_checker(backend: Any) -> None:
    """g1 and g2 share a pool and memory. g1 replays on s1 behind long work; s2 waits on an
    event recorded on s1 after it (Event.record, Stream.wait_event): g2's replay on s2 is
    ordered after g1's and not reported. Without the wait it would be."""
    xp = backend.xp
    settle()
    gp.set_replay_checks("raise")
    pool = gp.graph_pool_handle()
    s1, s2 = gp.Stream(), gp.Stream()
    a = xp.ones(N, dtype=xp.float32)
    s1.wait_stream(gp.current_stream())
    g1, g2 = gp.CUDAGraph(), gp.CUDAGraph()
    with gp.stream(s1):
        g1.capture_begin(pool)
        t = a + 1  # a temporary: its block goes back to the pool during the capture ...
        u = t * 2
        del t
        g1.capture_end()
        g2.capture_begin(pool)
        v = a + 3  # ... and g2 is handed it: the two graphs write the same memory
        g2.capture_end()
    gp.synchronize()
    backend.spin(s1)
    with gp.stream(s1):
        g1.replay()
    with gp.stream(s2), pytest.raises(gp.ReplayHazardError):
        g2.replay()  # s2 was not ordered after g1's replay
    gp.synchronize()
    backend.spin(s1)
    with gp.stream(s1):
        g1.replay()
    e = gp.Event()
    e.record(s1)
    s2.wait_event(e)
    with gp.stream(s2):
        g2.replay()  # ordered: no report
    gp.synchronize()
    assert float(u.sum().item()) == 4.0 * N and float(v.sum().item()) == 4.0 * N
    del u, v, a
    g1.reset()
    g2.reset()
    settle()


def test_a_buffers_dlpack_capsule_is_versioned_only_when_asked(sim: Any) -> None:
    import ctypes

    is_valid = ctypes.pythonapi.PyCapsule_IsValid
    is_valid.restype = ctypes.c_int
    is_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]
    buf = gp.alloc(64)
    assert is_valid(buf.__dlpack__(max_version=(1, 0)), b"dltensor_versioned")
    assert is_valid(buf.__dlpack__(), b"dltensor")
    buf.free()
