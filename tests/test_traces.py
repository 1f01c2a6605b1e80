"""graphpool.traces (the trace format, synthetic traces, the PyTorch and CuPy recorders) and
the trace-replay section of the bench."""

from __future__ import annotations

import gzip
import json
import statistics
import sys
import types
from pathlib import Path
from typing import Any

import pytest

import graphpool as gp
from graphpool.tools import trace_bench, traces
from graphpool.tools.traces import Trace

MiB = 1 << 20


def _small() -> Trace:
    return Trace(
        "small",
        "made by hand",
        [(1, 0, 100, 0), (1, 1, 50, 0), (0, 0), (1, 2, 70, 1), (0, 1), (1, 0, 10, 0)],
        {"program": "test"},
    )


# ----------------------------------------------------------------------------- format
def test_save_and_read_round_trip(tmp_path: Path) -> None:
    t = _small()
    path = tmp_path / "small.json.gz"
    traces.save(t, path)
    back = traces.read(path)
    assert back == t
    assert all(type(e) is tuple for e in back.events)
    # compact: events are flat lists; no timestamp in the gzip header, so the bytes repeat
    doc = json.loads(gzip.decompress(path.read_bytes()))
    assert doc["events"][:3] == [[1, 0, 100, 0], [1, 1, 50, 0], [0, 0]]
    assert doc["format"] == "graphpool-trace" and doc["version"] == 1
    traces.save(t, tmp_path / "again.json.gz")
    assert (tmp_path / "again.json.gz").read_bytes() == path.read_bytes()


def test_read_refuses_what_is_not_a_trace(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json.gz"
    bad.write_bytes(b"not gzip")
    with pytest.raises(ValueError, match="not a gzip-compressed JSON trace"):
        traces.read(bad)
    bad.write_bytes(gzip.compress(json.dumps({"events": []}).encode()))
    with pytest.raises(ValueError, match="not a graphpool trace"):
        traces.read(bad)
    doc = {"format": "graphpool-trace", "version": 99, "name": "x", "events": []}
    bad.write_bytes(gzip.compress(json.dumps(doc).encode()))
    with pytest.raises(ValueError, match="version 99"):
        traces.read(bad)
    doc = {"format": "graphpool-trace", "version": 1, "name": "x", "events": [[0, 5]]}
    bad.write_bytes(gzip.compress(json.dumps(doc).encode()))
    with pytest.raises(ValueError, match="free of id 5, which is not live"):
        traces.read(bad)


def test_available_and_load_read_the_package_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(traces, "_data_dir", lambda: tmp_path / "trace_data")
    assert traces.available() == []  # no directory at all
    (tmp_path / "trace_data").mkdir()
    traces.save(_small(), tmp_path / "trace_data" / "b-trace.json.gz")
    traces.save(traces.synthetic(1, 50), tmp_path / "trace_data" / "a-trace.json.gz")
    (tmp_path / "trace_data" / "README.md").write_text("not a trace")
    assert traces.available() == ["a-trace", "b-trace"]
    assert traces.load("b-trace") == _small()
    with pytest.raises(ValueError, match=r"no shipped trace named 'c'.*a-trace, b-trace"):
        traces.load("c")
    with pytest.raises(ValueError, match="trace name"):
        traces.load("../b-trace")


def test_graphpool_traces_is_the_documented_name_of_the_tools_module() -> None:
    """README's ``graphpool.traces.available()``, ``load(name)`` and the recorders work
    under that name: the same objects as graphpool.tools.traces, every public one."""
    import graphpool.traces as documented

    defined = {
        n
        for n, v in vars(traces).items()
        if not n.startswith("_") and getattr(v, "__module__", None) == traces.__name__
    }
    assert defined and defined <= set(documented.__all__)
    for name in documented.__all__:
        assert getattr(documented, name) is getattr(traces, name), name
    assert documented.available() == traces.available()


def test_pyproject_ships_the_trace_data() -> None:
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert '"tools/trace_data/*.json.gz"' in text


@pytest.mark.parametrize("name", traces.available())
def test_shipped_traces_load_and_say_how_they_were_recorded(name: str) -> None:
    t = traces.load(name)  # validated on load
    assert t.name == name
    assert len(t.events) <= 50_000 and t.allocations > 0
    assert "Recorded on" in t.description and t.info.get("gpu") and t.info.get("date")


# ----------------------------------------------------------------------------- checks
@pytest.mark.parametrize(
    ("events", "message"),
    [
        ([(0, 3)], r"event 0: free of id 3, which is not live"),
        ([(1, 3, 8, 0), (0, 3), (0, 3)], r"event 2: free of id 3, which is not live"),
        ([(1, 3, 8, 0), (1, 3, 8, 0)], r"event 1: alloc of id 3, which is still live \(allocated at event 0"),
        ([(1, 3, -1, 0)], r"event 0: alloc of id 3 has a negative size -1"),
        ([(1, 3, 8, -1)], r"event 0: alloc of id 3 has a negative stream index -1"),
        ([(1, 3, 8)], r"event 0: \(1, 3, 8\) is neither"),
        ([(2, 3)], r"event 0: \(2, 3\) is neither"),
        ([(0, 3, 1, 1)], r"is neither"),
        ([(1, 3, 8.0, 0)], r"event 0: .* is not a tuple of ints"),
        ([(1, 3, True, 0)], r"is not a tuple of ints"),
        ([5], r"event 0: 5 is not a tuple of ints"),
    ],
)
def test_validate_names_the_first_bad_event(events: list[Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        traces.validate(Trace("t", "", events))


_SNAPSHOT = {"device_traces": [[{"action": "alloc", "addr": 1, "size": 8, "stream": 0}]]}
BAD_CALLS: dict[str, tuple[Any, type[Exception], str]] = {
    # wrong object types: each raised AttributeError (177 of 2,243 fuzzed misuse cases)
    "validate-str": (lambda: traces.validate("small"), TypeError, r"traces\.validate needs a Trace"),
    "validate-dict": (lambda: traces.validate({"name": "x"}), TypeError, "needs a Trace"),
    "summary-None": (lambda: traces.summary(None), TypeError, r"traces\.summary needs a Trace"),
    "summary-bad-event": (lambda: traces.summary(Trace("t", "", [(7,)])), ValueError, "event 0"),
    "peak-list": (lambda: traces.peak_live_bytes([]), TypeError, "needs a Trace"),
    "truncated-int": (lambda: traces.truncated(5, 1), TypeError, "needs a Trace"),
    "truncated-str-count": (lambda: traces.truncated(_small(), "3"), TypeError, "max_events"),
    "truncated-bool-count": (lambda: traces.truncated(_small(), True), TypeError, "max_events"),
    "save-str": (lambda: traces.save("small", "x.json.gz"), TypeError, "needs a Trace"),
    "save-bad-path": (lambda: traces.save(_small(), 5), TypeError, "file path"),
    "read-bad-path": (lambda: traces.read(None), TypeError, "file path"),
    "load-int": (lambda: traces.load(3), TypeError, "trace name must be a str"),
    "load-bad-name": (lambda: traces.load("../etc"), ValueError, "trace name"),
    "Trace-name": (lambda: Trace(5, "", []), TypeError, "Trace.name"),
    "Trace-events": (lambda: Trace("t", "", 5), TypeError, "Trace.events"),
    "Trace-info": (lambda: Trace("t", "", [], {"a": 1}), TypeError, "Trace.info"),
    "synthetic-seed": (lambda: traces.synthetic("0"), TypeError, "seed"),
    "synthetic-n_ops": (lambda: traces.synthetic(0, n_ops="5"), TypeError, "n_ops"),
    "synthetic-n_ops-negative": (lambda: traces.synthetic(0, n_ops=-1), ValueError, "n_ops"),
    "synthetic-streams": (lambda: traces.synthetic(0, 10, streams=True), TypeError, "streams"),
    "synthetic-streams-3": (lambda: traces.synthetic(0, 10, streams=3), ValueError, "streams"),
    "synthetic-name": (lambda: traces.synthetic(0, 10, name=5), TypeError, "name"),
    "torch-list": (lambda: traces.from_torch_snapshot([]), TypeError, "_snapshot"),
    "torch-device-str": (lambda: traces.from_torch_snapshot(_SNAPSHOT, "0"), TypeError, "device"),
    "torch-device-range": (lambda: traces.from_torch_snapshot(_SNAPSHOT, 3), ValueError, "device 3"),
    "torch-entry-int": (
        lambda: traces.from_torch_snapshot({"device_traces": [[5]]}),
        ValueError,
        r"device_traces\[0\]\[0\]",
    ),
    "torch-entry-no-addr": (
        lambda: traces.from_torch_snapshot({"device_traces": [[{"action": "alloc", "size": 8}]]}),
        ValueError,
        "'addr'",
    ),
    "torch-name": (lambda: traces.from_torch_snapshot(_SNAPSHOT, name=None), TypeError, "name"),
    "torch-info": (lambda: traces.from_torch_snapshot(_SNAPSHOT, info=[1]), TypeError, "info"),
}


@pytest.mark.parametrize("name", sorted(BAD_CALLS))
def test_wrong_arguments_are_typed_errors_that_name_them(name: str) -> None:
    call, error, match = BAD_CALLS[name]
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize(
    ("doc", "match"),
    [
        ({"format": "graphpool-trace", "version": 1, "events": []}, '"name"'),
        ({"format": "graphpool-trace", "version": 1, "name": "t", "events": 5}, '"events"'),
        ({"format": "graphpool-trace", "version": 1, "name": "t", "events": [5]}, '"events"'),
        ({"format": "graphpool-trace", "version": 1, "name": "t", "events": [], "info": [1]}, '"info"'),
        ({"format": "graphpool-trace", "version": 1, "name": 7, "events": []}, '"name"'),
    ],
)
def test_a_malformed_trace_file_is_a_value_error(tmp_path: Path, doc: dict[str, Any], match: str) -> None:
    path = tmp_path / "bad.json.gz"
    path.write_bytes(gzip.compress(json.dumps(doc).encode()))
    with pytest.raises(ValueError, match=match):
        traces.read(path)


def test_validate_accepts_id_reuse_after_free_and_leftovers() -> None:
    traces.validate(_small())  # id 0 reused after its free; ids 0 and 2 left live
    traces.validate(Trace("empty", "", []))
    with pytest.raises(ValueError, match="trace name"):
        traces.validate(Trace("has space", "", []))


def test_peak_live_bytes_and_summary() -> None:
    t = _small()  # live: 100, 150, 50, 120, 70, 80
    assert traces.peak_live_bytes(t) == 150
    assert traces.peak_live_bytes(Trace("e", "", [])) == 0
    assert traces.summary(t) == {
        "name": "small",
        "events": 6,
        "allocations": 4,
        "streams": 2,
        "distinct sizes": 4,
        "peak live bytes": 150,
        "live at the end": 2,
    }


def test_truncated_keeps_a_valid_prefix() -> None:
    t = _small()
    cut = traces.truncated(t, 3)
    assert cut.events == t.events[:3] and cut.info["truncated"] == "first 3 of 6 events"
    traces.validate(cut)
    assert traces.truncated(t, 6) is t
    with pytest.raises(ValueError):
        traces.truncated(t, -1)


# ----------------------------------------------------------------------------- synthetic
def test_synthetic_is_deterministic_per_seed_and_valid() -> None:
    a = traces.synthetic(7, 3000)
    assert a == traces.synthetic(7, 3000)
    assert a.events != traces.synthetic(8, 3000).events
    assert len(a.events) == 3000 and a.streams == 1 and a.name == "synthetic-7"
    traces.validate(a)
    assert traces.synthetic(0).events[:3000] != a.events


def test_synthetic_has_the_advertised_mix() -> None:
    t = traces.synthetic(0)
    sizes = [e[2] for e in t.events if e[0] == 1]
    small = sum(512 <= n <= MiB for n in sizes)
    large = sum(MiB < n <= 64 * MiB for n in sizes)
    huge = sum(n > 64 * MiB for n in sizes)
    assert small + large + huge == len(sizes) and min(sizes) >= 512
    assert small > 0.6 * len(sizes) and large > 0.05 * len(sizes) and huge > 0
    born: dict[int, int] = {}
    lifetimes = []
    for i, e in enumerate(t.events):
        if e[0] == 1:
            born[e[1]] = i
        else:
            lifetimes.append(i - born.pop(e[1]))
    assert statistics.median(lifetimes) <= 10  # mostly short-lived
    assert max(lifetimes) > 1000 and born  # some long-lived, some never freed


def test_synthetic_on_two_streams() -> None:
    t = traces.synthetic(2, 4000, streams=2)
    traces.validate(t)
    assert t.streams == 2 and t.name == "synthetic-2-2s"
    on_second = [e for e in t.events if e[0] == 1 and e[3] == 1]
    assert 0 < len(on_second) < t.allocations / 2
    with pytest.raises(ValueError, match="streams"):
        traces.synthetic(0, streams=3)
    with pytest.raises(ValueError, match="n_ops"):
        traces.synthetic(0, -1)


# ----------------------------------------------------------------------------- PyTorch
def test_from_torch_snapshot() -> None:
    s0, s1 = 0, 0x7F00_1234  # the default stream, then a side stream's handle
    entries = [
        {"action": "segment_alloc", "addr": 0x1000, "size": 2 * MiB, "stream": s0},
        {"action": "alloc", "addr": 0x1000, "size": 512, "stream": s0},
        {"action": "alloc", "addr": 0x1200, "size": 1000, "stream": s1},
        {"action": "free_requested", "addr": 0x1000, "size": 512, "stream": s0},
        {"action": "free_completed", "addr": 0x1000, "size": 512, "stream": s0},
        {"action": "free_requested", "addr": 0x9000, "size": 64, "stream": s0},  # made before the history
        {"action": "alloc", "addr": 0x1000, "size": 256, "stream": s0},  # the address again: a new id
        {"action": "snapshot", "addr": 0, "size": 0, "stream": 0},
        {"action": "oom", "device_free": 0, "size": 1 << 40, "stream": s1},
        {"action": "segment_map", "addr": 0x4000, "size": 2 * MiB, "stream": s1},
        {"action": "segment_unmap", "addr": 0x4000, "size": 2 * MiB, "stream": s1},
        {"action": "free_requested", "addr": 0x1200, "size": 1000, "stream": s1},
        {"action": "alloc", "addr": 0x1400, "size": 4096, "stream": s1},  # left live
        {"action": "free_completed", "addr": 0x1200, "size": 1000, "stream": s1},
        {"action": "segment_free", "addr": 0x1000, "size": 2 * MiB, "stream": s0},
        {"action": "some_future_action", "addr": 0, "size": 0, "stream": 0},
    ]
    snap = {"segments": [], "device_traces": [[], entries]}
    t = traces.from_torch_snapshot(
        snap, device=1, name="torch-test", description="hand-made", info={"gpu": "none"}
    )
    assert t.events == [
        (1, 0, 512, 0),
        (1, 1, 1000, 1),
        (0, 0),
        (1, 2, 256, 0),
        (0, 1),
        (1, 3, 4096, 1),
    ]
    assert t.name == "torch-test" and t.description == "hand-made" and t.streams == 2
    assert t.info["gpu"] == "none" and t.info["tool"] == "torch.cuda.memory._snapshot"
    assert t.info["frees of allocations made before the history dropped"] == "1"
    assert t.info["actions of unknown kind ignored"] == "1"
    assert traces.peak_live_bytes(t) == 256 + 4096  # the last two, live together at the end
    assert traces.from_torch_snapshot({"device_traces": [[]]}).events == []


def test_from_torch_snapshot_frees_an_address_reused_without_a_free() -> None:
    entries = [
        {"action": "alloc", "addr": 0x1000, "size": 8, "stream": 0},
        {"action": "alloc", "addr": 0x1000, "size": 16, "stream": 0},
    ]
    t = traces.from_torch_snapshot({"device_traces": [entries]})
    assert t.events == [(1, 0, 8, 0), (0, 0), (1, 1, 16, 0)]
    assert t.info["allocations freed where their address was reused (free missing)"] == "1"


def test_from_torch_snapshot_refuses_a_wrong_dict() -> None:
    with pytest.raises(ValueError, match="device_traces"):
        traces.from_torch_snapshot({"segments": []})
    with pytest.raises(ValueError, match="device 2: the snapshot has traces for 1 device"):
        traces.from_torch_snapshot({"device_traces": [[]]}, device=2)


# ----------------------------------------------------------------------------- CuPy
class _FakeCuPy:
    """Just enough of cupy for RecordingAllocator: a pool, streams, PythonFunctionAllocator
    (which, as CuPy's, calls malloc only for a size > 0 and free only for a non-null pointer)."""

    def __init__(self) -> None:
        self.stream_ptr = 0
        self.allocator: Any = "cupy's own"
        self.pool_frees: list[int] = []
        fake = self

        class Pointer:
            def __init__(self, ptr: int) -> None:
                self.ptr = ptr

            def __del__(self) -> None:
                fake.pool_frees.append(self.ptr)

        class Pool:
            next = 0x1000

            def malloc(self, size: int) -> Pointer:
                Pool.next += 0x1000
                return Pointer(Pool.next)

        class PythonFunctionAllocator:
            def __init__(self, malloc: Any, free: Any) -> None:
                self._malloc, self._free = malloc, free

            def malloc(self, size: int) -> Any:
                ptr = self._malloc(size, 0) if size > 0 else 0
                free = self._free

                class Memory:
                    def __del__(self) -> None:
                        if ptr:
                            free(ptr, 0)

                return Memory()

        cuda = types.SimpleNamespace(
            MemoryPool=Pool,
            memory=types.SimpleNamespace(PythonFunctionAllocator=PythonFunctionAllocator),
            get_current_stream=lambda: types.SimpleNamespace(ptr=fake.stream_ptr),
            get_allocator=lambda: fake.allocator,
            set_allocator=lambda a: setattr(fake, "allocator", a),
        )
        self.module = types.SimpleNamespace(cuda=cuda)


def test_recording_allocator_logs_a_cupy_program(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeCuPy()
    monkeypatch.setitem(sys.modules, "cupy", fake.module)
    rec = traces.RecordingAllocator()
    with rec:
        alloc = fake.allocator
        assert alloc == rec.allocator.malloc  # installed as CuPy's allocator inside the block
        a = alloc(100)
        fake.stream_ptr = 0xABC  # another stream
        b = alloc(200)
        zero = alloc(0)  # no memory: CuPy calls neither malloc nor free
        del a
        fake.stream_ptr = 0
        c = alloc(300)
        del b, zero
    assert fake.allocator == "cupy's own"  # restored
    t = rec.trace("cupy-test", "a fake program", {"gpu": "none"})
    assert t.events == [(1, 0, 100, 0), (1, 1, 200, 1), (0, 0), (1, 2, 300, 0), (0, 1)]
    assert t.info["gpu"] == "none" and "RecordingAllocator" in t.info["tool"]
    assert len(fake.pool_frees) == 2  # the freed blocks went back to the pool
    del c


def test_traces_import_no_framework() -> None:
    import subprocess

    code = "import graphpool.traces, sys; print(sorted({'cupy', 'torch', 'numpy'} & set(sys.modules)))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "cupy" not in r.stdout and "torch" not in r.stdout


# ----------------------------------------------------------------------------- replay
def test_replay_events_free_leftovers_and_skip_zero_sizes() -> None:
    t = Trace("t", "", [(1, 0, 100, 1), (1, 1, 0, 0), (1, 2, 5, 0), (0, 1), (0, 0)])
    assert trace_bench._trace_events(t) == [(1, 0, 100, 1), (1, 2, 5, 0), (0, 0, 0, 1), (0, 2, 0, 0)]


@pytest.mark.parametrize("streams", [1, 2])
def test_replay_through_graphpool_frees_everything(sim: Any, streams: int) -> None:
    t = traces.synthetic(5, 3000, streams=streams)
    events = trace_bench._trace_events(t)
    gp_streams = [gp.Stream() for _ in range(t.streams)]
    sides = trace_bench._graphpool_sides(events, gp_streams)
    gp.reset_peak_memory_stats()
    for name in ("graphpool", "policy"):
        sides[name].replay()
        assert gp.memory_allocated() == 0, name
        gp.check_invariants()
    stats = gp.memory_stats()
    # the peak of what was live, each request rounded up to 512 B as the allocator does
    rounded = Trace(
        t.name, "", [(1, e[1], -(-max(e[2], 1) // 512) * 512, e[3]) if e[0] else e for e in t.events]
    )
    assert stats["allocated_bytes.all.peak"] >= traces.peak_live_bytes(rounded) > 0
    sides["graphpool"].empty()
    assert gp.memory_reserved() == 0
    peak = sides["graphpool"].peak
    assert peak is not None and peak() >= traces.peak_live_bytes(rounded)


def test_bench_traces_quick(backend: Any) -> None:
    skipped: list[dict[str, str]] = []
    r = trace_bench.bench_traces(2, quick=True, skipped=skipped)
    assert r["rounds"] == {"warm": 2, "cold": 2}
    assert list(r["traces"]) == ["synthetic-0"]  # quick: the short synthetic trace only
    row = r["traces"]["synthetic-0"]
    ran = list(r["sides"])
    assert ran[:3] == ["graphpool", "policy", "expandable"]
    quick = traces.synthetic(0, trace_bench.QUICK_TRACE_OPS)
    assert row["operations"] == len(trace_bench._trace_events(quick))
    assert row["peak live (bytes)"] == traces.peak_live_bytes(quick)
    for side in ran:
        assert row[f"{side}, warm (us)"] > 0 and row[f"{side}, cold (us)"] > 0
    assert "policy, peak reserved (bytes)" not in row  # the same allocator as graphpool's
    assert row["graphpool, peak reserved (bytes)"] >= row["peak live (bytes)"]
    assert row["graphpool peak reserved/peak live"] >= 1
    # expandable segments: their own allocator, peak and time ratio to the option off
    assert row["expandable peak reserved/peak live"] >= 1
    assert row["expandable/policy time, warm"] == pytest.approx(
        row["expandable, warm (us)"] / row["policy, warm (us)"]
    )
    others = {
        "cupy": "CuPy MemoryPool",
        "torch": "PyTorch caching allocator",
        "cudaMallocAsync": "cudaMallocAsync",
    }
    reasons = {s["comparison"]: s["why"] for s in skipped}
    for side, what in others.items():
        if side in ran:
            assert row[f"graphpool/{side} time, warm"] == pytest.approx(
                row["graphpool, warm (us)"] / row[f"{side}, warm (us)"]
            )
            assert f"graphpool/{side} time, cold" in row and row[f"{side}, peak reserved (bytes)"] > 0
        else:
            assert f"allocation traces vs {what}" in reasons, (side, reasons)
    if backend.name == "sim":
        assert ran == ["graphpool", "policy", "expandable"]
        assert len(skipped) == 3 and all("this is the simulator" in why for why in reasons.values())
    else:
        assert "cudaMallocAsync" in ran and "cupy" in ran
    assert gp.memory_allocated() == 0


# ----------------------------------------------------------------------------- compared sides, faked
class _Ledger:
    """Bookkeeping shared by the fake libraries: live allocations, the stream of each, the peak."""

    def __init__(self) -> None:
        self.live: dict[int, int] = {}  # address -> size
        self.streams: list[Any] = []  # the stream of every allocation, in order
        self.next = 0x1000
        self.peak = 0

    def alloc(self, n: int, stream: Any) -> int:
        self.next += 0x1000 + n
        self.live[self.next] = n
        self.streams.append(stream)
        self.peak = max(self.peak, sum(self.live.values()))
        return self.next

    def free(self, ptr: int) -> None:
        del self.live[ptr]


def _fake_cupy(ledger: _Ledger) -> Any:
    state = {"stream": None}

    class Pointer:
        def __init__(self, ptr: int) -> None:
            self.ptr = ptr

        def __del__(self) -> None:
            ledger.free(self.ptr)

    class Stream:
        def __init__(self, ptr: int) -> None:
            self.ptr = ptr

        def use(self) -> None:
            state["stream"] = self

    class MemoryPool:
        def malloc(self, n: int) -> Pointer:
            return Pointer(ledger.alloc(n, state["stream"].ptr))  # type: ignore[attr-defined]

        def total_bytes(self) -> int:  # no cache in the fake: reserved is what is live
            return sum(ledger.live.values())

        def free_all_blocks(self) -> None:
            pass

    state["stream"] = Stream(0)
    cuda = types.SimpleNamespace(
        MemoryPool=MemoryPool, ExternalStream=Stream, get_current_stream=lambda: state["stream"]
    )
    return types.SimpleNamespace(cuda=cuda, __version__="fake")


def _fake_torch(ledger: _Ledger) -> Any:
    def alloc(n: int, device: int, stream: int) -> int:
        assert device == 0 and type(stream) is int
        return ledger.alloc(n, stream)

    cuda = types.SimpleNamespace(
        is_available=lambda: True,
        set_device=lambda d: None,
        caching_allocator_alloc=alloc,
        caching_allocator_delete=ledger.free,
        empty_cache=lambda: None,
        memory_reserved=lambda d: 0,
        reset_peak_memory_stats=lambda d: setattr(ledger, "peak", 0),
        max_memory_reserved=lambda d: ledger.peak,
    )
    c = types.SimpleNamespace(
        _cuda_cudaCachingAllocator_raw_alloc=ledger.alloc, _cuda_cudaCachingAllocator_raw_delete=ledger.free
    )
    return types.SimpleNamespace(cuda=cuda, _C=c, __version__="fake")


class _U64:
    def __init__(self, value: int) -> None:
        self.value = value

    def __int__(self) -> int:
        return self.value


def _fake_runtime(ledger: _Ledger) -> Any:
    attrs = {"threshold": _U64(0), "high": _U64(0)}
    names = types.SimpleNamespace(
        cudaMemPoolAttrReleaseThreshold="threshold",
        cudaMemPoolAttrReservedMemHigh="high",
        cudaMemPoolAttrReservedMemCurrent="current",
    )

    def get(pool: str, attr: str) -> tuple[int, _U64]:
        assert pool == "pool"
        if attr == "current":
            return 0, _U64(sum(ledger.live.values()))
        return 0, _U64(ledger.peak) if attr == "high" else attrs[attr]

    def set_attr(pool: str, attr: str, value: _U64) -> tuple[int]:
        assert isinstance(value, _U64)
        attrs[attr] = value
        if attr == "high":
            ledger.peak = value.value
        return (0,)

    rt = types.SimpleNamespace(
        attrs=attrs,
        cudaMemPoolAttr=names,
        cudaDeviceGetDefaultMemPool=lambda d: (0, "pool"),
        cudaMemPoolGetAttribute=get,
        cudaMemPoolSetAttribute=set_attr,
        cudaMallocAsync=lambda n, s: (0, ledger.alloc(n, s)),
        cudaFreeAsync=lambda p, s: (ledger.free(p), 0)[1:],
        cudaDeviceSynchronize=lambda: (0,),
        cudaMemPoolTrimTo=lambda pool, keep: (0,),
    )
    return rt


def test_bench_traces_compares_with_cupy_torch_and_malloc_async(
    sim: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cuda backend's comparisons, run against fake CuPy, PyTorch and cuda.bindings (the
    graphpool side on the simulator): each replays the trace on the right streams, frees all
    it allocated, and reports its peak; the ratios are graphpool's time over the other's."""
    from graphpool.device import cuda as gcuda

    ledgers = {"cupy": _Ledger(), "torch": _Ledger(), "cudaMallocAsync": _Ledger()}
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(ledgers["cupy"]))
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(ledgers["torch"]))
    rt = _fake_runtime(ledgers["cudaMallocAsync"])
    monkeypatch.setattr(gcuda, "_load", lambda: rt)
    monkeypatch.setattr(gp, "backend", lambda: "cuda")
    trace = traces.synthetic(3, 1500, streams=2)
    monkeypatch.setattr(trace_bench, "_trace_list", lambda quick, skipped: [trace])
    skipped: list[dict[str, str]] = []
    r = trace_bench.bench_traces(2, quick=True, skipped=skipped)
    assert skipped == []
    assert list(r["sides"]) == [
        "graphpool",
        "policy",
        "expandable",
        "cupy",
        "torch",
        "torch raw",
        "cudaMallocAsync",
    ]
    assert r["sides"]["cupy"].endswith("(cupy fake)") and r["sides"]["torch"].endswith("(torch fake)")
    row = r["traces"][trace.name]
    peak_live = traces.peak_live_bytes(trace)
    for name, ledger in ledgers.items():
        assert ledger.live == {}, name  # every replay freed what it allocated
        assert row[f"{name}, peak reserved (bytes)"] == peak_live, name  # the fakes cache nothing
        assert row[f"graphpool/{name} peak reserved"] == pytest.approx(
            row["graphpool, peak reserved (bytes)"] / peak_live
        )
        for when in ("warm", "cold"):
            assert row[f"graphpool/{name} time, {when}"] == pytest.approx(
                row[f"graphpool, {when} (us)"] / row[f"{name}, {when} (us)"]
            )
    assert "torch raw, peak reserved (bytes)" not in row and row["graphpool/torch raw time, warm"] > 0
    # each allocation on the stream of its trace event: stream index k -> the k-th stream made
    wanted = [e[3] for e in trace_bench._trace_events(trace) if e[0] == 1]
    for name, ledger in ledgers.items():
        handles = list(dict.fromkeys(ledger.streams))
        assert len(handles) == 2, name
        per_replay = len(wanted)
        assert len(ledger.streams) % per_replay == 0
        assert [handles.index(s) for s in ledger.streams[:per_replay]] == wanted, name
    assert int(rt.attrs["threshold"]) == 0  # cudaMallocAsync's release threshold put back
    assert gp.memory_allocated() == 0
