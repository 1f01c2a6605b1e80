"""``python -m graphpool bench``: allocator and graph benchmarks, measured side by side.

Honesty rules every comparison here follows:

* Both sides of a ratio are measured in the same process, interleaved: the conditions
  alternate in rounds (A, B, A, B, ...), so they share the host's drift; each figure is
  the median over the rounds (the least disturbed round is reported too where it helps).
* Every ratio names its direction: ``"graphpool/cupy time"`` is graphpool's time divided
  by CuPy's, so above 1 means graphpool is slower.
* Graph replays are synchronized between timed runs (work queued by one run never
  slows the next), and compared with the raw launch underneath: ``cudaGraphLaunch``
  called through cuda.bindings on a GPU, the device's own ``launch`` on the simulator,
  with graphpool's replay checker off and on.
* CUDA's own gain (one graph replay against the same kernels launched eagerly) is
  labelled as CUDA's, not graphpool's.
* A comparison that cannot run here (CuPy missing, no GPU) is listed with the reason.
* Trace replays (``graphpool.traces``) run every allocator through the same loop over the
  same prebuilt event list, so the loop's own cost is common to all sides.

Output: a table (rounded, with units) on stdout; ``--json`` prints the machine-readable
form instead, ``--json PATH`` writes it to PATH as well as printing the table. Progress
goes to stderr. ``--quick``: small iteration counts (the CI smoke test). Absolute times
only mean something on a real GPU.
"""

from __future__ import annotations

import dataclasses
import errno
import gc
import itertools
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import graphpool as gp
from graphpool import runtime
from graphpool.policy.allocator import CachingAllocator

_SPIN_SRC = r"""
extern "C" __global__ void gp_spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""
_spin: Any = None

PAIR_SIZES = (512, 65536, 4 << 20)
MIXED_SIZES = (512, 64 << 10, 1 << 20, 4 << 20, 24 << 20)
CUPY_POOL = "cupy MemoryPool malloc+free"


def cuda_spin(stream: gp.Stream, cycles: int = 200_000_000) -> None:
    """Queue a one-thread kernel that spins ``cycles`` clock ticks (about 0.1 s) on ``stream``."""
    import cupy

    from graphpool.cupy import cupy_stream

    global _spin
    if _spin is None:
        _spin = cupy.RawKernel(_SPIN_SRC, "gp_spin")
    _spin((1,), (1,), (cupy.int64(cycles),), stream=cupy_stream(stream))


class Progress:
    """Progress lines on stderr, with the seconds since the start."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.t0 = time.perf_counter()

    def __call__(self, what: str) -> None:
        if self.enabled:
            print(f"[bench {time.perf_counter() - self.t0:6.1f} s] {what}", file=sys.stderr, flush=True)


_progress = Progress(enabled=False)


def _per_call(fn: Callable[[], None], number: int, repeat: int) -> list[float]:
    """Seconds per call of ``fn`` for each of ``repeat`` runs of ``number`` calls."""
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        out.append((time.perf_counter() - t0) / number)
    return out


def _runs(
    fns: dict[str, Callable[[], None]],
    number: int,
    repeat: int,
    between: Callable[[], None] | None = None,
) -> dict[str, list[float]]:
    """Seconds per call of each fn in each of ``repeat`` rounds, the fns' runs interleaved
    within each round so that they share the host's drift. ``between`` runs, untimed,
    before every timed run (e.g. a synchronize, so queued work never spills over)."""
    runs: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():  # warm up
        if between is not None:
            between()
        _per_call(fn, max(1, number // 10), 1)
    for _ in range(repeat):
        for k, fn in fns.items():
            if between is not None:
                between()
            runs[k] += _per_call(fn, number, 1)
    if between is not None:
        between()
    return runs


def _interleaved(fns: dict[str, Callable[[], None]], number: int, repeat: int) -> dict[str, float]:
    """Median seconds per call of each fn (see ``_runs``)."""
    return {k: statistics.median(v) for k, v in _runs(fns, number, repeat).items()}


def _cupy_pool(skipped: list[dict[str, str]], what: str) -> Any:
    """A fresh CuPy MemoryPool to compare with, or None (noted in ``skipped``)."""
    if gp.backend() != "cuda":
        why = "CuPy runs only on the cuda backend (this is the simulator)"
        skipped.append({"comparison": what, "why": why})
        return None
    try:
        import cupy
    except ImportError:
        skipped.append({"comparison": what, "why": "cupy not installed"})
        return None
    return cupy.cuda.MemoryPool()


Skipped = list[dict[str, str]]  # {"comparison": ..., "why": ...} for each comparison not run


def bench_malloc_free(number: int, repeat: int, skipped: Skipped | None = None) -> dict[str, Any]:
    """A cached malloc+free pair at one size: graphpool's public call, its policy alone, and CuPy's pool."""
    skipped = [] if skipped is None else skipped
    s = gp.current_stream()
    alloc = runtime.allocator()
    results: dict[str, Any] = {}
    cupy_pool = _cupy_pool(skipped, "malloc+free pair vs CuPy MemoryPool")
    for n in PAIR_SIZES:
        _progress(f"malloc+free pair, {_fmt_size(n)}")
        fns: dict[str, Callable[[], None]] = {}

        def gp_pair(n: int = n) -> None:
            gp.alloc(n, s).free()

        def gp_pair_current(n: int = n) -> None:
            gp.alloc(n).free()  # on the current stream (the same stream, found per thread)

        def gp_collect(n: int = n) -> None:
            gp.alloc(n, s)  # freed by its finalizer, drained by the next call

        def policy_pair(n: int = n) -> None:
            alloc.free(alloc.malloc(n, stream=s.handle))

        fns["graphpool alloc+free"] = gp_pair
        fns["graphpool alloc+free, current stream"] = gp_pair_current
        fns["graphpool alloc+drop"] = gp_collect
        fns["policy malloc+free"] = policy_pair
        if cupy_pool is not None:

            def cupy_pair(n: int = n, pool: Any = cupy_pool) -> None:
                p = pool.malloc(n)
                del p

            fns[CUPY_POOL] = cupy_pair
        runs = _runs(fns, number, repeat)
        med = {k: statistics.median(v) for k, v in runs.items()}
        best = {k: min(v) for k, v in runs.items()}  # the least disturbed run of each
        row: dict[str, Any] = {k: v * 1e6 for k, v in med.items()}
        if cupy_pool is not None:
            for key in ("alloc+free", "alloc+free, current stream", "alloc+drop"):
                for name, stat in (("", med), (" (min)", best)):
                    ratio = stat[f"graphpool {key}"] / stat[CUPY_POOL]
                    row[f"ratio {key} / cupy{name}"] = ratio  # the key the GPU scripts read
                    row[f"graphpool/cupy time, {key}{name}"] = ratio
        results[str(n)] = row
    return results


def bench_mixed_sizes(number: int, repeat: int, skipped: Skipped | None = None) -> dict[str, Any]:
    """Pairs whose sizes cycle through small and large requests (MIXED_SIZES), interleaved
    with the same measurement for CuPy's MemoryPool."""
    skipped = [] if skipped is None else skipped
    _progress("malloc+free pair, mixed sizes")
    s = gp.current_stream()
    alloc = runtime.allocator()
    cupy_pool = _cupy_pool(skipped, "mixed-size pair vs CuPy MemoryPool")
    fns: dict[str, Callable[[], None]] = {}
    gp_sizes = itertools.cycle(MIXED_SIZES)
    policy_sizes = itertools.cycle(MIXED_SIZES)

    def gp_pair() -> None:
        gp.alloc(next(gp_sizes), s).free()

    def policy_pair() -> None:
        alloc.free(alloc.malloc(next(policy_sizes), stream=s.handle))

    fns["graphpool alloc+free"] = gp_pair
    fns["policy malloc+free"] = policy_pair
    if cupy_pool is not None:
        cupy_sizes = itertools.cycle(MIXED_SIZES)

        def cupy_pair(pool: Any = cupy_pool) -> None:
            p = pool.malloc(next(cupy_sizes))
            del p

        fns[CUPY_POOL] = cupy_pair
    # a multiple of the cycle, so every run sees each size equally often
    n = max(len(MIXED_SIZES), number - number % len(MIXED_SIZES))
    runs = _runs(fns, n, repeat)
    med = {k: statistics.median(v) for k, v in runs.items()}
    best = {k: min(v) for k, v in runs.items()}
    out: dict[str, Any] = {"sizes": list(MIXED_SIZES)}
    out.update({f"{k} (us)": v * 1e6 for k, v in med.items()})
    if cupy_pool is not None:
        out["graphpool/cupy time, alloc+free"] = med["graphpool alloc+free"] / med[CUPY_POOL]
        out["graphpool/cupy time, alloc+free (min)"] = best["graphpool alloc+free"] / best[CUPY_POOL]
    return out


def bench_routing(number: int, repeat: int) -> dict[str, Any]:
    """A cached pair with no capture underway, and (in the same rounds, alternating) the same
    pair while another stream captures, and on the capturing stream itself.

    Each round: the no-capture pair on a worker thread; then a capture begins, the same pair
    runs on a worker thread on the eager stream and on the capturing stream, and the capture
    ends. The conditions thus alternate round by round instead of one running before the other.
    """
    _progress("routing (pair with and without a capture underway)")
    n = 4096
    eager = gp.Stream()
    cap = gp.Stream()
    dev = runtime.get().device(eager.device)

    def pair_on(st: gp.Stream) -> Callable[[], None]:
        def fn() -> None:
            gp.alloc(n, st).free()

        return fn

    def in_thread(fn: Callable[[], None], count: int) -> float:
        got: list[float] = []
        err: list[BaseException] = []

        def body() -> None:
            try:
                got.extend(_per_call(fn, count, 1))
            except BaseException as exc:  # re-raised below
                err.append(exc)

        t = threading.Thread(target=body)
        t.start()
        t.join()
        if err:
            raise err[0]
        return got[0]

    names = ("no capture", "capture on another stream", "on the capturing stream")
    runs: dict[str, list[float]] = {k: [] for k in names}
    for r in range(repeat + 1):  # round 0 warms up and is dropped
        count = max(1, number // 10) if r == 0 else number
        base = in_thread(pair_on(eager), count)
        g = gp.CUDAGraph()
        with gp.stream(cap):
            g.capture_begin(capture_error_mode="relaxed")
            warm = gp.alloc(n, cap)  # the private pool's first segment
            warm.free()
            other = in_thread(pair_on(eager), count)
            own = _per_call(pair_on(cap), count, 1)[0]
            buf = gp.alloc(n, cap)
            dev.memset(buf.ptr, 0, n, cap.handle)
            g.capture_end()
        del buf
        g.reset()
        if r:
            for k, v in zip(names, (base, other, own), strict=True):
                runs[k].append(v)
    med = {k: statistics.median(v) for k, v in runs.items()}
    out: dict[str, Any] = {"no capture (us)": med["no capture"] * 1e6}
    for k in names[1:]:
        out[f"{k} (us)"] = med[k] * 1e6
        out[f"ratio {k} / no capture"] = med[k] / med["no capture"]  # the key the GPU scripts read
        out[f"{k}/no capture time"] = med[k] / med["no capture"]
    out["rounds"] = repeat
    return out


def _raw_launch(dev: Any, exe: int, stream: gp.Stream) -> tuple[str, Callable[[], None]]:
    """The launch underneath CUDAGraph.replay, without graphpool: cudaGraphLaunch through
    cuda.bindings on a GPU, the simulated device's own launch on the simulator."""
    if gp.backend() == "cuda":
        # cuda.bindings' runtime module as device/cuda.py loaded it (the one module that
        # imports the bindings); the call itself is the bare binding, no graphpool wrapper.
        from graphpool.device import cuda as gcuda

        launch = gcuda._load().cudaGraphLaunch
        handle = gcuda._stream(stream.handle)

        def raw() -> None:
            launch(exe, handle)

        return "cudaGraphLaunch through cuda.bindings (no graphpool)", raw

    def sim_raw() -> None:
        dev.launch(exe, stream.handle)

    return "the simulated device's own launch (no graphpool)", sim_raw


def bench_replay(number: int, repeat: int) -> dict[str, Any]:
    """Replay cost: gp.CUDAGraph.replay() with the replay checker off and on, against the raw
    launch of the same executable graph; the stream is synchronized between timed runs."""
    _progress("graph replay vs raw launch")
    s = gp.Stream()
    dev = runtime.get().device(s.device)
    buf = gp.alloc(1 << 16, s)
    g = gp.CUDAGraph()
    with gp.stream(s):
        g.capture_begin()
        dev.memset(buf.ptr, 1, buf.nbytes, s.handle)
        g.capture_end()
    exe = g._exec
    assert exe is not None
    raw_name, raw = _raw_launch(dev, exe, s)
    mode = gp.replay_checks()

    def replay() -> None:
        g.replay()

    def bare() -> None:  # graphpool's device wrapper (the old baseline)
        dev.launch(exe, s.handle)

    # (name, checker mode set untimed before each run, fn). Launches queue work: runs are
    # kept short enough that the queue never fills, and drained between runs so one run's
    # work never slows the next.
    calls = max(1, min(number, 500))
    cases: list[tuple[str, str, Callable[[], None]]] = [
        ("CUDAGraph.replay, checker off", "off", replay),
        ("CUDAGraph.replay, checker on", "raise", replay),
        ("bare launch", "off", bare),
        (raw_name, "off", raw),
    ]
    runs: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    try:
        with gp.stream(s):
            for r in range(repeat + 1):  # round 0 warms up and is dropped
                for name, checks, fn in cases:
                    gp.set_replay_checks(checks)
                    s.synchronize()
                    t = _per_call(fn, max(1, calls // 10) if r == 0 else calls, 1)[0]
                    if r:
                        runs[name].append(t)
            s.synchronize()
    finally:
        gp.set_replay_checks(mode)
    med = {k: statistics.median(v) for k, v in runs.items()}
    out: dict[str, Any] = {  # the first three keys: the GPU scripts read them
        "CUDAGraph.replay (us)": med["CUDAGraph.replay, checker off"] * 1e6,
        "bare launch (us)": med["bare launch"] * 1e6,
        "ratio replay / bare launch": med["CUDAGraph.replay, checker off"] / med["bare launch"],
    }
    out["CUDAGraph.replay, checker off (us)"] = med["CUDAGraph.replay, checker off"] * 1e6
    out["CUDAGraph.replay, checker on (us)"] = med["CUDAGraph.replay, checker on"] * 1e6
    out["raw launch (us)"] = med[raw_name] * 1e6
    out["raw launch is"] = raw_name
    out["replay (checker off)/raw launch time"] = med["CUDAGraph.replay, checker off"] / med[raw_name]
    out["replay (checker on)/raw launch time"] = med["CUDAGraph.replay, checker on"] / med[raw_name]
    out["calls per run"] = calls
    buf.free()
    g.reset()
    return out


def bench_cupy_graph_vs_eager(repeat: int) -> dict[str, Any]:
    """CUDA's gain, not graphpool's: 200 small CuPy kernels launched eagerly vs one replay of a
    graph of them (device time by wall clock + sync)."""
    _progress("CUDA graph vs eager kernels (CuPy)")
    import cupy

    import graphpool.cupy as gcupy

    gcupy.install()
    s = gp.Stream()
    with gp.stream(s):
        x = cupy.ones(1024, dtype=cupy.float32)

        def work() -> Any:
            y = x
            for _ in range(200):
                y = y + 1
            return y

        work()
        s.synchronize()
        g = gp.CUDAGraph()
        with gp.graph(g, stream=s):
            out = work()

        def eager() -> None:
            work()
            s.synchronize()

        def replay() -> None:
            g.replay()
            s.synchronize()

        med = _interleaved({"eager": eager, "graph replay": replay}, 20, repeat)
        ok = float(out[0].item()) == 201.0
    return {
        "eager 200 kernels (us)": med["eager"] * 1e6,
        "graph replay (us)": med["graph replay"] * 1e6,
        "speedup": med["eager"] / med["graph replay"],  # the GPU scripts' key
        "CUDA's graph speedup (eager/replay time)": med["eager"] / med["graph replay"],
        "replay result correct": ok,
    }


def bench_cupy_hazard() -> dict[str, Any]:
    """The CuPy hazard through CuPy's own capture API (``Stream.begin_capture``), the same
    program on CuPy's pool and then with graphpool installed as CuPy's allocator."""
    _progress("the CuPy capture hazard")
    import cupy

    import graphpool.cupy as gcupy

    n = 1 << 20

    def program() -> tuple[int, bool]:
        st = cupy.cuda.Stream(non_blocking=True)
        with st:
            a = cupy.ones(n, dtype=cupy.float32)
            (a * 2 + 1).sum()  # kernels compiled before the capture
            st.synchronize()
            st.begin_capture()
            t = a * 2
            res = t + 1
            del t
            graph = st.end_capture()
            y = cupy.full(n, 7, dtype=cupy.float32)  # eager, same stream, after the capture
            st.synchronize()
            graph.launch(st)
            st.synchronize()
            return int((y != 7).sum().item()), bool((res == 3).all().item())

    out: dict[str, Any] = {}
    gcupy.uninstall()
    cupy.cuda.set_allocator(cupy.cuda.MemoryPool().malloc)
    try:
        wrong, _ = program()
    finally:
        cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)
    out["cupy pool: elements of y overwritten by one replay"] = wrong
    gcupy.install()
    wrong, ok = program()
    out["graphpool: elements of y overwritten by one replay"] = wrong
    out["graphpool: graph output correct"] = ok
    out["elements"] = n
    out["capture API, both sides"] = "cupy.cuda.Stream.begin_capture"
    return out


# ----------------------------------------------------------------------------- traces
TRACE_SIDES = {
    "graphpool": "gp.alloc(n, stream) / buf.free()",
    "policy": "graphpool's policy alone: runtime.allocator().malloc(n, stream=h) / .free(ptr)",
    "expandable": "graphpool's policy with expandable_segments:True (an allocator of its own on the "
    "device): .malloc(n, stream=h) / .free(ptr)",
    "cupy": "cupy.cuda.MemoryPool().malloc(n) on the event's stream / drop the MemoryPointer",
    "torch": "torch.cuda.caching_allocator_alloc(n, device, stream) / caching_allocator_delete(ptr), "
    "PyTorch's public calls (a Python wrapper that switches the device around the C++ call)",
    "torch raw": "torch._C._cuda_cudaCachingAllocator_raw_alloc(n, stream) / _raw_delete(ptr): the C++ "
    "entry under caching_allocator_alloc, as a tensor's allocation reaches it (the same cache as torch)",
    "cudaMallocAsync": "cudaMallocAsync(n, stream) / cudaFreeAsync(ptr, stream), device's default pool "
    "(release threshold raised to the maximum while the bench runs, so it caches as the others do)",
}
TRACE_OTHERS = {  # compared side -> its entry in `skipped` when it cannot run
    "cupy": "allocation traces vs CuPy MemoryPool",
    "torch": "allocation traces vs PyTorch caching allocator",
    "cudaMallocAsync": "allocation traces vs cudaMallocAsync",
}
QUICK_TRACE_OPS = 2000

ReplayEvent = tuple[int, int, int, Any]  # (1 alloc / 0 free, id, nbytes, the side's stream object)


class _Side:
    """One allocator a trace replays through: ``replay`` runs every event once (leaving
    nothing allocated), ``empty`` returns its cache to the driver (for a cold replay),
    ``peak`` replays untimed from an empty cache and returns the peak reserved bytes above
    the level it started from (None where the side shares another's allocator)."""

    def __init__(
        self,
        replay: Callable[[], None],
        empty: Callable[[], None],
        peak: Callable[[], int] | None,
        close: Callable[[], None] | None = None,
    ) -> None:
        self.replay = replay
        self.empty = empty
        self.peak = peak
        self.close = close


def _trace_events(trace: Any) -> list[tuple[int, int, int, int]]:
    """The trace as replayed: (kind, id, nbytes, stream index) with each free carrying the
    stream of its allocation; zero-byte allocations (no memory on any side) and their frees
    left out; allocations live at the end freed at the end."""
    out: list[tuple[int, int, int, int]] = []
    live: dict[int, int] = {}  # id -> stream index
    zero: set[int] = set()
    for e in trace.events:
        if e[0] == 1:
            if e[2] == 0:
                zero.add(e[1])
                continue
            live[e[1]] = e[3]
            out.append((1, e[1], e[2], e[3]))
        elif e[1] in zero:
            zero.discard(e[1])
        else:
            out.append((0, e[1], 0, live.pop(e[1])))
    out += [(0, i, 0, s) for i, s in live.items()]
    return out


def _bind(events: list[tuple[int, int, int, int]], streams: list[Any]) -> list[ReplayEvent]:
    """``events`` with each stream index replaced by the side's own stream object."""
    return [(k, i, n, streams[s]) for k, i, n, s in events]


def _graphpool_sides(events: list[tuple[int, int, int, int]], streams: list[gp.Stream]) -> dict[str, _Side]:
    """graphpool's public call and its policy alone (one allocator: one cache, one peak)."""
    alloc = runtime.allocator(streams[0].device)
    gp_events = _bind(events, streams)
    policy_events = _bind(events, [s.handle for s in streams])
    gp_alloc = gp.alloc

    def gp_replay() -> None:
        live: dict[int, Any] = {}
        for k, i, n, s in gp_events:
            if k:
                live[i] = gp_alloc(n, s)
            else:
                live.pop(i).free()

    policy_replay = _policy_replay(policy_events, alloc)

    def empty() -> None:
        gp.empty_cache(streams[0].device)

    def peak() -> int:
        dev = streams[0].device
        gp.empty_cache(dev)
        base = gp.memory_reserved(dev)
        gp.reset_peak_memory_stats(dev)
        gp_replay()
        return gp.max_memory_reserved(dev) - base

    sides = {"graphpool": _Side(gp_replay, empty, peak), "policy": _Side(policy_replay, empty, None)}
    sides["expandable"] = _expandable_side(policy_events, alloc)
    return sides


def _policy_replay(events: list[ReplayEvent], alloc: CachingAllocator) -> Callable[[], None]:
    """One replay of ``events`` (stream handles bound) through ``alloc``'s malloc and free."""
    malloc, free = alloc.malloc, alloc.free

    def replay() -> None:
        live: dict[int, int] = {}
        for k, i, n, s in events:
            if k:
                live[i] = malloc(n, stream=s)
            else:
                free(live.pop(i))

    return replay


def _expandable_side(events: list[ReplayEvent], like: CachingAllocator) -> _Side:
    """The policy with expandable segments, on an allocator of its own beside ``like``'s."""
    rt = runtime.get()
    sizes = dataclasses.replace(like.sizes, expandable_segments=True)
    exp = CachingAllocator(like.device, sizes=sizes, world=rt.world)
    replay = _policy_replay(events, exp)

    def empty() -> None:
        exp.empty_cache()

    def peak() -> int:
        exp.empty_cache()
        base = exp.memory_stats()["reserved_bytes.all.current"]
        exp.reset_peak()
        replay()
        return exp.memory_stats()["reserved_bytes.all.peak"] - base

    return _Side(replay, empty, peak, empty)


def _torch_expandable_peak(
    events: list[tuple[int, int, int, int]], handles: list[int], device: int
) -> int | None:
    """Peak reserved bytes of PyTorch's allocator with its expandable segments turned on for one
    untimed replay (then off again, its cache emptied before and after); None without torch."""
    try:
        import torch
    except ImportError:
        return None
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # torch 2.9+
    if setter is None:
        setter = getattr(getattr(torch.cuda, "memory", None), "_set_allocator_settings", None)
    if setter is None or not torch.cuda.is_available():
        return None
    side = _torch_sides(events, handles, device)["torch"]
    torch.cuda.empty_cache()
    setter("expandable_segments:True")
    try:
        assert side.peak is not None
        return side.peak()
    finally:
        torch.cuda.empty_cache()
        setter("expandable_segments:False")


def _cupy_side(events: list[tuple[int, int, int, int]], handles: list[int]) -> _Side:
    """CuPy's MemoryPool; the current stream switches only when the event's stream changes."""
    import cupy

    pool = cupy.cuda.MemoryPool()
    bound = _bind(events, [cupy.cuda.ExternalStream(h) for h in handles])
    malloc = pool.malloc

    def replay() -> None:
        previous = cupy.cuda.get_current_stream()
        live: dict[int, Any] = {}
        current = None
        try:
            for k, i, n, s in bound:
                if k:
                    if s is not current:
                        s.use()
                        current = s
                    live[i] = malloc(n)
                else:
                    del live[i]
        finally:
            previous.use()

    def empty() -> None:
        pool.free_all_blocks()

    def peak() -> int:  # CuPy keeps no peak: read total_bytes() after every allocation
        pool.free_all_blocks()
        base = most = pool.total_bytes()
        total = pool.total_bytes
        previous = cupy.cuda.get_current_stream()
        live: dict[int, Any] = {}
        try:
            for k, i, n, s in bound:
                if k:
                    s.use()
                    live[i] = malloc(n)
                    most = max(most, total())
                else:
                    del live[i]
        finally:
            previous.use()
        return int(most - base)

    return _Side(replay, empty, peak, empty)


def _torch_sides(
    events: list[tuple[int, int, int, int]], handles: list[int], device: int
) -> dict[str, _Side]:
    """PyTorch's caching allocator through its public raw-allocation calls, and (where this
    torch has it) through the C++ entry those calls wrap: one allocator, one cache, one peak."""
    import torch

    alloc = torch.cuda.caching_allocator_alloc
    delete = torch.cuda.caching_allocator_delete
    bound = _bind(events, handles)

    def replay() -> None:
        live: dict[int, int] = {}
        for k, i, n, s in bound:
            if k:
                live[i] = alloc(n, device, s)
            else:
                delete(live.pop(i))

    raw_alloc: Any = getattr(torch._C, "_cuda_cudaCachingAllocator_raw_alloc", None)
    raw_delete: Any = getattr(torch._C, "_cuda_cudaCachingAllocator_raw_delete", None)

    def raw_replay() -> None:  # the caller keeps torch's current device on ``device``
        live: dict[int, int] = {}
        for k, i, n, s in bound:
            if k:
                live[i] = raw_alloc(n, s)
            else:
                raw_delete(live.pop(i))

    def empty() -> None:
        torch.cuda.empty_cache()

    def peak() -> int:
        torch.cuda.empty_cache()
        base = torch.cuda.memory_reserved(device)
        torch.cuda.reset_peak_memory_stats(device)
        replay()
        return int(torch.cuda.max_memory_reserved(device) - base)

    sides = {"torch": _Side(replay, empty, peak, empty)}
    if raw_alloc is not None and raw_delete is not None:
        sides["torch raw"] = _Side(raw_replay, empty, None)
    return sides


def _malloc_async_side(events: list[tuple[int, int, int, int]], handles: list[int], device: int) -> _Side:
    """cudaMallocAsync/cudaFreeAsync on the device's default memory pool, through cuda.bindings."""
    from graphpool.device import cuda as gcuda

    rt = gcuda._load()
    check = gcuda._check
    attr = rt.cudaMemPoolAttr
    err, pool = rt.cudaDeviceGetDefaultMemPool(device)
    check("cudaDeviceGetDefaultMemPool", err)
    err, threshold = rt.cudaMemPoolGetAttribute(pool, attr.cudaMemPoolAttrReleaseThreshold)
    check("cudaMemPoolGetAttribute", err)
    u64 = type(threshold)  # the driver's cuuint64_t (cuda.bindings.driver), as the attribute wants it
    check(
        "cudaMemPoolSetAttribute",
        rt.cudaMemPoolSetAttribute(pool, attr.cudaMemPoolAttrReleaseThreshold, u64(2**64 - 1))[0],
    )
    bound = _bind(events, [gcuda._stream(h) for h in handles])
    malloc, free_async = rt.cudaMallocAsync, rt.cudaFreeAsync

    def replay() -> None:
        live: dict[int, Any] = {}
        for k, i, n, s in bound:
            if k:
                err, p = malloc(n, s)
                if err:
                    check("cudaMallocAsync", err)
                live[i] = p
            else:
                err = free_async(live.pop(i), s)[0]
                if err:
                    check("cudaFreeAsync", err)

    def empty() -> None:
        check("cudaDeviceSynchronize", rt.cudaDeviceSynchronize()[0])
        check("cudaMemPoolTrimTo", rt.cudaMemPoolTrimTo(pool, 0)[0])

    def reserved(which: Any) -> int:
        err, value = rt.cudaMemPoolGetAttribute(pool, which)
        check("cudaMemPoolGetAttribute", err)
        return int(value)

    def peak() -> int:
        empty()
        base = reserved(attr.cudaMemPoolAttrReservedMemCurrent)
        check(
            "cudaMemPoolSetAttribute",
            rt.cudaMemPoolSetAttribute(pool, attr.cudaMemPoolAttrReservedMemHigh, u64(0))[0],
        )
        replay()
        check("cudaDeviceSynchronize", rt.cudaDeviceSynchronize()[0])
        return reserved(attr.cudaMemPoolAttrReservedMemHigh) - base

    def close() -> None:
        empty()
        rt.cudaMemPoolSetAttribute(pool, attr.cudaMemPoolAttrReleaseThreshold, threshold)

    return _Side(replay, empty, peak, close)


def _other_sides(
    events: list[tuple[int, int, int, int]],
    handles: list[int],
    device: int,
    skipped: Skipped | None,
) -> dict[str, _Side]:
    """The allocators graphpool is compared with that can run here; each that cannot goes
    into ``skipped`` (when given) with the reason."""
    sides: dict[str, _Side] = {}

    def skip(name: str, why: str) -> None:
        if skipped is not None:
            skipped.append({"comparison": TRACE_OTHERS[name], "why": why})

    if gp.backend() != "cuda":
        for name, what in TRACE_OTHERS.items():
            skip(name, f"{what.split(' vs ')[1]} runs only on the cuda backend (this is the simulator)")
        return sides
    try:
        import cupy  # noqa: F401
    except ImportError:
        skip("cupy", "cupy not installed")
    else:
        sides["cupy"] = _cupy_side(events, handles)
    try:
        import torch
    except ImportError:
        skip("torch", "torch not installed")
    else:
        if torch.cuda.is_available():
            torch.cuda.set_device(device)  # the raw calls allocate on torch's current device
            sides.update(_torch_sides(events, handles, device))
        else:
            skip("torch", f"torch {torch.__version__} sees no CUDA GPU (a CPU-only build?)")
    try:
        sides["cudaMallocAsync"] = _malloc_async_side(events, handles, device)
    except Exception as exc:  # an old driver, a device without memory pools
        skip("cudaMallocAsync", f"cudaMallocAsync unusable here: {exc}")
    return sides


def _trace_list(quick: bool, skipped: Skipped) -> list[Any]:
    """The traces to replay: every shipped one and ``synthetic(seed=0)``; quick, only a short
    synthetic one."""
    from graphpool import traces

    if quick:
        return [traces.synthetic(0, n_ops=QUICK_TRACE_OPS)]
    names = traces.available()
    if not names:
        why = "none shipped yet (graphpool/trace_data is empty): run benchmarks/record_traces.py on a GPU"
        skipped.append({"comparison": "allocation traces recorded from real programs", "why": why})
    return [traces.load(n) for n in names] + [traces.synthetic(0)]


def _versions() -> dict[str, str]:
    """Versions of the compared libraries that are already imported."""
    out = {}
    for name in ("cupy", "torch"):
        mod = sys.modules.get(name)
        if mod is not None:
            out[name] = str(getattr(mod, "__version__", "?"))
    return out


def bench_traces(repeat: int, quick: bool, skipped: Skipped | None = None) -> dict[str, Any]:
    """Replay allocation traces through graphpool and the allocators it is compared with.

    Per trace and allocator: warm microseconds per operation (one untimed replay, then the
    median over ``repeat`` timed replays, the allocators interleaved in rounds), cold
    microseconds per operation (the cache emptied first; the median of a few rounds,
    interleaved too), and peak reserved bytes (an untimed replay from an empty cache),
    beside the trace's peak live bytes. The replay loops are the same for every side: a
    prebuilt list of events, a dict of live allocations; CuPy's also switches its current
    stream when the event's stream changes.
    """
    from graphpool import traces

    skipped = [] if skipped is None else skipped
    cold_rounds = min(repeat, 5)
    out: dict[str, Any] = {"sides": {}, "rounds": {"warm": repeat, "cold": cold_rounds}, "traces": {}}
    device = gp.current_device()
    first = True
    for trace in _trace_list(quick, skipped):
        _progress(f"allocation trace {trace.name}")
        events = _trace_events(trace)
        ops = len(events)
        if not ops:  # nothing to time (only zero-byte requests, or none)
            continue
        streams = [gp.Stream(device) for _ in range(max(1, trace.streams))]
        handles = [s.handle for s in streams]
        sides = _graphpool_sides(events, streams)
        sides.update(_other_sides(events, handles, device, skipped if first else None))
        first = False
        out["sides"].update((k, TRACE_SIDES[k]) for k in sides)

        def sync() -> None:
            gp.synchronize(device)

        try:
            warm = _runs({k: side.replay for k, side in sides.items()}, 1, repeat, between=sync)
            cold: dict[str, list[float]] = {k: [] for k in sides}
            for _ in range(cold_rounds):
                for k, side in sides.items():
                    side.empty()
                    sync()
                    cold[k] += _per_call(side.replay, 1, 1)
            peaks = {k: side.peak() for k, side in sides.items() if side.peak is not None}
            if "torch" in sides:
                torch_exp = _torch_expandable_peak(events, handles, device)
                if torch_exp:
                    peaks["torch expandable"] = torch_exp
        finally:
            for side in sides.values():
                if side.close is not None:
                    side.close()
            gp.empty_cache(device)
        row: dict[str, Any] = {
            "description": trace.description,
            "operations": ops,
            "allocations": trace.allocations,
            "streams": trace.streams,
            "peak live (bytes)": traces.peak_live_bytes(trace),
        }
        for k in sides:
            row[f"{k}, warm (us)"] = statistics.median(warm[k]) / ops * 1e6
            row[f"{k}, cold (us)"] = statistics.median(cold[k]) / ops * 1e6
        for k in peaks:
            row[f"{k}, peak reserved (bytes)"] = peaks[k]
        live_peak = traces.peak_live_bytes(trace)
        for k in peaks:  # every allocator's reserved/live, expandable segments beside the rest
            if live_peak:
                row[f"{k} peak reserved/peak live"] = peaks[k] / live_peak
        for when in ("warm", "cold"):
            row[f"expandable/policy time, {when}"] = (
                row[f"expandable, {when} (us)"] / row[f"policy, {when} (us)"]
            )
        for k in sides:
            if k in ("graphpool", "policy", "expandable"):
                continue
            for when in ("warm", "cold"):
                row[f"graphpool/{k} time, {when}"] = row[f"graphpool, {when} (us)"] / row[f"{k}, {when} (us)"]
            if peaks.get(k):
                row[f"graphpool/{k} peak reserved"] = peaks["graphpool"] / peaks[k]
        out["traces"][trace.name] = row
    for name, version in _versions().items():
        if name in out["sides"]:
            out["sides"][name] += f" ({name} {version})"
    return out


# ----------------------------------------------------------------------------- output
def _fmt_size(n: int) -> str:
    for unit, k in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << k and n % (1 << k) == 0:
            return f"{n >> k} {unit}"
    return f"{n} B"


def _fmt_value(key: str, value: Any) -> tuple[str, str]:
    """(figure, unit) for a table cell: times in microseconds to 3 significant figures,
    ratios to 2 decimals with an x."""
    if isinstance(value, bool):
        return ("yes" if value else "NO"), ""
    if isinstance(value, int) and key.endswith("(bytes)"):
        return f"{value / (1 << 20):,.1f}", "MiB"
    if isinstance(value, int):
        return f"{value:,}", ""
    if isinstance(value, float):
        if key.endswith("(us)"):
            return f"{value:.3g}" if value < 100 else f"{value:,.0f}", "us"
        return f"{value:.2f}", "x"
    if isinstance(value, list):
        return ", ".join(_fmt_size(v) if isinstance(v, int) else str(v) for v in value), ""
    return str(value), ""


# Keys kept in the JSON for the GPU scripts but not shown: the table shows the same figure
# under a label that says what it is (a ratio's direction, the checker's mode).
_LEGACY_PREFIXES = ("ratio ",)
_LEGACY_KEYS = ("speedup", "CUDAGraph.replay (us)")
_LABELS = {"bare launch": "bare launch (graphpool's device wrapper)", "raw launch is": "raw launch calls"}


def _shown(key: str) -> bool:
    return key not in _LEGACY_KEYS and not key.startswith(_LEGACY_PREFIXES)


def _label(key: str) -> str:
    key = key.removesuffix(" (us)")
    return _LABELS.get(key, key)


def _trace_rows(data: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Table rows of the trace section: what each side calls, then each trace's figures."""
    rows = [(f"{k}:", v, "") for k, v in data["sides"].items()]
    rounds = data["rounds"]
    rows.append(("rounds:", f"{rounds['warm']} warm, {rounds['cold']} cold (medians)", ""))
    for name, row in data["traces"].items():
        rows.append(("", "", ""))
        for k, v in row.items():
            rows.append((f"{name}: {_label(k).removesuffix(' (bytes)')}", *_fmt_value(k, v)))
    return rows


_TITLES = {
    "malloc_free_pair_us": "cached malloc+free pair, one size",
    "malloc_free_mixed_us": "cached malloc+free pair, mixed sizes (cycling)",
    "routing": "pair while a capture is underway (rounds alternate with the no-capture pair)",
    "replay": "graph replay vs raw launch (synchronized between runs)",
    "cupy_graph_vs_eager": "CUDA's graph speedup (CuPy kernels; CUDA's gain, not graphpool's)",
    "cupy_hazard": "the CuPy capture hazard",
    "traces": "allocation traces: us per operation, warm and cold; peak reserved",
    "frameworks": "frameworks: per array/tensor/replay, medians over worker processes (frameworks_bench)",
}


def table(results: dict[str, Any]) -> str:
    """The results as a readable table: sections, labels, rounded figures with units."""
    lines = [
        f"graphpool bench: backend {results['backend']} ({results['device']}), "
        f"{'compiled' if results['compiled'] else 'plain Python'}, "
        f"{results['meta']['number']} calls x {results['meta']['repeat']} rounds"
        + (" (quick)" if results["meta"]["quick"] else ""),
        "ratios: A/B time is A's time divided by B's (above 1: A is slower)",
    ]
    rows: list[tuple[str, str, str]] = []

    def section(title: str) -> None:
        rows.append(("", "", ""))
        rows.append((f"== {title}", "", ""))

    for name, title in _TITLES.items():
        data = results.get(name)
        if not isinstance(data, dict):
            continue
        section(title)
        if name == "traces":
            rows.extend(_trace_rows(data))
            continue
        if name == "malloc_free_pair_us":  # per size; its plain keys are times in us
            for size, row in data.items():
                for k, v in row.items():
                    if _shown(k):
                        key = k if "/" in k else k + " (us)"
                        rows.append((f"{_fmt_size(int(size))}: {_label(k)}", *_fmt_value(key, v)))
            continue
        for k, v in data.items():
            if _shown(k):
                rows.append((_label(k), *_fmt_value(k, v)))
    figures = [r for r in rows if r[1] and not r[0].startswith("==")]
    width = max(len(r[0]) for r in figures)
    vwidth = max(len(r[1]) for r in figures if r[2])
    for label, value, unit in rows:
        if label.startswith("==") or not value:
            lines.append(label)
        elif not unit and not value[:1].isdigit():  # text: left-aligned
            lines.append(f"  {label.ljust(width)}  {value}")
        else:
            lines.append(f"  {label.ljust(width)}  {value.rjust(vwidth)} {unit}".rstrip())
    skipped = results.get("skipped") or []
    lines += ["", f"== comparisons skipped ({len(skipped)})"]
    lines += [f"  {s['comparison']}: {s['why']}" for s in skipped] or ["  none"]
    return "\n".join(lines)


def run(
    backend: str | None = None,
    quick: bool = False,
    json_path: str | None = None,
    *,
    as_json: bool = False,
    progress: bool = True,
) -> int:
    """Run the benchmarks for this backend; print a table (or, ``as_json``, the JSON).

    ``json_path``: also write the JSON there; checked first (OSError before anything runs if
    it cannot be written).
    """
    global _progress
    if json_path:
        writable_file(json_path, "bench --json")
    _progress = Progress(progress)
    if backend is not None:
        gp.set_backend(backend)
    number, repeat = (1000, 3) if quick else (20000, 15)
    skipped: list[dict[str, str]] = []
    results: dict[str, Any] = {
        "backend": gp.backend(),
        "device": runtime.get().device(0).name,
        "compiled": gp.compiled(),
        "meta": {"number": number, "repeat": repeat, "quick": quick},
    }
    gc.collect()
    gc.disable()  # keep collector pauses out of the per-call times
    try:
        results["malloc_free_pair_us"] = bench_malloc_free(number, repeat, skipped)
        results["malloc_free_mixed_us"] = bench_mixed_sizes(number, repeat, skipped)
        results["routing"] = bench_routing(number, repeat)
        results["replay"] = bench_replay(number, repeat)
        if gp.backend() != "cuda":
            why = "needs the cuda backend and CuPy (this is the simulator)"
            skipped.append({"comparison": "CUDA graph vs eager kernels (CuPy)", "why": why})
            skipped.append({"comparison": "the CuPy capture hazard", "why": why})
        else:
            try:
                import cupy  # noqa: F401
            except ImportError:
                for what in ("CUDA graph vs eager kernels (CuPy)", "the CuPy capture hazard"):
                    skipped.append({"comparison": what, "why": "cupy not installed"})
            else:
                results["cupy_graph_vs_eager"] = bench_cupy_graph_vs_eager(repeat)
                results["cupy_hazard"] = bench_cupy_hazard()
        results["traces"] = bench_traces(repeat, quick, skipped)
        if gp.backend() == "cuda":  # each framework's own pool against graphpool, in worker processes
            from graphpool.tools import frameworks_bench

            _progress("frameworks (graphpool.tools.frameworks_bench)")
            results["frameworks"] = frameworks_bench.section(quick, skipped)
        else:
            why = "needs the cuda backend (this is the simulator)"
            skipped.append({"comparison": "frameworks: CuPy, PyTorch, Numba, cuda.core, replay", "why": why})
    finally:
        gc.enable()
    results["skipped"] = skipped
    _progress("done")
    text = json.dumps(results, indent=2, default=str)
    print(text if as_json else table(results))
    if json_path:
        try:
            with open(json_path, "w") as fh:
                fh.write(text + "\n")
        except OSError as exc:
            raise OSError(f"bench --json {json_path}: cannot write there ({exc.strerror or exc})") from None
    return 0


def writable_file(path: str, option: str) -> None:
    """Check that the file ``path`` can be written (it is left as it was); OSError naming
    ``option`` and the path otherwise."""
    existed = os.path.exists(path)
    try:
        if os.path.isdir(path):
            raise IsADirectoryError(errno.EISDIR, "a folder, not a file")
        with open(path, "a"):
            pass
        if not existed:
            os.remove(path)
    except OSError as exc:
        raise OSError(f"{option} {path}: cannot write there ({exc.strerror or exc})") from None
