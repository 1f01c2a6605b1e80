"""The bench's trace section: allocation traces replayed through graphpool and the
allocators it is compared with (``python -m graphpool bench``, its last section).

Every allocator runs through the same loop over the same prebuilt event list, so the loop's
own cost is common to all sides; the sides alternate in rounds (graphpool.tools.benchkit).
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from collections.abc import Callable
from typing import Any

import graphpool as gp
from graphpool import runtime
from graphpool.policy.allocator import CachingAllocator
from graphpool.tools.benchkit import (
    Skipped,
    fmt_value,
    label_of,
    note_progress,
    per_call,
    skip,
    timed_runs,
)

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
    from graphpool.tools import traces

    if quick:
        return [traces.synthetic(0, n_ops=QUICK_TRACE_OPS)]
    names = traces.available()
    if not names:
        why = "none shipped yet (graphpool/tools/trace_data is empty): run benchmarks/record_traces.py"
        skip(skipped, "allocation traces recorded from real programs", why + " on a GPU")
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
    from graphpool.tools import traces

    skipped = [] if skipped is None else skipped
    cold_rounds = min(repeat, 5)
    out: dict[str, Any] = {"sides": {}, "rounds": {"warm": repeat, "cold": cold_rounds}, "traces": {}}
    device = gp.current_device()
    first = True
    for trace in _trace_list(quick, skipped):
        note_progress(f"allocation trace {trace.name}")
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
            warm = timed_runs({k: side.replay for k, side in sides.items()}, 1, repeat, between=sync)
            cold: dict[str, list[float]] = {k: [] for k in sides}
            for _ in range(cold_rounds):
                for k, side in sides.items():
                    side.empty()
                    sync()
                    cold[k] += per_call(side.replay, 1, 1)
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


def trace_rows(data: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Table rows of the trace section: what each side calls, then each trace's figures."""
    rows = [(f"{k}:", v, "") for k, v in data["sides"].items()]
    rounds = data["rounds"]
    rows.append(("rounds:", f"{rounds['warm']} warm, {rounds['cold']} cold (medians)", ""))
    for name, row in data["traces"].items():
        rows.append(("", "", ""))
        for k, v in row.items():
            rows.append((f"{name}: {label_of(k).removesuffix(' (bytes)')}", *fmt_value(k, v)))
    return rows
