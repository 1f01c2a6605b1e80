"""Pinned host memory (gp.alloc_pinned): a caching pool with graphpool's stream and capture
rules. Every `backend` test runs on the simulator and, marked `gpu`, on a GPU."""

from __future__ import annotations

import gc
import warnings
from typing import Any

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import graphpool as gp
from graphpool import pinned, runtime
from graphpool.sim import SimBackend
from simenv import fresh_sim

N = 4096  # float32 elements: 16 KiB, a small-pool block
NBYTES = 4 * N


def _read(d: gp.DeviceBuffer, stream: gp.Stream | None = None) -> np.ndarray:
    s = gp.current_stream() if stream is None else stream
    raw = runtime.get().device(d.device).read(d.ptr, d.nbytes, s.handle)
    return np.frombuffer(raw, dtype=np.float32)


def test_buffer_basics(backend: Any) -> None:
    base = gp.pinned_memory_stats()["allocated_bytes.all.current"]
    dev_before = gp.memory_stats()["allocated_bytes.all.current"]
    with gp.alloc_pinned(1000) as buf:
        assert isinstance(buf, gp.PinnedBuffer)
        assert buf.ptr != 0 and buf.nbytes == 1000 and not buf.freed
        assert buf.stream == gp.current_stream() and buf.device == 0
        view = buf.numpy(np.uint8)
        assert view.shape == (1000,) and view.flags.writeable
        view[:] = 5
        assert np.asarray(buf)[999] == 5  # __array_interface__: the same bytes
        assert buf.numpy(np.float32, (10, 25)).shape == (10, 25)
        assert gp.pinned_memory_stats()["allocated_bytes.all.current"] == base + 1024  # 512 B rounding
        assert gp.memory_stats()["allocated_bytes.all.current"] == dev_before  # host, not device
    assert buf.freed
    with pytest.raises(gp.DoubleFreeError):
        buf.free()
    null = gp.alloc_pinned(0)
    assert null.ptr == 0 and null.numpy().size == 0
    null.free()
    with pytest.raises(TypeError):
        gp.alloc_pinned(1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        gp.alloc_pinned(-1)
    with pytest.raises(TypeError, match="alloc_pinned"):
        gp.PinnedBuffer(None, 0, gp.current_stream(), pinned.pool())


def test_view_keeps_the_buffer_alive(backend: Any) -> None:
    view = gp.alloc_pinned(NBYTES).numpy(np.float32)
    view[:] = 3.0
    gc.collect()
    assert gp.pinned_memory_stats()["allocated_bytes.all.current"] >= NBYTES  # still held
    assert float(view.sum()) == 3.0 * N
    del view
    gc.collect()
    gp.pinned_memory_stats()  # carries out the queued free
    assert gp.pinned_memory_stats()["allocation.all.current"] == 0


def test_copies_round_trip(backend: Any) -> None:
    s = gp.Stream()
    h = gp.alloc_pinned(NBYTES, stream=s)
    out = gp.alloc_pinned(NBYTES, stream=s)
    d = gp.alloc(NBYTES, stream=s)
    h.numpy(np.float32)[:] = np.arange(N, dtype=np.float32)
    h.copy_to(d)
    out.copy_from(d)
    s.synchronize()
    assert np.array_equal(out.numpy(np.float32), np.arange(N, dtype=np.float32))
    assert np.array_equal(_read(d, s), np.arange(N, dtype=np.float32))
    for b in (h, out, d):
        b.free()


def test_reused_only_after_the_stream_work_that_used_it(backend: Any) -> None:
    """The host writes a pinned buffer at once: a block freed with a copy still queued on its
    stream is not handed out until that copy ran (an event), unlike a device block."""
    s = gp.Stream()
    d = gp.alloc(NBYTES, stream=s)
    h = gp.alloc_pinned(NBYTES, stream=s)
    h.numpy(np.float32)[:] = 1.0
    first = h.ptr
    backend.spin(s)  # the copy below waits behind a long kernel
    h.copy_to(d)
    h.free()
    h2 = gp.alloc_pinned(NBYTES, stream=s)
    assert h2.ptr != first  # the copy may not have read it yet
    h2.numpy(np.float32)[:] = 9.0  # the host writes its own buffer at once
    s.synchronize()
    assert np.all(_read(d, s) == 1.0)  # the copy read the bytes of its moment
    h3 = gp.alloc_pinned(NBYTES, stream=s)
    assert h3.ptr == first  # the work is done: the block is reused
    for b in (h2, h3, d):
        b.free()


def test_a_buffer_freed_during_a_capture_is_kept_for_the_graph(backend: Any) -> None:
    """The seed's rule for pinned memory: the captured copy reads the buffer on every replay,
    so an eager allocation after the capture never gets it (CuPy's pinned pool hands it out:
    a replay then copies the eager buffer's bytes)."""
    s = gp.Stream()
    d = gp.alloc(NBYTES, stream=s)
    h = gp.alloc_pinned(NBYTES, stream=s)
    h.numpy(np.float32)[:] = 1.0
    first = h.ptr
    s.synchronize()
    g = gp.CUDAGraph()
    with gp.graph(g, stream=s):
        h.copy_to(d)
        h.free()  # during the capture
    eager = gp.alloc_pinned(NBYTES, stream=s)
    assert eager.ptr != first
    eager.numpy(np.float32)[:] = 7.0
    g.replay()
    gp.synchronize()
    assert np.all(_read(d, s) == 1.0)
    mine = (first, eager.ptr)  # (on the GPU, segments of earlier tests' streams may be cached)
    segs = [  # the pool's segments, memory_snapshot's layout
        seg
        for seg in gp.pinned_memory_snapshot()
        if any(seg["address"] <= p < seg["address"] + seg["total_size"] for p in mine)
    ]
    assert {seg["stream"] for seg in segs} == {s.handle}  # the stream, not the pool's key
    g.reset()
    gc.collect()
    gp.synchronize()
    gp.pinned_memory_stats()  # notices the destroyed graph
    again = gp.alloc_pinned(NBYTES, stream=s)
    assert again.ptr == first  # back once the graph is gone
    for b in (eager, again, d):
        b.free()


def test_a_raw_captured_copy_of_another_streams_buffer_is_protected(backend: Any) -> None:
    """A buffer of another stream, read by a raw copy queued on the capturing stream (no
    record_stream): only gp.graph's announcement tells the pinned pool of the capture."""
    s = gp.Stream()
    d = gp.alloc(NBYTES, stream=s)
    h = gp.alloc_pinned(NBYTES)  # the legacy stream's
    h.numpy(np.float32)[:] = 1.0
    first = h.ptr
    dev = runtime.get().device(0)
    g = gp.CUDAGraph()
    with gp.graph(g, stream=s):
        dev.memcpy_host(d.ptr, h.ptr, NBYTES, s.handle)
        h.free()
    eager = gp.alloc_pinned(NBYTES)
    assert eager.ptr != first
    eager.numpy(np.float32)[:] = 7.0
    g.replay()
    gp.synchronize()
    assert np.all(_read(d, s) == 1.0)
    eager.free()
    d.free()
    del g


def test_device_to_host_replay_never_overwrites_an_eager_buffer(backend: Any) -> None:
    s = gp.Stream()
    d = gp.alloc(NBYTES, stream=s)
    dev = runtime.get().device(0)
    dev.memset(d.ptr, 0x3F, NBYTES, s.handle)  # some device bytes the copy brings back
    out = gp.alloc_pinned(NBYTES, stream=s)
    g = gp.CUDAGraph()
    with gp.graph(g, stream=s):
        out.copy_from(d)
        out.free()
    eager = gp.alloc_pinned(NBYTES, stream=s)
    eager.numpy(np.uint8)[:] = 7
    g.replay()
    gp.synchronize()
    assert int((eager.numpy(np.uint8) != 7).sum()) == 0
    eager.free()
    d.free()


def test_allocations_during_a_capture_come_from_its_private_pool(backend: Any) -> None:
    s = gp.Stream()
    g = gp.CUDAGraph()
    with gp.graph(g, stream=s):
        h = gp.alloc_pinned(NBYTES)  # on the capturing stream
        src = gp.alloc(NBYTES)  # from the capture's private device pool
        h.copy_from(src)  # some captured work
    seg = next(
        x for x in gp.pinned_memory_snapshot() if x["address"] <= h.ptr < x["address"] + x["total_size"]
    )
    assert seg["segment_pool_id"] is not None
    h.free()
    eager = gp.alloc_pinned(NBYTES, stream=s)
    assert not seg["address"] <= eager.ptr < seg["address"] + seg["total_size"]
    eager.free()
    src.free()
    del g


def test_empty_pinned_cache(backend: Any) -> None:
    h = gp.alloc_pinned(NBYTES)
    h.free()
    gp.synchronize()
    assert gp.pinned_memory_stats()["reserved_bytes.all.current"] > 0
    gp.empty_pinned_cache()
    assert gp.pinned_memory_stats()["reserved_bytes.all.current"] == 0
    s = gp.Stream()
    g = gp.CUDAGraph()
    with gp.graph(g, stream=s):
        with pytest.raises(gp.CaptureError, match="empty_pinned_cache"):
            gp.empty_pinned_cache()
        d = gp.alloc(512)
        runtime.get().device(0).memset(d.ptr, 1, 512, s.handle)
        d.free()
    del g


def test_out_of_pinned_memory_says_so() -> None:
    runtime.set_backend("sim", backend=SimBackend(device_count=1, host_memory_bytes=8 << 20))
    try:
        keep = gp.alloc_pinned(4 << 20)
        with pytest.raises(gp.OutOfMemoryError, match="pinned host memory"):
            gp.alloc_pinned(6 << 20)
        keep.free()
        gp.synchronize()
        gp.alloc_pinned(6 << 20).free()  # the pool released its cache and retried
    finally:
        gp.set_backend("sim")


def test_simulated_host_memory_is_shared_by_devices_and_follows_capture_rules(sim: Any) -> None:
    d0, d1 = sim.device(0), sim.device(1)
    ptr = d0.host_malloc(4096)
    assert ptr is not None
    d1.host_view(ptr, 4)[:] = b"\x01\x02\x03\x04"  # one host memory
    assert bytes(d0.host_view(ptr, 4)) == b"\x01\x02\x03\x04"
    assert (ptr, 4096) in d1.host_allocations()
    with pytest.raises(gp.CUDAError, match="cudaFreeHost"):
        d0.host_free(ptr + 1)
    s = d0.create_stream()
    d0.begin_capture(s, 0)  # global mode: cudaHostAlloc is prohibited, as cudaMalloc
    with pytest.raises(gp.CUDAError, match="cudaHostAlloc"):
        d0.host_malloc(4096)
    with pytest.raises(gp.CUDAError):
        d0.end_capture(s)
    d0.destroy_stream(s)
    d1.host_free(ptr)
    assert d0.host_allocations() == []
    free, total = d0.host_mem_info()
    assert free == total


def test_both_pools_of_a_device_get_their_graphs_back(sim: Any) -> None:
    """A capture begun outside graphpool, adopted by the device pool and the pinned pool: each
    learns of the graph's destruction (CUDA user objects), whichever asks the device first."""
    dev = sim.device(0)
    s = gp.Stream()
    h = gp.alloc_pinned(NBYTES, stream=s)
    first = h.ptr
    dev.begin_capture(s.handle, 2)  # a raw capture (relaxed), no hook
    d = gp.alloc(NBYTES, stream=s)  # detected: the device pool adopts it
    h.copy_to(d)
    h.free()  # the pinned pool adopts it (its stream captures): kept for the graph
    graph = dev.end_capture(s.handle)
    exe = dev.instantiate(graph)
    dev.launch(exe, s.handle)
    gp.synchronize()
    assert gp.alloc_pinned(NBYTES, stream=s).ptr != first
    dev.destroy_graph_exec(exe)
    dev.destroy_graph(graph)
    gp.memory_stats()  # the device pool asks the device first
    gp.pinned_memory_stats()
    assert gp.alloc_pinned(NBYTES, stream=s).ptr == first  # the pinned pool heard it too
    d.free()


_OPS = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "alloc", "free", "free", "sync"]),
        st.integers(0, 2),
        st.sampled_from([100, 512, 3000]),
        st.integers(0, 1),
    ),
    max_size=30,
)


@settings(max_examples=40, deadline=None)
@given(ops=_OPS)
@example(ops=[("alloc", 0, 100, 0), ("free", 0, 100, 0), ("alloc", 1, 100, 0)])
def test_reuse_never_corrupts_a_queued_copy(ops: list[tuple[str, int, int, int]]) -> None:
    """Random pinned allocations on two streams, each filled by the host and copied to device
    memory on its stream (the copies run only at synchronizations, on the simulator), freed in
    any order: every copy delivers the bytes its buffer held, so no block was handed out (and
    written by the host) before the copy that read it ran."""
    with fresh_sim(1, 64 << 20):
        streams = [gp.Stream(), gp.Stream()]
        live: dict[int, gp.PinnedBuffer] = {}
        expected: list[tuple[gp.DeviceBuffer, int]] = []
        for i, (op, slot, size, which) in enumerate(ops):
            if op == "alloc" and slot not in live:
                s = streams[which]
                h = gp.alloc_pinned(size, stream=s)
                value = i % 250 + 1
                h.numpy()[:] = value
                d = gp.alloc(size, stream=s)
                h.copy_to(d)
                live[slot] = h
                expected.append((d, value))
            elif op == "free" and slot in live:
                live.pop(slot).free()
            elif op == "sync":
                gp.synchronize()
        gp.synchronize()
        for d, value in expected:
            raw = runtime.get().device(0).read(d.ptr, d.nbytes, 0)
            assert set(raw) == {value}
            d.free()
        for h in live.values():
            h.free()
        gp.check_invariants()


def test_a_stale_announcement_is_skipped_quietly_when_the_pool_is_made() -> None:
    """A capture announced but ended unannounced (a graph collected mid-capture ends it in a
    finalizer), its stream since destroyed: the pinned pool made later skips it, no warning."""
    with fresh_sim(1, 64 << 20):
        dev = runtime.get().device(0)
        handle = dev.create_stream()
        dev.begin_capture(handle, 2)
        pinned.capture_begun(0, handle)
        dev.destroy_graph(dev.end_capture(handle))
        dev.destroy_stream(handle)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                gp.alloc_pinned(100).free()
        finally:
            pinned.capture_ended(0, handle)
        gp.check_invariants()


def test_a_pool_made_by_another_thread_meanwhile_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """pinned.pool's window: another thread made the pool between the unlocked look-up and the
    lock; this thread takes that pool (it announced nothing)."""
    fresh_sim()
    made = pinned.pool(0)
    monkeypatch.setattr(pinned, "_existing", lambda device: None)
    assert pinned.pool(0) is made


def test_a_copy_to_nothing_is_a_typed_error() -> None:
    fresh_sim()
    with gp.alloc_pinned(64) as p:
        for other in (None, "0x10", 0, True):
            with pytest.raises(TypeError, match="device address"):
                p.copy_to(other)
            with pytest.raises(TypeError, match="device address"):
                p.copy_from(other)
