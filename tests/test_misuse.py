"""Misuse that once crashed the interpreter or gave silently wrong results (issue 10).

Crashes are checked in a child interpreter running the graphpool this test imports (the
compiled build once segfaulted on several of these), so a crash fails one test instead
of killing the run. Each point also has an in-process test of the error it must raise.
"""

from __future__ import annotations

import copy
import gc
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import graphpool as gp
from graphpool import routing, runtime
from graphpool.sim import SimBackend

PKG_PARENT = str(Path(gp.__file__).resolve().parents[1])


def run_child(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a new interpreter on the simulator, importing this graphpool."""
    env = dict(os.environ, PYTHONPATH=PKG_PARENT, GRAPHPOOL_BACKEND="sim")
    prelude = "import copy, pickle, graphpool as gp\nfrom graphpool.sim import xp\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + code], env=env, capture_output=True, text=True, timeout=120
    )


# ------------------------------------------------------------- 1. no crash: child process
CRASHERS = {
    "no_args": "gp.DeviceBuffer()",
    "bad_args": "gp.DeviceBuffer('a', 1, gp.current_stream(), None)",
    "forged": "gp.DeviceBuffer(1, 1, gp.current_stream(), None)",
    "new": "gp.DeviceBuffer.__new__(gp.DeviceBuffer)",
    "copy_buf": "copy.copy(gp.alloc(128))",
    "deepcopy_dict": "copy.deepcopy({'w': gp.alloc(8)})",
    "deepcopy_xp": "copy.deepcopy(xp.ones(10))",
    "pickle_buf": "pickle.dumps(gp.alloc(8))",
    "copy_graph": "copy.copy(gp.CUDAGraph())",
    "deepcopy_graph": "copy.deepcopy(gp.CUDAGraph())",
    "pickle_graph": "pickle.dumps(gp.CUDAGraph())",
    "copy_event": "copy.copy(gp.Event())",
}


@pytest.mark.parametrize("name", sorted(CRASHERS))
def test_misuse_never_kills_the_interpreter(name: str) -> None:
    code = (
        "try:\n"
        f"    {CRASHERS[name]}\n"
        "except (TypeError, ValueError, gp.GraphpoolError) as e:\n"
        "    assert str(e), 'an error without a message'\n"
        "import gc; gc.collect(); gp.synchronize(); gp.empty_cache(); gp.check_invariants()\n"
        "assert gp.memory_reserved() == 0, gp.memory_reserved()\n"
        "print('survived')\n"
    )
    done = run_child(code)
    assert done.returncode == 0 and "survived" in done.stdout, (done.returncode, done.stderr[-2000:])
    assert "Exception ignored" not in done.stderr, done.stderr[-2000:]


# ------------------------------------------------------------------ 1, 2. DeviceBuffer
def test_device_buffer_cannot_be_made_from_outside(sim: Any) -> None:
    with pytest.raises(TypeError):
        gp.DeviceBuffer()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        gp.DeviceBuffer("a", 1, gp.current_stream(), runtime.allocator())  # type: ignore[arg-type]


def test_a_forged_buffer_cannot_free_another_owners_block(sim: Any) -> None:
    a = runtime.allocator()
    real = gp.alloc(4096)
    with pytest.raises(TypeError, match=r"gp\.alloc"):
        gp.DeviceBuffer(real.ptr, 4096, gp.current_stream(), a)
    gc.collect()  # the refused object's finalizer must not free real's block
    assert a.lookup(real.ptr) is not None and a.lookup(real.ptr).allocated
    other = gp.alloc(4096)
    assert other.ptr != real.ptr
    real.free()
    other.free()
    gp.check_invariants()


def test_a_buffers_address_cannot_be_freed_behind_its_back(sim: Any) -> None:
    """The allocator frees a buffer's block only through the buffer: a raw ``free`` of its
    address is refused (it would free the block twice later) and changes nothing."""
    a = runtime.allocator()
    buf = gp.alloc(4096)
    before = gp.memory_stats()
    with pytest.raises(gp.ForeignPointerError, match="DeviceBuffer"):
        a.free(buf.ptr)
    assert gp.memory_stats() == before and not buf.freed
    buf.free()
    with pytest.raises(gp.DoubleFreeError):
        buf.free()
    assert gp.memory_allocated() == 0
    gp.check_invariants()


def test_copy_of_a_buffer_is_refused_and_deepcopy_is_a_real_copy(sim: Any) -> None:
    from graphpool.sim import xp

    src = xp.arange(16, dtype=xp.int32)
    buf = src._buf
    with pytest.raises(TypeError, match="copy"):
        copy.copy(buf)
    dup = copy.deepcopy({"w": buf})["w"]
    assert dup is not buf and dup.ptr != buf.ptr and dup.nbytes == buf.nbytes
    dev = runtime.get().device(0)
    gp.synchronize()
    assert dev.read(dup.ptr, dup.nbytes, 0) == dev.read(buf.ptr, buf.nbytes, 0)
    dup.free()
    with pytest.raises(gp.DoubleFreeError):
        dup.free()  # one owner: the copy is its own allocation
    del src, buf
    gc.collect()
    gp.check_invariants()


def test_pickling_a_buffer_says_why(sim: Any) -> None:
    buf = gp.alloc(8)
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(buf)
    buf.free()


def test_events_refuse_copies_streams_copy_to_themselves(sim: Any) -> None:
    s = gp.Stream()
    assert copy.copy(s) is s and copy.deepcopy(s) is s
    with pytest.raises(TypeError):
        pickle.dumps(s)
    e = gp.Event()
    with pytest.raises(TypeError):
        copy.copy(e)
    with pytest.raises(TypeError):
        pickle.dumps(e)


def test_stream_event_and_buffer_refusals_say_why_word_for_word(sim: Any) -> None:
    """Each refusal names the object, the reason and what to do instead, as written."""
    from graphpool.streams import ACCEPTED

    def said(fn: Any, *args: Any, kind: type[Exception] = TypeError) -> str:
        with pytest.raises(kind) as info:
            fn(*args)
        return str(info.value)

    s, e, buf = gp.Stream(), gp.Event(), gp.alloc(8)
    for obj, what in ((s, "Stream"), (e, "Event")):
        assert said(pickle.dumps, obj) == (
            f"a graphpool {what} cannot be pickled: its handle is valid in this process only. "
            f"Make a new {what} where it is needed."
        )
    assert said(copy.copy, e) == (
        "a graphpool Event cannot be copied: it owns its CUDA event, which would be destroyed "
        "twice. Record a new Event instead (stream.record_event())."
    )
    assert said(copy.copy, buf) == (
        "a graphpool DeviceBuffer cannot be copied with copy.copy: it owns its allocation, and a "
        "second owner would free it twice. Copy the data with your framework (cupy.copy, "
        "torch.clone, xp_array.copy()), or use copy.deepcopy(buf) for a new buffer holding the same bytes."
    )
    assert (
        said(pickle.dumps, buf)
        == said(buf.__reduce__)
        == (
            "a graphpool DeviceBuffer cannot be pickled: it is device memory of this process. "
            "Copy it to the host first (e.g. with your framework's .get() or .cpu())."
        )
    )
    assert said(s.record_event, "e") == "record_event needs a graphpool Event or None, not str"
    assert said(s.wait_event, 3) == "wait_event needs a graphpool Event, not int"
    assert said(s.wait_stream, 1.5) == f"wait_stream takes {ACCEPTED}, not float"
    assert said(buf.record_stream, 1.5) == f"record_stream takes {ACCEPTED}, not float"
    buf.free()
    assert repr(buf) == f"<graphpool.DeviceBuffer 0x{buf.ptr:x}, 8 bytes, device 0, freed>"


def test_a_dropped_event_destroys_its_cuda_event_and_streams_hash_by_handle(sim: Any) -> None:
    e = gp.Event()
    handle = e.handle
    dev = runtime.get().device(0)
    assert dev.query_event(handle)
    del e
    gc.collect()
    with pytest.raises(gp.CUDAError, match="cudaEventQuery"):
        dev.query_event(handle)  # destroyed with its Event
    a, b = gp.Stream(), gp.Stream()
    same = gp.Stream._wrap(a.device, a.handle)
    assert same == a and hash(same) == hash(a)
    assert {a: "a", b: "b"}[same] == "a" and hash(a) != hash(b)


# ------------------------------------------------------------------ 3. graphs
def test_graph_copy_and_pickle_are_refused(sim: Any) -> None:
    g = gp.CUDAGraph()
    for fn in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="CUDAGraph"):
            fn(g)


def test_graph_copy_and_pickle_say_why_and_what_to_do(sim: Any) -> None:
    g = gp.CUDAGraph()
    copied = (
        f"a graphpool CUDAGraph ({g.label}) cannot be copied: it owns its captured CUDA graph "
        "and private pool. Capture a new CUDAGraph instead."
    )
    for fn in (copy.copy, copy.deepcopy):
        with pytest.raises(TypeError) as info:
            fn(g)
        assert str(info.value) == copied
    with pytest.raises(TypeError) as info:
        pickle.dumps(g)
    assert str(info.value) == (
        f"a graphpool CUDAGraph ({g.label}) cannot be pickled: it is device state of this "
        "process. Capture it again where it is needed."
    )


def test_reset_and_collection_destroy_the_graphs_device_objects(sim: Any) -> None:
    from graphpool.sim import xp

    dev = runtime.get().device(0)

    def live() -> tuple[int, int]:
        return len(dev._graphs), len(dev._execs)

    a = xp.ones(4)
    before = live()
    g = gp.CUDAGraph()
    with gp.graph(g):
        b = a + 1
    assert live() == (before[0] + 1, before[1] + 1)  # the graph and its executable
    g.reset()
    assert live() == before
    h = gp.CUDAGraph()
    with gp.graph(h):
        c = a + 2
    del h
    gc.collect()  # collected: its finalizer hands both objects to the allocator ...
    gp.empty_cache()  # ... whose next call destroys them, each with its own call
    assert live() == before
    with gp.stream(gp.Stream()):
        mid = gp.CUDAGraph()
        mid.capture_begin()
        d = a + 3
        del mid  # collected mid-capture: its finalizer ends the capture, the graph goes too
        gc.collect()
        assert not gp.is_current_stream_capturing()
    gp.empty_cache()
    assert live() == before
    del b, c, d


def test_graph_repr_says_its_state(sim: Any) -> None:
    from graphpool.sim import xp

    g = gp.CUDAGraph()
    a = xp.ones(4)
    assert repr(g) == f"<graphpool.CUDAGraph {g.label} empty>"
    with gp.graph(g):
        assert repr(g) == f"<graphpool.CUDAGraph {g.label} capturing>"
        b = a + 1
    assert repr(g) == f"<graphpool.CUDAGraph {g.label} captured>"
    del b
    g.reset()
    assert repr(g) == f"<graphpool.CUDAGraph {g.label} empty>"


# ------------------------------------------------------------------ 1. xp arrays
def test_xp_copies_are_real_copies_and_pickle_round_trips(sim: Any) -> None:
    from graphpool.sim import xp

    a = xp.arange(10)
    for b in (copy.copy(a), copy.deepcopy(a), copy.deepcopy([a])[0], pickle.loads(pickle.dumps(a))):
        assert b is not a and b.data.ptr != a.data.ptr
        assert np.array_equal(b.get(), a.get())
    b = copy.deepcopy(a)
    b.fill(7)
    assert a.get()[3] == 3  # independent memory


# ------------------------------------------------------------------ 4. zero bytes
def test_alloc_zero_is_a_null_buffer_that_holds_nothing(backend: Any) -> None:
    gc.collect()
    before = gp.memory_stats()
    buf = gp.alloc(0)
    assert buf.ptr == 0 and buf.nbytes == 0 and not buf.freed
    assert gp.memory_stats() == before  # no segment, no block, no counter moved
    assert buf.__cuda_array_interface__["data"] == (0, False)
    buf.record_stream(gp.Stream())
    buf.free()
    assert buf.freed
    with pytest.raises(gp.DoubleFreeError):
        buf.free()
    gp.alloc(0, stream=gp.Stream())  # collected at once: a no-op too
    gp.alloc(np.int64(0))
    gc.collect()
    assert gp.memory_stats() == before
    with pytest.raises(TypeError):
        gp.alloc(False)  # a bool is still not a size
    dup = copy.deepcopy(gp.alloc(0))
    assert dup.ptr == 0


def test_alloc_zero_during_capture_holds_nothing(sim: Any) -> None:
    g = gp.CUDAGraph()
    with gp.graph(g):
        z = gp.alloc(0)
        xp_ones = __import__("graphpool.sim.xp", fromlist=["ones"]).ones(4)
    assert z.ptr == 0
    g.replay()
    del xp_ones, z
    g.reset()


# ------------------------------------------------------------------ 5. set_backend
def _replaced(fn: Any) -> None:
    with pytest.raises(gp.BackendReplacedError, match="set_backend"):
        fn()


def test_objects_of_a_replaced_backend_refuse_to_work(sim: Any) -> None:
    from graphpool.sim import xp

    a = xp.ones(10)
    s = gp.Stream()
    e = gp.Event()
    e.record(s)
    buf = gp.alloc(64)
    gp.set_backend("sim")
    _replaced(lambda: (a + 1).get())  # was silently zeros
    _replaced(lambda: a.get())
    _replaced(lambda: a.sum())
    _replaced(lambda: a.copy())
    _replaced(lambda: xp.ones(10) + a)
    _replaced(lambda: a.fill(2))
    _replaced(s.synchronize)
    _replaced(lambda: s.wait_stream(gp.current_stream()))
    _replaced(lambda: gp.current_stream().wait_stream(s))
    _replaced(lambda: gp.current_stream().wait_event(e))
    _replaced(s.record_event)
    _replaced(lambda: gp.alloc(8, stream=s))
    _replaced(lambda: gp.stream(s).__enter__())
    _replaced(e.query)
    _replaced(e.synchronize)
    _replaced(lambda: e.record(gp.current_stream()))
    _replaced(lambda: buf.record_stream(gp.current_stream()))
    _replaced(lambda: buf.__cuda_array_interface__)
    _replaced(lambda: copy.deepcopy(buf))
    for obj, call in ((s, s.synchronize), (s, s.record_event), (e, e.query)):  # each names itself
        with pytest.raises(gp.BackendReplacedError) as info:
            call()
        assert str(info.value).startswith(f"{obj!r} was made under the 'sim' backend, which was replaced")
    buf.free()  # freeing still works: the buffer goes back to the allocator it came from
    fresh = xp.ones(10) + 1
    assert fresh.get().sum() == 20
    gp.check_invariants()


def test_streams_of_an_older_cuda_runtime_stay_valid(sim: Any) -> None:
    """CUDA handles are the process's: a new "cuda" runtime accepts an older one's streams."""

    class FakeCuda(SimBackend):
        name = "cuda"

    runtime.set_backend("cuda", backend=FakeCuda())
    s = gp.Stream()
    runtime.set_backend("cuda", backend=FakeCuda())
    s._check_backend()  # no error
    gp.set_backend("sim")
    with pytest.raises(gp.BackendReplacedError, match="'cuda' backend"):
        s._check_backend()


def test_alloc_caches_follow_set_backend(sim: Any) -> None:
    """gp.alloc's caches, per thread (routing.Entry) and per Stream (routing.Route), hold an allocator
    only until set_backend: then the default stream allocates from the new runtime and a stream
    of the old one is refused, as with the caches cold."""
    s = gp.Stream()
    gp.alloc(8).free()
    gp.alloc(8, stream=s).free()  # both caches filled
    old = runtime.allocator()
    gp.set_backend("sim")
    buf = gp.alloc(8)
    assert buf._alloc is runtime.allocator() and buf._alloc is not old
    _replaced(lambda: gp.alloc(8, stream=s))
    _replaced(lambda: gp.alloc(0, stream=s))
    buf.free()
    gp.check_invariants()


def test_a_stream_of_an_older_cuda_runtime_allocates_from_the_new_one(sim: Any) -> None:
    """Its cached allocator (routing.Route) is the old runtime's: the next call finds the new one."""

    class FakeCuda(SimBackend):
        name = "cuda"

    backend = FakeCuda()  # one driver for both runtimes, as CUDA's is the process's
    runtime.set_backend("cuda", backend=backend)
    s = gp.Stream()
    gp.alloc(8, stream=s).free()  # makes the allocator
    gp.alloc(8, stream=s).free()  # finds it, and keeps it with the stream
    old = runtime.allocator(s.device)
    runtime.set_backend("cuda", backend=backend)
    buf = gp.alloc(8, stream=s)
    assert buf._alloc is not old
    assert buf._alloc is runtime.allocator(s.device)
    buf.free()
    gp.set_backend("sim")


# ------------------------------------------------------------------ 6. errors say why
def test_set_backend_cuda_without_a_gpu_says_so_in_one_line(sim: Any) -> None:
    from graphpool.device.cuda import is_available

    if is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(gp.BackendUnavailableError, match="no usable CUDA driver or GPU"):
        gp.set_backend("cuda")
    assert gp.backend() == "sim"  # nothing changed
    env = dict(os.environ, PYTHONPATH=PKG_PARENT)
    done = subprocess.run(
        [sys.executable, "-m", "graphpool", "demo", "--backend", "cuda"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "no usable CUDA driver or GPU" in done.stderr


@pytest.mark.parametrize("bad", ["0", 0.0, True, [0]])
def test_a_bad_device_argument_says_what_is_expected(sim: Any, bad: Any) -> None:
    for fn in (gp.memory_stats, gp.memory_allocated, gp.empty_cache, gp.memory_snapshot, gp.synchronize):
        with pytest.raises(TypeError, match="device index"):
            fn(bad)


def test_a_numpy_integer_names_a_device(sim: Any) -> None:
    assert gp.memory_stats(np.int64(0)) == gp.memory_stats(0)


def test_graphpool_warnings_point_at_the_callers_line() -> None:
    from graphpool._warnings import warn

    def inner() -> None:
        warn("hello")

    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        inner()  # inner lives in this file, outside graphpool: it is the caller
    assert got and got[0].filename == __file__


# ------------------------------------------------------------------ 7. sim vs CUDA
def test_wait_stream_on_another_devices_stream(backend: Any) -> None:
    if gp.device_count() < 2:
        pytest.skip("host has too few GPUs: needs two devices")
    xp = backend.xp
    with gp.device(1):
        s1 = gp.Stream()
        with gp.stream(s1):
            backend.spin(s1)
            a = xp.ones(1000)
            b = a + 1
    s0 = gp.Stream()
    s0.wait_stream(s1)  # CUDA allows waiting on another device's work
    with gp.stream(s0):
        s0.synchronize()
    with gp.device(1):
        assert float(b.sum().item()) == 2000.0


def test_read_an_array_of_another_device(backend: Any) -> None:
    if gp.device_count() < 2:
        pytest.skip("host has too few GPUs: needs two devices")
    xp = backend.xp
    with gp.device(1):
        a = xp.arange(8)
        b = a * 2
    assert gp.current_device() == 0
    got = b.get()  # device 1's array read while device 0 is current, as CuPy allows
    assert list(np.asarray(got)) == [0, 2, 4, 6, 8, 10, 12, 14]
    assert gp.current_device() == 0


def test_a_capture_cannot_wait_on_another_devices_event(sim: Any) -> None:
    with gp.device(1):
        s1 = gp.Stream()
        e = s1.record_event()
    g = gp.CUDAGraph()
    with pytest.raises(gp.GraphpoolError):
        with gp.graph(g):
            gp.current_stream().wait_event(e)
    assert not gp.is_current_stream_capturing()


# ------------------------------------------------------------------ 8. CuPy's current stream
class _FakeStream:
    """Just enough of a CuPy stream: a handle, and ``use()`` making it current."""

    def __init__(self, fake: _FakeCupy, ptr: int) -> None:
        self.fake, self.ptr = fake, ptr

    def use(self) -> _FakeStream:
        self.fake.current = self
        return self


class _FakeCupy:
    """A stand-in for the ``cupy`` module: what graphpool.cupy touches, on the simulator."""

    def __init__(self) -> None:
        import types

        fake = self
        self.null = _FakeStream(self, 0)
        self.current = self.null
        self.allocator: Any = None

        class Device:
            def __init__(self, index: int) -> None:
                pass

            def __enter__(self) -> None:
                return None

            def __exit__(self, *exc: object) -> None:
                return None

        def external(handle: int, device: int) -> _FakeStream:
            return _FakeStream(fake, handle)

        self.cuda = types.SimpleNamespace(
            Stream=types.SimpleNamespace(null=self.null),
            ExternalStream=external,
            Device=Device,
            runtime=types.SimpleNamespace(getDevice=lambda: 0),
            get_current_stream=lambda device_id=None: fake.current,
            get_allocator=lambda: fake.allocator,
            set_allocator=lambda fn: setattr(fake, "allocator", fn),
            UnownedMemory=None,  # install() binds them; this test allocates nothing through CuPy
            MemoryPointer=None,
        )


def test_cupy_keeps_its_own_stream_after_a_graph_block(sim: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``with cupy.cuda.Stream(): with gp.graph(g): ...`` must leave CuPy on its stream.

    graphpool's stream before the block is the legacy default (graphpool does not follow
    CuPy's ``with`` blocks); restoring CuPy from it used to leave CuPy on Stream.null for
    the rest of the user's block. The same on a GPU: test_integrations_cupy.py.
    """
    import graphpool.cupy as gcupy

    class FakeCuda(SimBackend):
        name = "cuda"

    fake = _FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    for name, value in (
        ("_cp_streams", {}),
        ("_gp_streams", {}),
        ("_installed", False),
        ("_cp", None),
        ("_calls", gcupy._calls),  # install() binds the fake's: restored after
    ):
        monkeypatch.setattr(gcupy, name, value)
    monkeypatch.setattr(routing, "_followers", ())
    runtime.set_backend("cuda", backend=FakeCuda())
    gcupy.install()
    users = _FakeStream(fake, 0xABC0).use()  # `with cupy.cuda.Stream() as users:` entered
    g = gp.CUDAGraph()
    with gp.graph(g):
        assert fake.current.ptr == gp.current_stream().handle != 0  # CuPy follows the capture
        out = __import__("graphpool.sim.xp", fromlist=["ones"]).ones(4)
    assert fake.current is users  # was Stream.null
    with gp.stream(gp.Stream()):
        assert fake.current is not users
    assert fake.current is users
    del out
    g.reset()
    gcupy.uninstall()
    gp.set_backend("sim")


def test_set_backend_is_refused_during_a_capture(sim: Any) -> None:
    """Replacing the backend mid-capture stranded the capture: its allocator stayed in
    capture mode for good (empty_cache refused), and the graph could never be ended."""
    from graphpool.sim import xp

    old = runtime.get()
    g = gp.CUDAGraph()
    with pytest.raises(gp.CaptureError, match="set_backend"):
        with gp.graph(g):
            out = xp.ones(8)
            gp.set_backend("sim")
    assert runtime.get() is old
    assert not old.allocators[0]._capturing
    del out
    gc.collect()
    gp.empty_cache()
    assert gp.memory_reserved() == 0


# ------------------------------------------------------------------ 9. inputs read once, identity fixed
MiB = 1 << 20


class _Flaky:
    """A size that answers 1 MiB the first time it is read and 512 after."""

    def __init__(self) -> None:
        self.calls = 0

    def __index__(self) -> int:
        self.calls += 1
        return MiB if self.calls == 1 else 512


@pytest.mark.parametrize("where", ["current stream", "current stream again", "a Stream", "a Stream again"])
def test_alloc_reads_a_size_object_once(backend: Any, where: str) -> None:
    """Read twice, the buffer claimed 1 MiB of a 512-byte block: its exports then covered
    the next allocation's memory."""
    s = gp.Stream() if "Stream" in where else None
    if where.endswith("again"):
        gp.alloc(64, stream=s).free()  # the fast paths (a cached stream and allocator)
    size = _Flaky()
    buf = gp.alloc(size, stream=s)
    assert size.calls == 1
    assert buf.nbytes == MiB and buf.__cuda_array_interface__["shape"] == (MiB,)
    block = buf._block
    assert block is not None and block.size >= MiB
    nxt = gp.alloc(512, stream=s)
    assert not buf.ptr <= nxt.ptr < buf.ptr + buf.nbytes
    buf.free()
    nxt.free()
    gp.check_invariants()


def test_a_buffers_identity_is_read_only(backend: Any) -> None:
    """Writable, ``nbytes`` could make ``__cuda_array_interface__`` and DLPack describe memory
    the buffer does not own (both builds: properties over private fields)."""
    buf = gp.alloc(256)
    other = gp.Stream()
    for name, value in (("nbytes", 1 << 30), ("ptr", 0x1234), ("stream", other)):
        with pytest.raises(AttributeError):
            setattr(buf, name, value)
    with pytest.raises(AttributeError):
        del buf.nbytes
    assert buf.nbytes == 256 and buf.stream is gp.current_stream() and buf.ptr == buf._block.ptr
    assert buf.__cuda_array_interface__["shape"] == (256,)
    buf.free()


# ------------------------------------------------------------------ 10. small lies
def test_cudagraph_keep_graph_has_pytorchs_meaning(backend: Any) -> None:
    """PyTorch's CUDAGraph(keep_graph=True): capture_end() does not instantiate; instantiate()
    does (the first replay too), and raw_cuda_graph() gives the captured graph."""
    xp = backend.xp
    a = xp.ones(64)
    g = gp.CUDAGraph(keep_graph=True)
    assert g.keep_graph
    with gp.graph(g):
        b = a + 1
    assert g._exec is None and repr(g).endswith("captured>")
    assert isinstance(g.raw_cuda_graph(), int) and g.raw_cuda_graph() == g._graph
    a.fill(5)
    g.replay()  # instantiates first
    first = g._exec
    assert first is not None and float(b.sum().item()) == 64 * 6
    g.instantiate()  # anew: the old executable is destroyed
    assert g._exec is not None
    a.fill(1)
    g.replay()
    assert float(b.sum().item()) == 64 * 2
    with pytest.raises(gp.CaptureError, match="reset"):
        g.capture_begin()
    g.reset()
    with pytest.raises(gp.CaptureError, match="capture first"):
        g.raw_cuda_graph()
    with pytest.raises(gp.CaptureError, match="capture first"):
        g.instantiate()
    h = gp.CUDAGraph()  # keep_graph=False: capture_end() instantiated it
    with gp.graph(h):
        c = a + 2
    assert h._exec is not None
    with pytest.raises(gp.CaptureError, match="keep_graph=True"):
        h.instantiate()
    with pytest.raises(gp.CaptureError, match="keep_graph=True"):
        h.raw_cuda_graph()
    with pytest.raises(TypeError, match="keep_graph"):
        gp.CUDAGraph(keep_graph="yes")  # type: ignore[arg-type]
    del b, c
    h.reset()
    gp.check_invariants()


def test_a_cudagraph_refusing_its_arguments_leaves_a_quiet_finalizer(
    sim: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its __del__ read attributes __init__ never set: AttributeError '_rec', on stderr."""
    seen: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    for kwargs in ({"keep_graph": 1}, {"capture_error_mode": "global"}):
        with pytest.raises(TypeError):
            gp.CUDAGraph(**kwargs)
        gc.collect()
    assert seen == []


def test_reset_inside_a_graph_block_is_refused(backend: Any) -> None:
    """It abandoned the capture silently; leaving the block then said capture_end() had no
    capture_begin(). The block owns its capture: reset() there is a CaptureError (which,
    raised in the body, discards the capture), and works after the block."""
    xp = backend.xp
    gc.collect()
    base = gp.memory_allocated()
    g = gp.CUDAGraph()
    with pytest.raises(gp.CaptureError, match=r"reset\(\) inside"):
        with gp.graph(g):
            x = xp.ones(1 << 10) + 1
            g.reset()
    assert not gp.is_current_stream_capturing() and g._rec is None
    del x
    gc.collect()
    assert gp.memory_allocated() == base
    with gp.graph(g):  # the same graph captures again
        y = xp.ones(8) + 1
    g.replay()
    assert float(y.sum().item()) == 16
    g.reset()  # after the block: fine
    s = gp.Stream()
    with gp.stream(s):  # a capture begun by hand is still abandoned by reset()
        g.capture_begin()
        g.reset()
        assert not gp.is_current_stream_capturing()
    del y
    gp.check_invariants()


def test_cupy_malloc_before_install_names_install() -> None:
    import graphpool.cupy as gcupy

    if gcupy.is_installed() or gcupy._calls[0] is not gcupy._not_installed:
        pytest.skip("graphpool.cupy was installed in this process")
    with pytest.raises(RuntimeError, match=r"install\(\) first"):
        gcupy.malloc(64)
