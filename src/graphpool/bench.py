"""``python -m graphpool bench``: allocator and graph benchmarks, measured side by side.

Every comparison is a ratio of two figures taken in the same process, interleaved, as
the median of several repeats. Absolute times only mean something on a real GPU.
"""

from __future__ import annotations

import gc
import json
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import graphpool as gp
from graphpool import runtime, scenarios

_SPIN_SRC = r"""
extern "C" __global__ void gp_spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""
_spin: Any = None


def cuda_spin(stream: gp.Stream, cycles: int = 200_000_000) -> None:
    """Queue a one-thread kernel that spins ``cycles`` clock ticks (about 0.1 s) on ``stream``."""
    import cupy

    from graphpool.cupy import cupy_stream

    global _spin
    if _spin is None:
        _spin = cupy.RawKernel(_SPIN_SRC, "gp_spin")
    _spin((1,), (1,), (cupy.int64(cycles),), stream=cupy_stream(stream))


def _per_call(fn: Callable[[], None], number: int, repeat: int) -> list[float]:
    """Seconds per call of ``fn`` for each of ``repeat`` runs of ``number`` calls."""
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        out.append((time.perf_counter() - t0) / number)
    return out


def _runs(fns: dict[str, Callable[[], None]], number: int, repeat: int) -> dict[str, list[float]]:
    """Seconds per call of each fn in each of ``repeat`` runs, the fns' runs interleaved so
    that they share the host's drift."""
    runs: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():  # warm up
        _per_call(fn, max(1, number // 10), 1)
    for _ in range(repeat):
        for k, fn in fns.items():
            runs[k] += _per_call(fn, number, 1)
    return runs


def _interleaved(fns: dict[str, Callable[[], None]], number: int, repeat: int) -> dict[str, float]:
    """Median seconds per call of each fn (see ``_runs``)."""
    return {k: statistics.median(v) for k, v in _runs(fns, number, repeat).items()}


def bench_malloc_free(number: int, repeat: int) -> dict[str, Any]:
    """A cached malloc+free pair: graphpool's public call, its policy alone, and CuPy's pool."""
    sizes = (512, 65536, 4 << 20)
    s = gp.current_stream()
    alloc = runtime.allocator()
    results: dict[str, Any] = {}
    cupy_pool = None
    if gp.backend() == "cuda":
        try:
            import cupy

            cupy_pool = cupy.cuda.MemoryPool()
        except ImportError:
            cupy_pool = None
    for n in sizes:
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

            fns["cupy MemoryPool malloc+free"] = cupy_pair
        runs = _runs(fns, number, repeat)
        med = {k: statistics.median(v) for k, v in runs.items()}
        best = {k: min(v) for k, v in runs.items()}  # the least disturbed run of each
        row = {k: v * 1e6 for k, v in med.items()}
        if cupy_pool is not None:
            for key in ("alloc+free", "alloc+free, current stream", "alloc+drop"):
                for name, stat in (("", med), (" (min)", best)):
                    row[f"ratio {key} / cupy{name}"] = (
                        stat[f"graphpool {key}"] / stat["cupy MemoryPool malloc+free"]
                    )
        results[str(n)] = row
    return results


def bench_routing(number: int, repeat: int) -> dict[str, Any]:
    """A cached pair with no capture, with a capture on another stream, and on the capturing stream."""
    n = 4096
    eager = gp.Stream()
    cap = gp.Stream()
    dev = runtime.get().device(eager.device)

    def pair_on(st: gp.Stream) -> Callable[[], None]:
        def fn() -> None:
            gp.alloc(n, st).free()

        return fn

    out: dict[str, Any] = {}
    base = _interleaved({"no capture": pair_on(eager)}, number, repeat)["no capture"]
    g = gp.CUDAGraph()
    during: dict[str, float] = {}

    def eager_thread() -> None:  # eager code of another thread while the capture is underway
        during.update(_interleaved({"capture on another stream": pair_on(eager)}, number, repeat))

    with gp.stream(cap):
        g.capture_begin(capture_error_mode="relaxed")
        warm = gp.alloc(n, cap)  # the private pool's first segment
        warm.free()
        worker = threading.Thread(target=eager_thread)
        worker.start()
        worker.join()
        during.update(_interleaved({"on the capturing stream": pair_on(cap)}, number, repeat))
        buf = gp.alloc(n, cap)
        dev.memset(buf.ptr, 0, n, cap.handle)
        g.capture_end()
    out["no capture (us)"] = base * 1e6
    for k, v in during.items():
        out[f"{k} (us)"] = v * 1e6
        out[f"ratio {k} / no capture"] = v / base
    del buf, g
    return out


def bench_replay(number: int, repeat: int) -> dict[str, Any]:
    """Replay cost: gp.CUDAGraph.replay() vs a bare launch of the same executable graph."""
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

    def replay() -> None:
        g.replay()

    def bare() -> None:
        dev.launch(exe, s.handle)

    with gp.stream(s):
        med = _interleaved({"CUDAGraph.replay": replay, "bare launch": bare}, number, repeat)
        s.synchronize()
    out = {f"{k} (us)": v * 1e6 for k, v in med.items()}
    out["ratio replay / bare launch"] = med["CUDAGraph.replay"] / med["bare launch"]
    return out


def bench_cupy_graph_vs_eager(repeat: int) -> dict[str, Any]:
    """200 small CuPy kernels, eager vs one graph replay (device time by wall clock + sync)."""
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
        "speedup": med["eager"] / med["graph replay"],
        "replay result correct": ok,
    }


def bench_cupy_hazard() -> dict[str, Any]:
    """The CuPy hazard with CuPy's own pool and capture API, then with graphpool installed."""
    import cupy

    import graphpool.cupy as gcupy

    n = 1 << 20
    out: dict[str, Any] = {}
    gcupy.uninstall()
    cupy.cuda.set_allocator(cupy.cuda.MemoryPool().malloc)
    st = cupy.cuda.Stream(non_blocking=True)
    with st:
        a = cupy.ones(n, dtype=cupy.float32)
        st.begin_capture()
        t = a * 2
        res = t + 1
        del t
        graph = st.end_capture()
        assert res is not None
        y = cupy.full(n, 7, dtype=cupy.float32)
        graph.launch()
        st.synchronize()
        out["cupy pool: elements of y overwritten by one replay"] = int((y != 7).sum().item())
        del a, res, y, graph
    gcupy.install()
    wrong, _, out_total = scenarios.hazard(cupy, n)
    out["graphpool: elements of y overwritten by one replay"] = wrong
    out["graphpool: graph output correct"] = out_total == 3.0 * n
    out["elements"] = n
    return out


def run(backend: str | None = None, quick: bool = False, json_path: str | None = None) -> int:
    """Run the benchmarks for this backend and print a table of the results."""
    if backend is not None:
        gp.set_backend(backend)
    number, repeat = (2000, 5) if quick else (20000, 15)
    results: dict[str, Any] = {
        "backend": gp.backend(),
        "device": runtime.get().device(0).name,
        "compiled": gp.compiled(),
    }
    gc.collect()
    gc.disable()  # keep collector pauses out of the per-call times
    try:
        results["malloc_free_pair_us"] = bench_malloc_free(number, repeat)
        results["routing"] = bench_routing(number, repeat)
        results["replay"] = bench_replay(number, repeat)
        if gp.backend() == "cuda":
            results["cupy_graph_vs_eager"] = bench_cupy_graph_vs_eager(repeat)
            results["cupy_hazard"] = bench_cupy_hazard()
    finally:
        gc.enable()
    text = json.dumps(results, indent=2, default=str)
    print(text)
    if json_path:
        with open(json_path, "w") as fh:
            fh.write(text + "\n")
    return 0
