"""The allocator's history (``gp.record_memory_history``) and snapshots in PyTorch's layout
(``gp.torch_snapshot``, ``gp.dump_snapshot``): every kind of event, the ring buffer's bound,
stacks, the pickle, private pools, and PyTorch's own viewer code run on the result."""

from __future__ import annotations

import dataclasses
import gc
import os
import pickle
import pickletools
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import graphpool as gp
from graphpool import build, runtime
from graphpool.policy import history
from graphpool.tools.cli import main
from simenv import fresh_sim

MiB = 1024 * 1024

SEGMENT_KEYS = {
    "device",
    "address",
    "total_size",
    "allocated_size",
    "active_size",
    "requested_size",
    "stream",
    "segment_type",
    "segment_pool_id",
    "is_expandable",
    "frames",
    "blocks",
}
BLOCK_KEYS = {"address", "size", "requested_size", "state", "frames"}
EVENT_KEYS = {"action", "addr", "size", "stream", "time_us", "frames", "compile_context", "user_metadata"}
FRAME_KEYS = {"filename", "line", "name"}

JS_OPCODES = {
    "PROTO", "APPEND", "APPENDS", "LIST", "TUPLE", "NEWFALSE", "NEWTRUE", "NONE", "BINGET",
    "BININT", "BININT1", "BININT2", "EMPTY_DICT", "EMPTY_LIST", "FRAME", "LONG1", "LONG_BINGET",
    "MARK", "MEMOIZE", "BINPUT", "LONG_BINPUT", "SETITEMS", "SETITEM", "DICT", "SHORT_BINUNICODE",
    "BINUNICODE", "STOP", "EMPTY_TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "BINFLOAT",
}  # fmt: skip
"""The pickle opcodes the web viewer's own unpickler reads (MemoryViz.js, ``unpickle``)."""


@pytest.fixture
def rec() -> Iterator[Any]:
    """A simulated backend of two 64 MiB devices, recording without stacks; stops after."""
    with fresh_sim(2) as rt:
        gp.record_memory_history(True, stacks=False)
        try:
            yield rt
        finally:
            gp.record_memory_history(False)


def events(device: int = 0) -> list[dict[str, Any]]:
    return list(gp.torch_snapshot()["device_traces"][device])


def actions(device: int = 0) -> list[str]:
    return [e["action"] for e in events(device)]


def viewer_replay(snap: dict[str, Any], device: int) -> int:
    """Walk ``device``'s events back from the final state as PyTorch's web viewer does
    (MemoryViz.js: ``annotate_snapshot`` folds a free_requested directly followed by its
    free_completed into ``free``; ``simulate_memory`` undoes events from the newest), and
    check at every step what the viewer needs: a ``free_requested`` finds its block, a
    ``segment_alloc`` its segment, and every live block lies in a segment. Returns the
    number of steps."""
    segments = {s["address"]: s["total_size"] for s in snap["segments"] if s["device"] == device}
    blocks = {
        b["address"]: b["size"]
        for s in snap["segments"]
        if s["device"] == device
        for b in s["blocks"]
        if b["state"] in ("active_allocated", "active_pending_free")
    }
    folded: list[dict[str, Any]] = []
    for e in snap["device_traces"][device]:
        last = folded[-1] if folded else None
        if e["action"] == "free_completed" and last and last["action"] == "free_requested":
            if last["addr"] == e["addr"]:
                folded[-1] = {**last, "action": "free"}
                continue
        folded.append(e)

    def check() -> None:
        for addr, size in blocks.items():
            assert any(base <= addr and addr + size <= base + n for base, n in segments.items()), hex(addr)

    check()
    for e in reversed(folded):
        action = e["action"]
        if action in ("free", "free_completed"):
            blocks[e["addr"]] = e["size"]
        elif action == "free_requested":
            assert e["addr"] in blocks, e
        elif action == "alloc":
            blocks.pop(e["addr"], None)
        elif action == "segment_free":
            segments[e["addr"]] = e["size"]
        elif action == "segment_alloc":
            assert segments.pop(e["addr"], None) is not None, e
        check()
    return len(folded)


# ----------------------------------------------------------------------- events
def test_off_by_default_and_when_stopped() -> None:
    gp.set_backend("sim")
    assert not runtime.allocator().recording
    gp.alloc(1000).free()
    assert not any(gp.torch_snapshot()["device_traces"])
    gp.record_memory_history(True)
    assert runtime.allocator().recording
    gp.alloc(1000).free()
    assert "alloc" in actions()
    gp.record_memory_history(False)  # stops and drops the events, as PyTorch's
    assert not runtime.allocator().recording
    assert not any(gp.torch_snapshot()["device_traces"])


def test_alloc_and_free_carry_address_size_stream_device_and_time(rec: Any) -> None:
    s = gp.Stream()
    buf = gp.alloc(1000, stream=s)
    ptr = buf.ptr
    buf.free()
    got = events()
    assert [e["action"] for e in got] == ["segment_alloc", "alloc", "free_requested", "free_completed"]
    seg, alloc, req, done = got
    assert (seg["addr"], seg["size"]) == (ptr, 2 * MiB)  # the segment: its own size
    for e in (alloc, req, done):
        assert (e["addr"], e["size"]) == (ptr, 1000)  # PyTorch's: the bytes asked for
    for e in got:
        assert (e["stream"], e["device"], e["pool_id"], e["frames"]) == (s.handle, 0, None, [])
        assert set(e) >= EVENT_KEYS
    times = [e["time_us"] for e in got]
    assert times == sorted(times) and times[0] > 1_600_000_000 * 10**6  # microseconds since 1970


def test_every_device_records_also_those_made_later_and_after_set_backend(rec: Any) -> None:
    assert rec.allocators[1] is None  # device 1's allocator does not exist yet
    with gp.device(1):
        gp.alloc(4096).free()
    assert actions(1) == ["segment_alloc", "alloc", "free_requested", "free_completed"]
    assert {e["device"] for e in events(1)} == {1}
    gp.set_backend("sim")  # a new runtime: still recording
    gp.alloc(10).free()
    assert "alloc" in actions()


def test_segment_free_through_empty_cache(rec: Any) -> None:
    buf = gp.alloc(3 * MiB)
    ptr = buf.ptr
    buf.free()
    gp.empty_cache()
    last = events()[-1]
    assert (last["action"], last["addr"], last["size"], last["pool_id"]) == (
        "segment_free",
        ptr,
        20 * MiB,
        None,
    )


def test_a_finalizers_free_is_recorded_when_carried_out(rec: Any) -> None:
    buf = gp.alloc(512)
    ptr = buf.ptr
    del buf  # queued by the finalizer, carried out by the next call
    gc.collect()
    gp.alloc(512).free()
    got = [(e["action"], e["addr"]) for e in events()]
    assert ("free_requested", ptr) in got and ("free_completed", ptr) in got


def test_a_free_held_by_another_stream_completes_later(rec: Any) -> None:
    s = gp.Stream()
    buf = gp.alloc(4096)
    ptr = buf.ptr
    buf.record_stream(s)
    rec.device(0).launch_sleep(s.handle, rounds=50)
    buf.free()
    assert actions()[-1] == "free_requested"
    [state] = [
        b["state"] for seg in gp.torch_snapshot()["segments"] for b in seg["blocks"] if b["address"] == ptr
    ]
    assert state == "active_pending_free"
    gp.synchronize()
    gp.alloc(4096).free()  # the next allocation notices the stream's event completed
    got = events()
    done = [i for i, e in enumerate(got) if e["action"] == "free_completed" and e["addr"] == ptr]
    asked = [i for i, e in enumerate(got) if e["action"] == "free_requested" and e["addr"] == ptr]
    assert asked and done and asked[0] < done[0]
    assert got[done[0]]["size"] == 4096


def test_capture_pool_and_graph_events(rec: Any) -> None:
    xp = pytest.importorskip("graphpool.sim.xp")
    kept = gp.alloc(4096)  # eager, freed during the capture: kept for the graph
    kept_ptr = kept.ptr
    g = gp.CUDAGraph()
    with gp.graph(g):
        out = xp.ones(1000) * 2
        kept.free()
        brief = gp.alloc(512)  # a block of the graph's pool, freed in the capture
        brief_ptr = brief.ptr
        brief.free()
    pool = tuple(g.pool())
    got = events()
    names = [e["action"] for e in got]
    create, begin, end = (names.index(a) for a in ("pool_create", "capture_begin", "capture_end"))
    assert create < begin < end
    assert got[create]["pool_id"] == pool
    assert (got[create]["addr"], got[create]["size"], got[create]["stream"]) == (0, 0, 0)
    assert (got[begin]["addr"], got[begin]["size"], got[end]["addr"], got[end]["size"]) == (0, 0, 0, 0)
    asked = [e for e in got[begin:end] if e["action"] == "free_requested" and e["addr"] == brief_ptr]
    assert asked[-1]["pool_id"] == pool
    assert (got[begin]["pool_id"], got[begin]["graph"], got[begin]["foreign"]) == (pool, g.label, False)
    assert (got[end]["graph"], got[end]["failed"], got[end]["capture_id"]) == (
        g.label,
        False,
        got[begin]["capture_id"],
    )
    inside = got[begin + 1 : end]
    assert any(e["action"] == "segment_alloc" and e["pool_id"] == pool for e in inside)
    assert any(e["action"] == "alloc" and e["pool_id"] == pool for e in inside)
    assert ("free_requested", kept_ptr) in [(e["action"], e.get("addr")) for e in inside]
    assert not any(e["action"] == "free_completed" and e["addr"] == kept_ptr for e in got)
    before = len(got)
    del out
    g.reset()  # the graph goes: its kept block completes its free
    gc.collect()
    gp.empty_cache()  # the pool's segments go back, then the pool
    later = events()[before:]
    assert any(e["action"] == "free_completed" and e["addr"] == kept_ptr for e in later)
    assert any(e["action"] == "segment_free" and e["pool_id"] == pool for e in later)
    assert later[-1]["action"] == "pool_release" and later[-1]["pool_id"] == pool
    assert later[-1]["stream"] == 0
    assert viewer_replay(gp.torch_snapshot(), 0) > 10


def test_a_capture_begun_outside_graphpool_is_recorded_as_foreign(rec: Any) -> None:
    from graphpool.device.protocol import CAPTURE_MODE_RELAXED

    dev = rec.device(0)
    s = gp.Stream()
    dev.begin_capture(s.handle, CAPTURE_MODE_RELAXED)  # another library's capture
    buf = gp.alloc(4096, stream=s)  # detected and adopted here
    dev.memset(buf.ptr, 0, 4096, s.handle)
    graph = dev.end_capture(s.handle)
    [begin] = [e for e in events() if e["action"] == "capture_begin"]
    assert begin["foreign"] is True and begin["stream"] == s.handle
    buf.free()
    dev.destroy_graph(graph)


def test_a_failed_capture_ends_failed(rec: Any) -> None:
    g = gp.CUDAGraph()
    with pytest.raises(RuntimeError, match="boom"), gp.graph(g):
        gp.alloc(100)
        raise RuntimeError("boom")
    [end] = [e for e in events() if e["action"] == "capture_end"]
    assert end["failed"] is True


def test_out_of_memory_is_recorded_before_the_observers_run(rec: Any) -> None:
    seen: list[dict[str, Any]] = []
    observer = gp.attach_out_of_memory_observer(lambda d, r, s: seen.append(events()[-1]))
    try:
        s = gp.Stream()
        keep = gp.alloc(40 * MiB)
        with pytest.raises(gp.OutOfMemoryError):
            gp.alloc(40 * MiB, stream=s)
        with pytest.raises(gp.OutOfMemoryError):
            gp.alloc(80 * MiB, stream=s)  # more than the device: refused at once, recorded too
    finally:
        gp.detach_out_of_memory_observer(observer)
    first, second = [e for e in events() if e["action"] == "oom"]
    assert seen == [first, second]  # an observer taking a snapshot sees the error in it
    assert "addr" not in first  # PyTorch's: device_free in place of addr
    assert (first["size"], first["stream"], first["pool_id"]) == (40 * MiB, s.handle, None)
    assert (second["size"], second["stream"]) == (80 * MiB, s.handle)
    assert first["device_free"] == rec.device(0).mem_info()[0] == 24 * MiB
    del keep


@pytest.mark.filterwarnings("ignore:.*captured no work")
def test_out_of_memory_in_a_capture_names_the_graphs_pool(rec: Any) -> None:
    keep = gp.alloc(40 * MiB)
    g = gp.CUDAGraph()
    with gp.graph(g):
        with pytest.raises(gp.OutOfMemoryError):
            gp.alloc(40 * MiB)  # the graph's pool cannot get a segment that large
    [oom] = [e for e in events() if e["action"] == "oom"]
    assert oom["pool_id"] == tuple(g.pool())
    g.reset()
    keep.free()


def test_expandable_segments_record_each_mapping_and_unmapping() -> None:
    from graphpool.policy.pools import DEFAULT

    with fresh_sim(1, sizes=dataclasses.replace(DEFAULT, expandable_segments=True)):
        gp.record_memory_history(True, stacks=False)
        try:
            s = gp.Stream()
            first = gp.alloc(4 * MiB, stream=s)
            more = gp.alloc(6 * MiB, stream=s)  # the segment grows: a mapping after the first
            end = more.ptr
            more.free()
            gp.empty_cache()  # the free end is unmapped, the segment stays
            first.free()
            got = [e for e in events() if e["action"] in ("segment_map", "segment_unmap")]
        finally:
            gp.record_memory_history(False)
    assert [e["action"] for e in got][:1] == ["segment_map"] and got[-1]["action"] == "segment_unmap"
    grow = got[0]
    assert (grow["size"], grow["stream"], grow["pool_id"]) == (6 * MiB, s.handle, None)
    assert all(e["stream"] == s.handle and e["pool_id"] is None for e in got)
    unmap = got[-1]  # the grown part, a whole number of granules after `first`
    assert (unmap["addr"], unmap["size"]) == (end, 6 * MiB)


def test_max_entries_keeps_the_newest(rec: Any) -> None:
    gp.record_memory_history(True, max_entries=5, stacks=False)
    bufs = [gp.alloc(512 * (i + 1)) for i in range(20)]
    got = events()
    assert len(got) == 5
    assert [e["size"] for e in got] == [512 * (i + 1) for i in range(15, 20)]
    gp.record_memory_history(True, max_entries=100, stacks=False)  # again: keeps what it had
    assert events() == got
    for b in bufs:
        b.free()
    assert len(events()) == 45
    assert viewer_replay(gp.torch_snapshot(), 0) > 0  # a cut history still replays


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        gp.record_memory_history(True, max_entries=0)
    with pytest.raises(TypeError, match="int"):
        gp.record_memory_history(True, max_entries=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'state'"):
        gp.record_memory_history("state")
    with pytest.raises(TypeError, match="stacks"):
        gp.record_memory_history(True, stacks="python")  # type: ignore[arg-type]


def test_max_entries_is_bounded_at_the_call(rec: Any) -> None:
    """2**63 was accepted, then every allocation raised OverflowError (the ring buffer's
    length is a C ssize_t) until history was turned off."""
    gp.record_memory_history(False)
    for bad in (sys.maxsize + 1, 2**63, 10**30):
        with pytest.raises(ValueError, match="at most"):
            gp.record_memory_history(True, max_entries=bad)
    gp.alloc(1024).free()  # nothing changed: history stays off, allocations work
    gp.memory_stats()
    gp.check_invariants()
    assert events() == []
    gp.record_memory_history(True, max_entries=sys.maxsize, stacks=False)  # the largest is taken
    gp.alloc(1024).free()
    assert len(events()) >= 2


# ----------------------------------------------------------------------- stacks
def _allocate_here(n: int) -> gp.DeviceBuffer:
    return gp.alloc(n)


def test_stacks_start_at_the_callers_code(rec: Any) -> None:
    gp.record_memory_history(True, stacks=True)
    buf = _allocate_here(4096)
    alloc = [e for e in events() if e["action"] == "alloc"][-1]
    frames = alloc["frames"]
    assert 0 < len(frames) <= history.MAX_FRAMES
    assert all(set(f) == FRAME_KEYS for f in frames)
    assert (Path(frames[0]["filename"]).name, frames[0]["name"]) == ("test_history.py", "_allocate_here")
    assert frames[1]["name"] == "test_stacks_start_at_the_callers_code"
    # the live block and its segment carry the stacks that made them
    snap = gp.torch_snapshot()
    [seg] = [s for s in snap["segments"] if s["address"] <= buf.ptr < s["address"] + s["total_size"]]
    [block] = [b for b in seg["blocks"] if b["address"] == buf.ptr]
    assert block["frames"] == frames and seg["frames"][0]["name"] == "_allocate_here"
    buf.free()
    [block] = [b for s in gp.torch_snapshot()["segments"] for b in s["blocks"] if b["address"] == buf.ptr]
    assert block["frames"] == []  # free again: no stack


def test_stacks_off_records_no_frames(rec: Any) -> None:
    gp.alloc(100).free()
    assert all(e["frames"] == [] for e in events())


def test_stacks_are_capped(rec: Any) -> None:
    gp.record_memory_history(True, stacks=True)

    def deep(n: int) -> None:
        if n:
            deep(n - 1)
        else:
            gp.alloc(100).free()

    deep(history.MAX_FRAMES + 20)
    assert len(events()[-1]["frames"]) == history.MAX_FRAMES


def test_the_skipped_frames_are_the_compiled_modules() -> None:
    """A compiled module has no Python frames: skipping the same modules in plain Python
    gives the same stacks in both builds."""
    package = os.path.dirname(history._POLICY)
    for name in build.COMPILED:
        path = os.path.join(package, name + ".py")
        assert path.startswith(history.SKIPPED_DIR) or path in history.SKIPPED_FILES, name


# --------------------------------------------------------------------- snapshot
def test_pickle_round_trips_with_pytorchs_keys_and_plain_values(rec: Any, tmp_path: Path) -> None:
    gp.record_memory_history(True, stacks=True)
    xp = pytest.importorskip("graphpool.sim.xp")
    eager = gp.alloc(3 * MiB)
    g = gp.CUDAGraph()
    with gp.graph(g):
        out = xp.ones(1000) + 1
    path = tmp_path / "snap.pickle"
    gp.dump_snapshot(path)
    data = path.read_bytes()

    class PlainOnly(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            raise AssertionError(f"the pickle names {module}.{name}")

    with path.open("rb") as fh:
        snap = PlainOnly(fh).load()
    assert snap == gp.torch_snapshot()
    assert {op.name for op, _, _ in pickletools.genops(data)} <= JS_OPCODES
    assert data[1] == 4  # protocol 4: the viewer's unpickler reads 2 to 4
    assert set(snap) == {"segments", "device_traces", "allocator_settings", "external_annotations"}
    assert len(snap["device_traces"]) == 2
    assert snap["segments"]
    for seg in snap["segments"]:
        assert set(seg) >= SEGMENT_KEYS
        assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]
        assert seg["allocated_size"] == sum(
            b["size"] for b in seg["blocks"] if b["state"] == "active_allocated"
        )
        for b in seg["blocks"]:
            assert set(b) >= BLOCK_KEYS
            assert b["state"] in ("active_allocated", "active_pending_free", "inactive")
    for e in snap["device_traces"][0]:
        assert set(e) >= EVENT_KEYS - ({"addr"} if e["action"] == "oom" else set())
        assert all(set(f) == FRAME_KEYS for f in e["frames"])
    del eager, out


def test_private_pool_segments_carry_their_pool_id_and_graphs(rec: Any) -> None:
    xp = pytest.importorskip("graphpool.sim.xp")
    eager = gp.alloc(100)
    g = gp.CUDAGraph()
    with gp.graph(g):
        out = xp.ones(1000) * 3
    pool = tuple(g.pool())
    segs = gp.torch_snapshot()["segments"]
    private = [s for s in segs if s["segment_pool_id"] == pool]
    ordinary = [s for s in segs if s["segment_pool_id"] == (0, 0)]  # PyTorch's id of no private pool
    assert private and ordinary
    assert all(s["pool_graphs"] == [g.label] for s in private)
    assert all(s["pool_graphs"] == [] for s in ordinary)
    [owned] = [b for s in private for b in s["blocks"] if b["state"] == "active_allocated"]
    assert owned["owner_graph"] == g.label
    del eager, out


# -------------------------------------------------------------------------- CLI
def test_snapshot_command_writes_pickle_html_and_says_about_png(
    sim: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    assert main(["snapshot", "--out", str(tmp_path), "--backend", "sim"]) == 0
    said = capsys.readouterr().out
    assert "matplotlib is not installed" in said and not (tmp_path / "snapshot.png").exists()
    assert not runtime.allocator().recording  # the command stops recording after
    with (tmp_path / "snapshot.pickle").open("rb") as fh:
        snap = pickle.load(fh)
    page = (tmp_path / "snapshot.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page
    assert "<script" not in page and "src=" not in page and "href=" not in page  # nothing fetched
    private = [s for s in snap["segments"] if s["segment_pool_id"] != (0, 0)]
    assert private and len(snap["segments"]) > len(private)
    for seg in snap["segments"]:
        assert f"0x{seg['address']:x}" in page
    assert f"private pool {private[0]['segment_pool_id']}" in page and "graph#" in page
    assert "Memory over time" in page and "capture_begin" in page
    assert viewer_replay(snap, 0) > 10


def test_snapshot_command_with_the_demo_and_a_png(sim: Any, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    assert main(["snapshot", "--out", str(tmp_path), "--demo", "--backend", "sim"]) == 0
    assert (tmp_path / "snapshot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with (tmp_path / "snapshot.pickle").open("rb") as fh:
        snap = pickle.load(fh)
    got = [e["action"] for e in snap["device_traces"][0]]
    assert got.count("capture_begin") > 5 and "pool_release" in got  # the demo's graphs
    viewer_replay(snap, 0)


def test_levels_over_time_are_worked_back_from_the_final_state(rec: Any) -> None:
    from graphpool.tools import viz

    a = gp.alloc(1000)
    b = gp.alloc(5 * MiB)
    a.free()
    [d] = viz.devices(gp.torch_snapshot())
    assert d.allocated == [0, 0, 1000, 1000, 1000 + 5 * MiB, 5 * MiB, 5 * MiB]
    assert d.reserved == [0, 2 * MiB, 2 * MiB, 22 * MiB, 22 * MiB, 22 * MiB, 22 * MiB]
    del b


# ------------------------------------------------------------- PyTorch's viewer
def test_pytorchs_viewer_code_reads_the_snapshot(rec: Any) -> None:
    """torch.cuda._memory_viz (PyTorch's text, flame graph and HTML views) on a snapshot
    of the simulator. Runs wherever torch imports (the GPU machine has torch 2.11)."""
    mv = pytest.importorskip("torch.cuda._memory_viz")
    xp = pytest.importorskip("graphpool.sim.xp")
    gp.record_memory_history(True, stacks=True)
    keep = [gp.alloc(n) for n in (100, 4096, 3 * MiB)]
    gp.alloc(1 << 16).free()
    g = gp.CUDAGraph()
    with gp.graph(g):
        out = xp.ones(1000) * 2
    with pytest.raises(gp.OutOfMemoryError):
        gp.alloc(80 * MiB)
    snap = gp.torch_snapshot()

    def lines(text: str) -> str:  # instead of the flamegraph.pl download
        return text

    stats = mv.segsum(snap)
    assert f"segments: {len(snap['segments'])}" in stats
    text = mv.trace(snap)
    assert "cudaMalloc" in text and "raise OutOfMemoryError" in text
    assert "stream_" in mv.segments(snap, lines) and "active_allocated" in mv.memory(snap, lines)
    mv.compare(snap["segments"], snap["segments"][:1], lines)
    for page in (
        mv.trace_plot(snap),
        mv.trace_plot(snap, plot_segments=True),
        mv.segment_plot(snap),
    ):
        assert "snapshot.pickle" in page
    if hasattr(mv, "filter_alloc_free_pairs"):
        mv.trace_plot(pickle.loads(pickle.dumps(snap)), filter_freed=True)
    del keep, out


@pytest.mark.gpu
def test_the_layout_matches_pytorchs_own_snapshot() -> None:
    """PyTorch's ``torch.cuda.memory._snapshot()`` on this GPU, with a graph capture and an
    out-of-memory error: every key it has, graphpool's snapshot has too, at every level."""
    from gpu_guard import OPTIONAL_MISSING, cuda_unusable

    reason = cuda_unusable()
    if reason is not None:
        pytest.skip(reason)
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip(f"{OPTIONAL_MISSING} torch (a build without CUDA)")
    torch.cuda.memory._record_memory_history(max_entries=10_000)
    try:
        x = torch.empty(1000, device="cuda")
        del x
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = torch.ones(1000, device="cuda") * 2
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
        theirs = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(None)
    del g, y
    gp.set_backend("cuda")
    gp.record_memory_history(True)
    try:
        buf = gp.alloc(1000)
        buf.free()
        keep = gp.alloc(4000)
        with pytest.raises(gp.OutOfMemoryError):
            gp.alloc(1 << 50)
        ours = gp.torch_snapshot()
    finally:
        gp.record_memory_history(False)
        del keep
        gp.empty_cache()
        gp.set_backend("sim")
    assert set(theirs) <= set(ours)
    assert set(theirs["allocator_settings"]) & set(ours["allocator_settings"])
    assert set(theirs["segments"][0]) <= set(ours["segments"][0])
    assert set(theirs["segments"][0]["blocks"][0]) <= set(ours["segments"][0]["blocks"][0])
    mine = {e["action"]: set(e) for e in ours["device_traces"][0]}
    for e in theirs["device_traces"][0]:
        if e["action"] in mine:
            assert set(e) <= mine[e["action"]], e["action"]
    assert {"alloc", "free_requested", "free_completed", "segment_alloc", "oom"} <= set(mine)
    frames = [f for e in theirs["device_traces"][0] for f in e["frames"]]
    assert frames and set(frames[0]) == FRAME_KEYS


@pytest.mark.parametrize("path", [0, 1, True, None, 2.5])
def test_dump_snapshot_wants_a_path_not_a_file_descriptor(path: Any) -> None:
    """An int is not taken as a file descriptor (``True`` would write to stdout and close it)."""
    with pytest.raises(TypeError, match="needs a file path"):
        gp.dump_snapshot(path)
    os.fstat(1)  # stdout still open


def test_each_unmapped_free_end_counts_as_a_device_free() -> None:
    from graphpool.policy.pools import DEFAULT

    with fresh_sim(1, sizes=dataclasses.replace(DEFAULT, expandable_segments=True)):
        s = gp.Stream()
        first = gp.alloc(4 * MiB, stream=s)
        before = gp.memory_stats()["num_device_free"]
        for _ in range(2):
            more = gp.alloc(6 * MiB, stream=s)  # the segment grows ...
            more.free()
            gp.empty_cache()  # ... and its free end is unmapped again
        assert gp.memory_stats()["num_device_free"] == before + 2
        first.free()
