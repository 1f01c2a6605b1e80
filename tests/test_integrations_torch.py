"""graphpool.torch: the C entry points PyTorch loads, on the simulator through ctypes, and
PyTorch itself with graphpool as its allocator on a GPU (tests/torch_probe.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

import graphpool as gp
from gpu_guard import cuda_unusable
from graphpool import runtime
from graphpool.tools.benchkit import torch_entry_points
from twins import torch_shim_or_skip

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def shim() -> Iterator[Any]:
    """The compiled shim with graphpool's hooks set, on the simulator; closed afterwards."""
    import graphpool.torch as gtorch

    mod = torch_shim_or_skip()
    gp.set_backend("sim")
    mod.set_hooks(*gtorch.hooks())
    try:
        yield mod
    finally:
        mod.close()
        gp.check_invariants()


@pytest.fixture
def lib(shim: Any) -> Any:
    """The shim as PyTorch sees it: a shared library with two C functions."""

    dll = torch_entry_points()
    return dll


def test_c_entry_points_allocate_and_free_through_graphpool(lib: Any) -> None:
    s = gp.Stream()
    base = gp.memory_allocated()
    ptrs = [lib.graphpool_torch_malloc(n, 0, s.handle) for n in (1000, 4096, 3 << 20)]
    assert all(ptrs) and len(set(ptrs)) == 3
    assert gp.memory_allocated() - base == 1024 + 4096 + (3 << 20)
    active = {
        b["address"]
        for seg in gp.memory_snapshot()
        for b in seg["blocks"]
        if b["state"] == "active_allocated"
    }
    assert set(ptrs) <= active
    for p, n in zip(ptrs, (1000, 4096, 3 << 20), strict=True):
        lib.graphpool_torch_free(p, n, 0, s.handle)
    assert gp.memory_allocated() == base
    # the cache serves the next request of that stream from the block just freed
    assert lib.graphpool_torch_malloc(1000, 0, s.handle) == ptrs[0]
    lib.graphpool_torch_free(ptrs[0], 1000, 0, s.handle)


def test_the_c_entry_points_follow_use_mem_pool(lib: Any) -> None:
    """PyTorch's pluggable-allocator calls come from the allocating thread: inside
    use_mem_pool they allocate from the pool."""
    pool = gp.MemPool()
    with gp.use_mem_pool(pool):
        inside = lib.graphpool_torch_malloc(4096, 0, 0)
    outside = lib.graphpool_torch_malloc(4096, 0, 0)
    owner = {b["address"]: seg["segment_pool_id"] for seg in gp.memory_snapshot() for b in seg["blocks"]}
    assert owner[inside] == tuple(pool.id) and owner[outside] is None
    for p in (inside, outside):
        lib.graphpool_torch_free(p, 4096, 0, 0)
    assert pool.memory_stats()["allocated_bytes.all.current"] == 0


def test_zero_bytes_is_a_null_pointer_holding_nothing(lib: Any) -> None:
    base = gp.memory_allocated()
    assert lib.graphpool_torch_malloc(0, 0, 0) is None  # NULL
    assert gp.memory_allocated() == base
    lib.graphpool_torch_free(None, 0, 0, 0)  # PyTorch may free a null pointer: nothing happens
    assert gp.memory_allocated() == base


def test_a_failed_allocation_carries_graphpools_message(shim: Any) -> None:
    # the exported function throws std::runtime_error(message) instead (PyTorch raises it
    # as RuntimeError); try_malloc runs the same path and raises the message here
    with pytest.raises(RuntimeError, match=r"OutOfMemoryError: out of memory on device 0"):
        shim.try_malloc(1 << 60, 0, 0)
    with pytest.raises(RuntimeError, match=r"ForeignPointerError|no device|device"):
        shim.try_malloc(64, 7, 0)  # a device the simulator does not have
    gp.check_invariants()
    assert gp.memory_allocated() == 0


def test_a_bad_free_is_reported_never_raised(lib: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    lib.graphpool_torch_free(0x3039, 8, 0, 0)  # not graphpool's
    assert len(seen) == 1 and type(seen[0].exc_value).__name__ == "ForeignPointerError"
    s = gp.Stream()
    p = lib.graphpool_torch_malloc(512, 0, s.handle)
    lib.graphpool_torch_free(p, 512, 0, s.handle)  # queued (a tensor dropped) ...
    gp.memory_stats()  # ... and carried out at this call
    lib.graphpool_torch_free(p, 512, 0, s.handle)  # twice
    assert len(seen) == 2 and type(seen[1].exc_value).__name__ == "DoubleFreeError"
    p = lib.graphpool_torch_malloc(512, 0, s.handle)
    lib.graphpool_torch_free(p, 512, 0, s.handle)  # parked (policy/heap.py, Note [Parking]) ...
    lib.graphpool_torch_free(p, 512, 0, s.handle)  # ... so a second free is found at once
    assert len(seen) == 3 and type(seen[2].exc_value).__name__ == "DoubleFreeError"
    gp.check_invariants()  # the first free stands
    assert gp.memory_allocated() == 0
    a = gp.runtime.get().allocator(0)
    p = lib.graphpool_torch_malloc(512, 0, s.handle)
    a.drop(p)  # a free queued outside the lane (another thread held the lock, say) ...
    lib.graphpool_torch_free(p, 512, 0, s.handle)  # ... then the same block freed again: queued too
    with pytest.warns(RuntimeWarning, match="DoubleFreeError"):  # found when carried out
        gp.memory_stats()
    gp.check_invariants()


def test_sizes_and_addresses_past_2_63_stay_unsigned(
    shim: Any, lib: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(RuntimeError, match="OutOfMemoryError: out of memory on device 0"):
        shim.try_malloc((1 << 64) - 4096, 0, 0)  # PyTorch's size_t: never a negative size
    seen: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    lib.graphpool_torch_free((1 << 64) - 4096, 8, 0, 0)
    assert "0xfffffffffffff000 was not allocated" in str(seen[0].exc_value)
    gp.check_invariants()


def test_a_replaced_backend_keeps_its_blocks_and_refuses_new_ones(shim: Any, lib: Any) -> None:
    """PyTorch keeps graphpool's allocator for the process: after set_backend, its frees go
    back to the allocator that made each block, and new allocations are refused."""
    old = runtime.get()
    s = gp.Stream()
    p = lib.graphpool_torch_malloc(4096, 0, s.handle)
    gp.set_backend("sim")  # a new runtime
    try:
        lib.graphpool_torch_free(p, 4096, 0, s.handle)  # back to the old allocator, no error
        assert old.allocator(0).memory_stats()["allocated_bytes.all.current"] == 0
        old.allocator(0).check_invariants()
        with pytest.raises(RuntimeError, match="backend was replaced"):
            shim.try_malloc(4096, 0, s.handle)
    finally:
        old.allocator(0).empty_cache()


def test_hooks_want_a_runtime() -> None:
    import graphpool.torch as gtorch

    with pytest.raises(TypeError, match="must be a graphpool runtime"):
        gtorch.hooks(1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"forward_calls\(rt\): rt must be a graphpool runtime"):
        gtorch.forward_calls(_torch_for_forwarding(), "x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="torch must be the torch module"):
        gtorch.forward_calls(None)


def test_after_close_malloc_fails_and_free_does_nothing(shim: Any, lib: Any) -> None:
    s = gp.Stream()
    p = lib.graphpool_torch_malloc(512, 0, s.handle)
    shim.close()  # what atexit does: the interpreter is going away
    with pytest.raises(RuntimeError, match="no allocator hook"):
        shim.try_malloc(512, 0, s.handle)
    lib.graphpool_torch_free(p, 512, 0, s.handle)  # left alone
    assert gp.memory_allocated() == 512
    runtime.allocator(0).free(p)


def test_a_capture_through_the_entry_points_gets_a_private_pool(lib: Any) -> None:
    """PyTorch does not tell a pluggable allocator about its captures: detection does."""
    dev = runtime.get().device(0)
    s = gp.Stream()
    lib.graphpool_torch_free(lib.graphpool_torch_malloc(1 << 20, 0, s.handle), 1 << 20, 0, s.handle)
    dev.begin_capture(s.handle, 0)  # global mode, begun outside graphpool (as PyTorch does)
    tmp = lib.graphpool_torch_malloc(1 << 20, 0, s.handle)
    out = lib.graphpool_torch_malloc(1 << 20, 0, s.handle)
    lib.graphpool_torch_free(tmp, 1 << 20, 0, s.handle)  # freed inside the capture
    graph = dev.end_capture(s.handle)
    eager = lib.graphpool_torch_malloc(1 << 20, 0, s.handle)  # same stream, after the capture
    assert eager not in (tmp, out)  # the captured graph's memory is never handed out
    pools = {seg["segment_pool_id"] for seg in gp.memory_snapshot()} - {None}
    assert len(pools) == 1
    for p in (out, eager):
        lib.graphpool_torch_free(p, 1 << 20, 0, s.handle)
    dev.destroy_graph(graph)
    gp.synchronize()
    gp.empty_cache()
    assert {seg["segment_pool_id"] for seg in gp.memory_snapshot()} == set()


def test_install_refuses_without_cuda_before_touching_pytorch() -> None:
    import graphpool.torch as gtorch

    gp.set_backend("sim")
    expected = "needs the 'cuda' backend" if gp.compiled() else "C\\+\\+ compiler"
    with pytest.raises(RuntimeError, match=expected):
        gtorch.install()
    assert not gtorch.is_installed()
    assert gtorch.installed is gtorch.is_installed  # the older name


def test_plain_install_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    import graphpool.torch as gtorch

    real = builtins.__import__

    def no_shim(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "graphpool" and args and args[2] and "_torch_shim" in args[2]:
            raise ImportError("no shim")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_shim)
    with pytest.raises(RuntimeError, match="C\\+\\+ compiler"):
        gtorch._shim()


@pytest.mark.gpu
def test_pytorch_allocates_through_graphpool() -> None:
    reason = cuda_unusable()
    if reason is not None:
        pytest.skip(reason)
    pytest.importorskip("torch")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(gp.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "torch_probe.py")],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(out, indent=1))
    assert out["installed"] is True
    assert out["allocated_delta"] == out["tensor_bytes"]
    assert out["owned_by_graphpool"] and out["values_ok"] and out["freed_back"]
    assert out["cupy_reuses_torch_block"] in (True, None)
    assert out["backward_ok"] and out["after_oom_ok"] and out["invariants_ok"]
    assert out["oom"].startswith("RuntimeError") and "out of memory" in out["oom"]
    assert out.get("graph") is None, out.get("graph")
    assert out["graph_overwritten"] == 0 and out["graph_result_ok"]
    assert out["graph_private_segments"] >= 1 and out["graph_pool_segments_after_del"] == 0
    # PyTorch's own memory calls answer for graphpool (graphpool.torch.forward_calls)
    assert out["torch_allocated_is_graphpools"] and out["torch_reserved_is_graphpools"]
    assert out["torch_summary"] == "ok: True" and out["torch_peak_reset"]
    assert out["torch_empty_cache"] == "ok: None" and out["torch_empty_cache_released"] >= 64 << 20
    assert out["record_stream"] == "ok: None" and out["record_stream_side_busy"]
    assert out["record_stream_block_held"]
    # the shim's lane: the same block, handed out without Python, every one counted
    assert out["lane_same_block"] and min(out["lane_hits"]) >= 199 and out["lane_counted"] >= 402
    assert out["lane_capture_private"]


def test_hooks_refuse_the_per_thread_default_stream(sim: Any) -> None:
    """A PyTorch stream on handle 2 (cudaStreamPerThread) names a different stream on each
    thread: refused as by every entry point; handle 1 (cudaStreamLegacy) is the legacy stream."""
    import graphpool.torch as gtorch

    malloc, free = gtorch.hooks()
    with pytest.raises(ValueError, match=r"graphpool\.torch: PyTorch's current stream is CUDA's per-thread"):
        malloc(512, 0, 2)
    p = malloc(512, 0, 1)
    block = runtime.allocator(0).lookup(p)
    assert block is not None and block.stream == 0
    free(p, 512, 0, 1)
    assert gp.memory_allocated() == 0


def test_hooks_keep_a_stream_route_only_until_set_backend(sim: Any, monkeypatch: Any) -> None:
    """The hooks keep the route of the stream they served last (graphpool.hooks): a repeated
    allocation skips the backend check and the stream lookup, until set_backend moves the
    routing generation; the bound runtime's blocks still go back to it."""
    import graphpool.torch as gtorch

    looked_up: list[int] = []
    real = gtorch.resolve_handle
    monkeypatch.setattr(
        gtorch, "resolve_handle", lambda stream, *args: (looked_up.append(stream), real(stream, *args))[1]
    )
    old = runtime.get()
    malloc, free = gtorch.hooks()
    p = malloc(512, 0, 0)
    q = malloc(512, 0, 0)  # served by the kept route
    assert looked_up == [0]
    assert p != q and gp.memory_allocated() == 1024
    free(p, 512, 0, 0)
    assert malloc(0, 0, 0) == 0  # a null pointer, even on a kept route
    gp.set_backend("sim")
    with pytest.raises(RuntimeError) as info:
        malloc(512, 0, 0)
    assert str(info.value) == (
        "graphpool.torch: graphpool's backend was replaced (set_backend) after "
        "graphpool.torch.install(); PyTorch keeps graphpool's allocator for the process, "
        "so keep the backend it was installed under"
    )
    with pytest.raises(RuntimeError, match="backend was replaced"):
        gtorch.hooks(old)[0](512, 0, 0)  # hooks bound to the replaced runtime, made now
    free(q, 512, 0, 0)
    assert old.allocator(0).memory_stats()["allocated_bytes.all.current"] == 0
    old.allocator(0).check_invariants()


class _FakeShim:
    """Stands in for the compiled shim: records what install() hands it."""

    __file__ = "/the/shim.so"

    def __init__(self) -> None:
        self.hooks: tuple[Any, ...] = ()
        self.closed = 0

    def set_hooks(self, *hooks: Any) -> None:
        self.hooks = hooks

    def close(self, framework: str | None = None) -> None:
        assert framework in (None, "torch")  # (a refused install closes PyTorch's hooks alone)
        self.closed += 1


def _fake_torch(refuse: Exception | None) -> Any:
    seen: dict[str, Any] = {}

    def pluggable(path: str, malloc: str, free: str) -> tuple[str, str, str]:
        seen["pluggable"] = (path, malloc, free)
        return (path, malloc, free)

    def change(plugged: Any) -> None:
        if refuse is not None:
            raise refuse
        seen["current"] = plugged

    torch = _torch_for_forwarding()
    for owner in (torch.cuda, torch.cuda.memory):
        owner.CUDAPluggableAllocator = pluggable
        owner.change_current_allocator = change
    torch.cuda.is_available = lambda: True
    torch.seen = seen
    return torch


@pytest.mark.parametrize("refused", [False, True])
def test_install_hands_pytorch_the_shims_two_functions(
    monkeypatch: pytest.MonkeyPatch, refused: bool
) -> None:
    """install() with stand-ins for PyTorch and the compiled shim (neither is needed here):
    PyTorch gets the shim's library and its two entry points, or its refusal is explained."""
    import graphpool.torch as gtorch
    import twins
    from graphpool import cooperate

    fake_shim = _FakeShim()
    torch = _fake_torch(RuntimeError("already used") if refused else None)
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setattr(gtorch, "_shim", lambda: fake_shim)
    monkeypatch.setattr(gtorch, "_installed", False)
    monkeypatch.setattr(gtorch.atexit, "register", lambda fn: None)
    monkeypatch.setattr(cooperate, "_served", set())
    twins.use_sim_as_cuda()
    try:
        if refused:
            with pytest.raises(RuntimeError) as info:
                gtorch.install()
            assert str(info.value) == (
                "graphpool.torch.install(): PyTorch refused graphpool's allocator (already used); "
                "install() must run before PyTorch's first CUDA allocation"
            )
            assert fake_shim.closed == 1 and not gtorch.is_installed()
        else:
            gtorch.install()
            assert gtorch.is_installed() and cooperate._served == {"torch"}
            assert torch.seen["current"] == ("/the/shim.so", "graphpool_torch_malloc", "graphpool_torch_free")
            assert torch.cuda.memory_stats()["allocation.all.current"] == 0  # PyTorch's calls forwarded
            assert torch.Tensor.record_stream is not _FakeTensorBase.record_stream
        assert torch.seen["pluggable"] == ("/the/shim.so", "graphpool_torch_malloc", "graphpool_torch_free")
        assert len(fake_shim.hooks) == 2 and all(callable(h) for h in fake_shim.hooks)
    finally:
        gp.set_backend("sim")


def test_without_the_compiled_shim_the_message_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import graphpool.torch as gtorch

    monkeypatch.setitem(sys.modules, "graphpool._torch_shim", None)  # its import fails
    monkeypatch.delattr(gp, "_torch_shim", raising=False)  # (compiled: imported already)
    with pytest.raises(RuntimeError) as info:
        gtorch.library_path()
    assert str(info.value) == (
        "graphpool.torch needs graphpool's compiled shim (graphpool/_torch_shim, C++), which this "
        "install lacks: reinstall graphpool on a machine with a C++ compiler and without "
        "GRAPHPOOL_COMPILE=0"
    )
    monkeypatch.setattr(gtorch, "_shim", _FakeShim)
    assert gtorch.library_path() == "/the/shim.so"


def test_a_tensor_dropped_during_a_capture_not_yet_detected_is_kept_for_its_graph() -> None:
    """PyTorch frees a tensor when it dies, maybe during a capture graphpool has not detected
    yet (no allocation since it began). The hooks queue that free (``CachingAllocator.drop``),
    and the capture's first allocation detects the capture before carrying it out, so the
    block the graph writes is kept for the graph: the eager allocation after gets other memory."""
    import graphpool.torch as gtorch
    from graphpool.device.protocol import CAPTURE_MODES

    gp.set_backend("sim")
    malloc, free = gtorch.hooks()
    dev = runtime.get().device(gp.current_device())
    s = gp.Stream()
    w = malloc(4096, 0, s.handle)
    s.synchronize()
    dev.begin_capture(s.handle, CAPTURE_MODES["relaxed"])
    dev.memset(w, 5, 4096, s.handle)  # the graph writes w
    free(w, 4096, 0, s.handle)  # the tensor dies: queued
    t = malloc(4096, 0, s.handle)  # the capture's first allocation: detected here
    graph = dev.end_capture(s.handle)
    exe = dev.instantiate(graph)
    y = malloc(4096, 0, s.handle)
    assert y != w  # w is the graph's
    dev.memset(y, 7, 4096, s.handle)
    dev.launch(exe, s.handle)
    s.synchronize()
    assert set(dev.read(y, 4096, s.handle)) == {7}  # the replay wrote w, not y
    for p in (t, y):
        free(p, 4096, 0, s.handle)
    dev.destroy_graph_exec(exe)
    dev.destroy_graph(graph)
    gp.synchronize()
    gp.empty_cache()
    gp.check_invariants()


class _FakeTensorBase:
    """PyTorch's C tensor type as forward_calls sees it: a ``record_stream`` of its own."""

    recorded: ClassVar[list[Any]] = []

    def record_stream(self, stream: Any) -> None:
        self.recorded.append(stream)


def _torch_for_forwarding() -> Any:
    """A stand-in for PyTorch's Python memory calls (what forward_calls replaces)."""
    import types

    calls: list[str] = []

    def refused(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("CUDAPluggableAllocator does not yet support getDeviceStats")

    memory = types.SimpleNamespace(
        memory_stats=refused,
        reset_peak_memory_stats=refused,
        reset_accumulated_memory_stats=refused,
        empty_cache=lambda: calls.append("their empty_cache"),
    )

    class Stream:  # torch.cuda.Stream made from a torch.Stream's three numbers
        def __init__(self, stream_id: int, device_index: int, device_type: int) -> None:
            self.cuda_stream, self.device_index = stream_id, device_index

    cuda = types.SimpleNamespace(memory=memory, current_device=lambda: 0, Stream=Stream, **vars(memory))
    device = lambda text: types.SimpleNamespace(  # noqa: E731
        type=str(text).split(":")[0], index=int(str(text).split(":")[1]) if ":" in str(text) else None
    )
    tensor = type("Tensor", (_FakeTensorBase,), {})
    return types.SimpleNamespace(cuda=cuda, device=device, Tensor=tensor, calls=calls)


def _forwarded() -> tuple[Any, Any, Any]:
    """(torch, malloc, free): a stand-in torch whose memory calls graphpool answers
    (``forward_calls``), and the hooks the shim calls, on the current runtime."""
    import graphpool.torch as gtorch

    torch = _torch_for_forwarding()
    gtorch.forward_calls(torch)
    return (torch, *gtorch.hooks())


def _tensor(torch: Any, ptr: int, device: int = 0) -> Any:
    import types

    t = torch.Tensor()
    t.is_cuda = True
    t.device = types.SimpleNamespace(index=device)
    t.untyped_storage = lambda: types.SimpleNamespace(data_ptr=lambda: ptr)
    return t


def test_pytorchs_memory_calls_answer_for_graphpool(sim: Any) -> None:
    """Statistics, peak resets and empty_cache through PyTorch's names reach graphpool's
    allocator of the device PyTorch means (None, an index, "cuda:0")."""

    torch, malloc, free = _forwarded()
    s = gp.Stream()
    p = malloc(3 << 20, 0, s.handle)
    for device in (None, 0, "cuda:0", "cuda"):
        stats = torch.cuda.memory_stats(device)
        assert stats.pop("max_split_size") == -1  # PyTorch's key: none set
        assert stats == gp.memory_stats() and list(stats) == sorted(stats)
        assert torch.cuda.memory.memory_stats(device=device)["allocated_bytes.all.current"] == 3 << 20
    with pytest.raises(ValueError, match="Expected a cuda device"):
        torch.cuda.memory_stats("cpu")
    free(p, 3 << 20, 0, s.handle)  # queued (the tensor died)
    torch.cuda.reset_peak_memory_stats()  # counts that free first: the peak drops to nothing
    assert gp.max_memory_allocated() == 0
    q = malloc(512, 0, s.handle)
    assert gp.max_memory_allocated() == 512
    torch.cuda.memory.reset_accumulated_memory_stats(0)
    assert gp.memory_stats()["allocation.all.allocated"] == 0
    reserved = gp.memory_reserved()
    torch.cuda.empty_cache()
    assert torch.calls == ["their empty_cache"]
    assert gp.memory_reserved() < reserved  # the freed 3 MiB segment went back
    free(q, 512, 0, s.handle)
    gp.synchronize()
    gp.empty_cache()
    gp.check_invariants()


def test_pytorchs_memory_calls_reach_the_device_they_name(sim: Any) -> None:
    """With device 0 current, PyTorch's calls naming device 1 (an index, "cuda:1") read and
    reset device 1's statistics, and leave device 0's alone."""

    torch, malloc, free = _forwarded()  # its current device is 0
    with gp.device(1):
        s1 = gp.Stream()
    p = malloc(2 << 20, 1, s1.handle)
    q = malloc(1 << 20, 1, s1.handle)
    free(p, 2 << 20, 1, s1.handle)
    assert torch.cuda.memory_stats("cuda:1") == gp.memory_stats(1) | {"max_split_size": -1}
    assert torch.cuda.memory_stats("cuda:1")["allocated_bytes.all.current"] == 1 << 20
    assert torch.cuda.memory_stats()["allocated_bytes.all.peak"] == 0  # device 0's
    torch.cuda.reset_peak_memory_stats(1)
    assert gp.max_memory_allocated(1) == 1 << 20
    assert gp.memory_stats(1)["allocation.all.allocated"] == 2
    torch.cuda.memory.reset_accumulated_memory_stats("cuda:1")
    assert gp.memory_stats(1)["allocation.all.allocated"] == 0
    free(q, 1 << 20, 1, s1.handle)
    torch.cuda.empty_cache()  # graphpool's of every device, not only the current one
    assert gp.memory_reserved(1) == 0
    gp.check_invariants()


def test_forward_calls_answers_for_the_runtime_it_is_given(sim: Any) -> None:
    """forward_calls(torch, rt) binds PyTorch's calls to ``rt``, not to the runtime current
    when it is called: after a set_backend they still read the replaced runtime's allocator."""
    import graphpool.torch as gtorch

    rt = runtime.get()
    malloc, free = gtorch.hooks(rt)
    s = gp.Stream()
    p = malloc(4096, 0, s.handle)
    gp.set_backend("sim")  # a new runtime; rt keeps its block
    torch = _torch_for_forwarding()
    gtorch.forward_calls(torch, rt)
    assert torch.cuda.memory_stats()["allocated_bytes.all.current"] == 4096
    assert gp.memory_stats()["allocated_bytes.all.current"] == 0
    free(p, 4096, 0, s.handle)


def test_tensor_record_stream_holds_the_block_for_the_other_stream(sim: Any) -> None:
    """Tensor.record_stream reaches graphpool: the tensor's block, freed, is not handed to
    its stream again while the recorded stream's work runs. A storage graphpool did not
    allocate is left alone. PyTorch's own record_stream still runs first."""

    torch, malloc, free = _forwarded()
    s, side = gp.Stream(), gp.Stream()
    p = malloc(4096, 0, s.handle)
    t = _tensor(torch, p)
    dev = runtime.get().device(0)
    dev.launch_sleep(side.handle, rounds=50)  # type: ignore[attr-defined]
    stream = type("S", (), {"cuda_stream": side.handle})()
    _FakeTensorBase.recorded.clear()
    t.record_stream(stream)
    assert _FakeTensorBase.recorded == [stream]
    free(p, 4096, 0, s.handle)
    q = malloc(4096, 0, s.handle)
    assert q != p  # side still runs: p waits for it
    side.synchronize()
    free(q, 4096, 0, s.handle)
    assert malloc(4096, 0, s.handle) in (p, q)
    _tensor(torch, 0xDEAD000).record_stream(stream)  # not graphpool's: nothing happens
    gp.synchronize()
    gp.check_invariants()


def test_memory_calls_for_a_device_graphpool_never_used_make_no_allocator() -> None:
    """PyTorch's statistics and resets for a device graphpool has no allocator on answer
    zeros and do nothing: no allocator (and so no CUDA context) is made by asking."""
    import graphpool.torch as gtorch
    from graphpool.sim import SimBackend

    runtime.set_backend("sim", backend=SimBackend(device_count=2))
    try:
        torch = _torch_for_forwarding()
        gtorch.forward_calls(torch)
        rt = runtime.get()
        stats = torch.cuda.memory_stats(1)
        assert rt.allocators[1] is None
        assert set(stats) == set(gp.memory_stats(0)) | {"max_split_size"}
        assert set(stats.values()) == {0, -1}
        torch.cuda.reset_peak_memory_stats(1)
        torch.cuda.memory.reset_accumulated_memory_stats("cuda:1")
        assert rt.allocators[1] is None
        with pytest.raises(ValueError):
            torch.cuda.memory_stats(7)  # no such device
    finally:
        gp.set_backend("sim")


def test_tensor_record_stream_takes_a_torch_stream_and_refuses_another_devices(sim: Any) -> None:
    """A ``torch.Stream`` (no ``cuda_stream``: torch.accelerator's) is turned into PyTorch's
    CUDA stream for its handle; a stream of another device than the tensor's is refused with
    a clear error (graphpool's blocks record streams of their own device)."""
    import types

    torch, malloc, free = _forwarded()
    s, side = gp.Stream(), gp.Stream()
    p = malloc(4096, 0, s.handle)
    t = _tensor(torch, p)
    generic = types.SimpleNamespace(stream_id=side.handle, device_index=0, device_type=1)
    t.record_stream(generic)
    free(p, 4096, 0, s.handle)
    runtime.get().device(0).launch_sleep(side.handle, rounds=50)  # type: ignore[attr-defined]
    assert malloc(4096, 0, s.handle) != p  # held for the side stream
    other = types.SimpleNamespace(cuda_stream=side.handle, device_index=1)
    q = malloc(4096, 0, s.handle)
    with pytest.raises(ValueError, match="stream of device 1"):
        _tensor(torch, q).record_stream(other)
    gp.synchronize()
    gp.check_invariants()
