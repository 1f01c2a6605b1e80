"""IPC: DeviceBuffer.ipc_handle, gp.open_ipc, IpcBuffer, the multiprocessing reducer, and the
lifetime rules (docs/behaviour.rst, "IPC and multiple processes").

Every test runs on the simulator (exported memory lives in files of OS shared memory) and,
marked `gpu`, on CUDA with the same assertions. The second process is one spawned worker
(tests/ipc_worker.py) that serves the module's tests, plus one short-lived worker each for a
process that dies and for forkserver: spawning costs about half a second of CPU.
"""

from __future__ import annotations

import dataclasses
import gc
import multiprocessing as mp
import os
import pickle
from collections.abc import Iterator
from typing import Any

import pytest

import graphpool as gp
import graphpool.ipc as gipc
import ipc_worker
from gpu_guard import cuda_unusable
from graphpool import dlpack as gp_dlpack
from graphpool import runtime
from graphpool.policy.pools import DEFAULT
from simenv import fresh_sim, settle

BACKENDS = ["sim", pytest.param("cuda", marks=pytest.mark.gpu)]
TIMEOUT = 60


class Worker:
    """A second process running ipc_worker.serve; ``call`` sends a command and returns its answer."""

    def __init__(self, backend: str, method: str = "spawn") -> None:
        ctx = mp.get_context(method)
        self.commands = ctx.Queue()
        self.answers = ctx.Queue()
        env = os.environ.get("GRAPHPOOL_BACKEND")
        os.environ["GRAPHPOOL_BACKEND"] = backend  # the child's default, before it imports graphpool
        try:
            self.proc = ctx.Process(target=ipc_worker.serve, args=(backend, self.commands, self.answers))
            self.proc.start()
        finally:
            if env is None:
                os.environ.pop("GRAPHPOOL_BACKEND", None)
            else:
                os.environ["GRAPHPOOL_BACKEND"] = env

    def ask(self, *cmd: Any) -> tuple[Any, ...]:
        self.commands.put(cmd)
        answer: tuple[Any, ...] = self.answers.get(timeout=TIMEOUT)
        return answer

    def call(self, *cmd: Any) -> Any:
        answer = self.ask(*cmd)
        assert answer[0] == "ok", answer
        return answer[1]

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.ask("exit")
            except Exception:
                pass
        self.proc.join(TIMEOUT)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        for q in (self.commands, self.answers):  # no feeder thread outlives the worker
            q.close()
            q.join_thread()


def _use(backend: str) -> None:
    if backend == "cuda":
        reason = cuda_unusable()
        if reason is not None:
            pytest.skip(reason)
    gp.set_backend(backend)
    settle()


@pytest.fixture(scope="module", params=BACKENDS)
def worker(request: pytest.FixtureRequest) -> Iterator[tuple[str, Worker]]:
    backend: str = request.param
    if backend == "cuda" and cuda_unusable() is not None:
        pytest.skip(str(cuda_unusable()))
    w = Worker(backend)
    try:
        yield backend, w
    finally:
        w.stop()


@pytest.fixture
def peer(worker: tuple[str, Worker]) -> Iterator[Worker]:
    """The module's worker, with this process on the same backend; invariants checked after."""
    backend, w = worker
    _use(backend)
    yield w
    settle()
    assert gipc.exported_count() == 0, "an exported block was never given back"


@pytest.fixture(params=BACKENDS)
def here(request: pytest.FixtureRequest) -> Iterator[str]:
    """This process alone on a backend; invariants checked after."""
    _use(request.param)
    yield request.param
    settle()
    assert gipc.exported_count() == 0, "an exported block was never given back"


def _dev(device: int = 0) -> Any:
    return runtime.get().device(device)


def _fill(buf: gp.DeviceBuffer, data: bytes) -> None:
    _dev(buf.device).write(buf.ptr, data, buf.stream.handle)
    buf.stream.synchronize()


def _read(ptr: int, n: int) -> bytes:
    return _dev().read(ptr, n, 0)


def _pattern(n: int, seed: int = 1) -> bytes:
    return bytes((i * 7 + seed) % 251 for i in range(n))


def _segment_has(ptr: int) -> str | None:
    """The state of the block at ``ptr`` in graphpool's snapshot, None if it is in none."""
    for seg in gp.memory_snapshot():
        for b in seg["blocks"]:
            if b["address"] == ptr:
                return str(b["state"])
    return None


# ------------------------------------------------------------------ sharing bytes
def test_two_processes_share_bytes_both_ways(peer: Worker) -> None:
    first = gp.alloc(3000)
    second = gp.alloc(5000)  # the same segment, at an offset: the handle carries it
    _fill(first, _pattern(3000, 1))
    _fill(second, _pattern(5000, 2))
    h1, h2 = first.ipc_handle(), second.ipc_handle()
    assert h2.offset == h1.offset + (second.ptr - first.ptr) and h2.offset > 0
    assert h1.segment == h2.segment and h1.nbytes == 3000
    assert pickle.loads(pickle.dumps(h2)) == h2
    k1, kind, n = peer.call("open", h1)
    assert (kind, n) == ("IpcBuffer", 3000)
    k2 = peer.call("open", h2)[0]
    assert peer.call("read", k1, 3000) == _pattern(3000, 1)
    assert peer.call("read", k2, 5000) == _pattern(5000, 2)
    peer.call("write", k2, b"\xab" * 100)  # the other way
    assert _read(second.ptr, 5000) == b"\xab" * 100 + _pattern(5000, 2)[100:]
    assert _read(first.ptr, 3000) == _pattern(3000, 1)  # its neighbour untouched
    peer.call("close", k1)
    peer.call("close", k2)
    first.free()
    second.free()


def test_a_freed_exported_buffer_is_kept_while_another_process_holds_it(peer: Worker) -> None:
    base_alloc = gp.memory_allocated()
    buf = gp.alloc(4096)
    ptr = buf.ptr
    _fill(buf, _pattern(4096))
    key = peer.call("open", buf.ipc_handle())[0]
    buf.free()  # the owner lets go; the other process still has it open
    gp.empty_cache()
    assert _segment_has(ptr) == "active_allocated"
    assert gp.memory_allocated() == base_alloc + 4096
    other = gp.alloc(4096)
    assert other.ptr != ptr, "memory another process holds was handed out again"
    peer.call("write", key, b"\x05" * 4096)  # still the importer's to use
    assert _read(ptr, 4096) == b"\x05" * 4096
    peer.call("close", key)
    assert _segment_has(ptr) == "active_allocated"  # given back at the next cheap moment only
    gp.empty_cache()  # one of them
    assert _segment_has(ptr) == "inactive" and gipc.exported_count() == 0
    again = gp.alloc(4096)
    assert again.ptr == ptr  # reused now
    other.free()
    again.free()
    gp.check_invariants()


def test_dropped_exported_buffer_and_dropped_ipc_buffer(peer: Worker) -> None:
    buf = gp.alloc(2048)
    ptr = buf.ptr
    key = peer.call("open", buf.ipc_handle())[0]
    del buf  # the finalizer parks it too
    gc.collect()
    gp.empty_cache()
    assert _segment_has(ptr) == "active_allocated"
    peer.call("drop", key)  # the importer forgets it without close(): its finalizer closes it
    gp.empty_cache()
    assert _segment_has(ptr) != "active_allocated"


def test_opening_a_segment_twice_maps_it_once(peer: Worker, request: pytest.FixtureRequest) -> None:
    a = gp.alloc(1024)
    b = gp.alloc(1024)
    ha, hb = a.ipc_handle(), b.ipc_handle()
    assert ha.segment == hb.segment
    _fill(a, b"\x11" * 1024)
    _fill(b, b"\x22" * 1024)
    k1 = peer.call("open", ha)[0]
    k2 = peer.call("open", ha)[0]
    k3 = peer.call("open", hb)[0]
    assert peer.call("mappings") == 1
    peer.call("close", k1)
    assert peer.call("read", k2, 4) == b"\x11" * 4  # still mapped for the others
    peer.call("close", k2)
    assert peer.call("mappings") == 1
    assert peer.call("read", k3, 4) == b"\x22" * 4
    peer.call("close", k3)  # the last close unmaps
    assert peer.call("mappings") == 0
    a.free()
    b.free()


# ----------------------------------------------------------- in the exporter itself
def test_a_handle_opened_in_its_own_process_is_a_view(here: str) -> None:
    buf = gp.alloc(4096)
    ptr = buf.ptr
    _fill(buf, _pattern(4096))
    with gp.open_ipc(buf.ipc_handle()) as view:
        assert view.ptr == ptr and view.nbytes == 4096 and view.device == buf.device
        cai = view.__cuda_array_interface__
        assert cai["data"] == (ptr, False) and cai["shape"] == (4096,) and cai["stream"] is None
        assert view.__dlpack_device__() == (2, buf.device)
        exports = gp_dlpack.live_exports()
        capsule = view.__dlpack__()
        assert type(capsule).__name__ == "PyCapsule" and gp_dlpack.live_exports() == exports + 1
        del capsule
        assert gp_dlpack.live_exports() == exports
        buf.free()  # the view holds it
        gp.empty_cache()
        assert _segment_has(ptr) == "active_allocated"
        assert _read(view.ptr, 4096) == _pattern(4096)
    gp.empty_cache()
    assert _segment_has(ptr) != "active_allocated"
    assert gipc.exported_count() == 0


def test_a_shared_buffer_freed_after_another_streams_use_keeps_that_stream(here: str) -> None:
    """``_free_after`` (a framework's buffer dropped with its stream, as cuda.core's): the
    export remembers the stream, so the block is reused only after that stream's work."""
    buf = gp.alloc(4096)
    s = gp.Stream()
    with gp.open_ipc(buf.ipc_handle()):
        buf._free_after(s.handle)
        assert buf.freed and [(e.freed, e.stream) for e in gipc._exports.values()] == [(True, s.handle)]
    gp.synchronize()
    gp.empty_cache()
    assert gipc.exported_count() == 0


def test_freed_before_opened_is_refused_and_not_shared(here: str) -> None:
    buf = gp.alloc(512)
    h = buf.ipc_handle()
    buf.free()  # nobody opened it: given back at once
    assert gipc.exported_count() == 0
    with pytest.raises(gp.IpcError, match="no longer shared"):
        gp.open_ipc(h)


# ----------------------------------------------------------------------- errors
def test_errors(here: str) -> None:
    with pytest.raises(TypeError, match="IpcHandle"):
        gp.open_ipc("a handle")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="IpcHandle"):
        gp.open_ipc(None)  # type: ignore[arg-type]
    with pytest.raises(gp.IpcError, match="null buffer"):
        gp.alloc(0).ipc_handle()
    gone = gp.alloc(512)
    gone.free()
    with pytest.raises(gp.DoubleFreeError):
        gone.ipc_handle()
    buf = gp.alloc(512)
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(buf)  # plain pickle still refuses; multiprocessing's pickler sends handles
    h = buf.ipc_handle()
    other = "cuda" if here == "sim" else "sim"
    with pytest.raises(gp.IpcError, match="backend"):
        gp.open_ipc(dataclasses.replace(h, backend=other))
    with pytest.raises(gp.IpcError, match="device"):
        gp.open_ipc(dataclasses.replace(h, device=99))
    view = gp.open_ipc(h)
    view.close()
    view.close()  # a second close does nothing
    assert view.closed
    with pytest.raises(gp.IpcError, match="closed"):
        _ = view.ptr
    with pytest.raises(gp.IpcError, match="closed"):
        _ = view.__cuda_array_interface__
    with pytest.raises(gp.IpcError, match="closed"):
        view.__dlpack__()
    with pytest.raises(TypeError, match="pickled"):
        pickle.dumps(view)
    # the owner revoked the record while an open waited for its lock (before it was removed)
    gipc._edit(h.record, lambda state: state.update(revoked=True))
    with pytest.raises(gp.IpcError, match="no longer shared"):
        gp.open_ipc(h)
    buf.free()


def test_a_captured_graphs_block_is_not_exported(here: str) -> None:
    s = gp.Stream()
    g = gp.CUDAGraph()
    with gp.graph(g, stream=s):
        inside = gp.alloc(1024)
        _dev().memset(inside.ptr, 1, 1024, s.handle)
    with pytest.raises(gp.IpcError, match="private pool"):
        inside.ipc_handle()
    inside.free()
    g.reset()


def test_the_simulated_devices_ipc_calls(sim: Any) -> None:
    buf = gp.alloc(100)
    base = gp.memory_snapshot()[0]["address"]
    dev = _dev()
    raw = dev.ipc_export(base)
    assert len(raw) == 64 and dev.ipc_export(base) == raw  # CUDA's size; one handle per allocation
    with pytest.raises(gp.CUDAError, match="cudaErrorInvalidValue"):
        dev.ipc_export(buf.ptr + 512)  # not the start of an allocation
    with pytest.raises(gp.CUDAError, match="cudaErrorInvalidContext"):
        dev.ipc_open(raw)  # CUDA refuses a handle of the calling process
    with pytest.raises(gp.CUDAError, match="cudaErrorInvalidValue"):
        dev.ipc_open(b"x" * 64)
    with pytest.raises(gp.CUDAError, match="cudaErrorInvalidValue"):
        dev.ipc_close(base)  # nothing was opened there
    buf.free()


def test_no_writable_record_directory(here: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setenv("GRAPHPOOL_IPC_DIR", str(tmp_path / "missing"))
    buf = gp.alloc(512)
    with pytest.raises(gp.IpcError, match="GRAPHPOOL_IPC_DIR"):
        buf.ipc_handle()
    buf.free()


def test_an_expandable_segment_is_not_exported() -> None:
    sizes = dataclasses.replace(DEFAULT, expandable_segments=True)
    with fresh_sim(sizes=sizes):
        buf = gp.alloc(4096)
        assert gp.memory_snapshot()[0]["is_expandable"]
        with pytest.raises(gp.IpcError, match="expandable_segments:False"):
            buf.ipc_handle()
        # the device refuses a reservation too, as CUDA's legacy IPC does
        with pytest.raises(gp.CUDAError, match="cudaErrorInvalidValue"):
            _dev().ipc_export(gp.memory_snapshot()[0]["address"])
        buf.free()
    assert gipc.exported_count() == 0


def test_exporter_gone_and_importer_dead(here: str) -> None:
    """A process exports and dies: its handle is refused. A process opens and dies: the
    memory it held goes back."""
    w = Worker(here)
    try:
        h = w.call("export", 1024, b"\x33")
        buf = gp.alloc(4096)
        ptr = buf.ptr
        w.call("open", buf.ipc_handle())
        buf.free()
        gp.empty_cache()
        assert _segment_has(ptr) == "active_allocated"
        pid = w.call("pid")
        w.proc.kill()
        w.proc.join()
        with pytest.raises(gp.IpcError, match=f"pid {pid}.*exited"):
            gp.open_ipc(h)
        gp.empty_cache()  # the dead importer no longer counts
        assert _segment_has(ptr) != "active_allocated"
    finally:
        w.stop()


# --------------------------------------------------------------- multiprocessing
def test_a_buffer_sent_through_a_spawn_queue_arrives_as_an_ipc_buffer(peer: Worker) -> None:
    buf = gp.alloc(6000)
    ptr = buf.ptr
    dev = _dev()
    dev.write(buf.ptr, _pattern(6000, 9), buf.stream.handle)  # queued: the reducer synchronizes
    peer.commands.put(("take", buf))
    del buf  # the sender may drop it at once: held until the receiver opened it
    gc.collect()
    answer = peer.answers.get(timeout=TIMEOUT)
    assert answer[0] == "ok", answer
    key, kind, n = answer[1]
    assert (kind, n) == ("IpcBuffer", 6000)
    assert peer.call("read", key, 6000) == _pattern(6000, 9)
    gp.empty_cache()
    assert _segment_has(ptr) == "active_allocated"
    peer.call("close", key)
    gp.empty_cache()
    assert _segment_has(ptr) != "active_allocated"


def test_a_sent_handle_holds_the_memory_until_it_is_opened(here: str) -> None:
    from multiprocessing.reduction import ForkingPickler

    buf = gp.alloc(1536)
    ptr = buf.ptr
    _fill(buf, _pattern(1536, 3))
    sent = bytes(ForkingPickler.dumps(buf))  # what a queue or pipe sends
    buf.free()
    gp.empty_cache()
    assert _segment_has(ptr) == "active_allocated", "a sent buffer was given back before it arrived"
    arrived = pickle.loads(sent)
    assert isinstance(arrived, gp.IpcBuffer) and arrived.ptr == ptr  # its own process: a view
    assert _read(arrived.ptr, 1536) == _pattern(1536, 3)
    gp.empty_cache()
    assert _segment_has(ptr) == "active_allocated"
    arrived.close()
    gp.empty_cache()
    assert _segment_has(ptr) != "active_allocated"


def test_a_buffer_sent_through_a_forkserver_queue(here: str) -> None:
    w = Worker(here, "forkserver")
    try:
        buf = gp.alloc(700)
        _fill(buf, _pattern(700, 4))
        key, kind, _ = w.call("take", buf)
        assert kind == "IpcBuffer"
        assert w.call("read", key, 700) == _pattern(700, 4)
        buf.free()
        w.call("close", key)
    finally:
        w.stop()


@pytest.mark.gpu
def test_cupy_arrays_shared_between_two_processes() -> None:
    """The GPU exchange: a CuPy array made with graphpool installed, shared through the
    DeviceBuffer behind it; the other process sees it with CuPy and doubles it in place."""
    _use("cuda")
    cupy = pytest.importorskip("cupy")
    import graphpool.cupy as gcupy

    w = Worker("cuda")
    gcupy.use_function_allocator = True  # arrays with a DeviceBuffer behind them (buffer_of)
    try:
        with gcupy.installed():
            arr = cupy.arange(10_000, dtype=cupy.float32)
            buf = gcupy.buffer_of(arr)
            cupy.cuda.runtime.deviceSynchronize()
            before = arr.get().tobytes()
            key = w.call("open", buf.ipc_handle())[0]
            seen = w.call("cupy", key, "float32")  # what the other process read, before doubling
            assert seen[: arr.nbytes] == before
            assert bool((arr == cupy.arange(10_000, dtype=cupy.float32) * 2).all())
            w.call("close", key)
            del arr, buf
    finally:
        gcupy.use_function_allocator = False
        w.stop()
    settle()


def test_an_exception_between_give_backs_loses_no_exported_block(
    here: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """reclaim gives back one export at a time: one that raises after its block went back (a
    signal handler, say) leaves the rest exported, and the next reclaim gives them back."""
    a = runtime.allocator(0)
    base = a.memory_stats()["allocated_bytes.all.current"]
    bufs = [gp.alloc(1 << 20) for _ in range(3)]
    for b in bufs:
        b.ipc_handle()
    real, calls = gipc._give_back, []

    def raising(e: Any) -> None:
        real(e)
        calls.append(e)
        if len(calls) == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(gipc, "_give_back", raising)
    for b in bufs:
        b._ipc.freed = True  # the owners let go (as a finalizer does: no reclaim yet)
    with pytest.raises(KeyboardInterrupt):
        gipc.reclaim()
    assert gipc.exported_count() == 2
    monkeypatch.setattr(gipc, "_give_back", real)
    assert gipc.reclaim() == 2
    del bufs
    settle()
    assert a.memory_stats()["allocated_bytes.all.current"] == base


def test_out_of_memory_asks_for_exports_no_process_holds(here: str) -> None:
    """A freed export waits for graphpool's next IPC call or empty_cache; before an
    out-of-memory error the allocator asks for it too (graphpool.cooperate)."""
    from graphpool import cooperate

    buf = gp.alloc(1 << 20)
    buf.ipc_handle()
    buf._ipc.freed = True  # the owner let go from a finalizer: nothing asked since
    assert gipc.exported_count() == 1
    assert cooperate.release_other_caches(0) >= 1 << 20
    assert gipc.exported_count() == 0
    assert gipc.reclaim_on(0) == 0  # nothing left to give
    del buf


def test_a_forged_handle_outside_its_segment_is_refused(here: str) -> None:
    """A handle whose buffer does not lie inside its segment (edited, not made by ipc_handle)
    would give an IpcBuffer whose interface claims memory the mapping lacks: refused."""
    import dataclasses

    buf = gp.alloc(1024)
    h = buf.ipc_handle()
    for bad in (dict(offset=-1), dict(nbytes=1 << 70), dict(size=h.offset + 512), dict(nbytes=0)):
        with pytest.raises(gp.IpcError, match="does not lie inside its segment"):
            gp.open_ipc(dataclasses.replace(h, **bad))
    buf.free()
