"""Captures begun outside graphpool, on a real GPU: the figures of issue 7 (point 5 and 6).

    python3 benchmarks/foreign_captures_gpu.py [--json PATH]

1. CuPy's hazard (cupy#9655) through CuPy's own ``Stream.begin_capture``, the same program
   on CuPy's pool and on graphpool: elements of an eager array overwritten by one replay,
   and reserved memory back once the graph is dropped.
2. A raw ``cudaStreamBeginCapture`` (cuda.bindings) in global mode, with CuPy arrays on
   graphpool: the same hazard, detection on and off.
3. A cuda.core ``GraphBuilder`` capture allocating through ``GraphpoolMemoryResource``.
4. Routing: a cached ``gp.alloc(n, s).free()`` pair with detection on / off, while another
   stream captures, and on the capturing stream, interleaved in rounds in one process,
   with CuPy's ``MemoryPool`` pair beside them. Ratios are time / time, named by direction.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
import warnings
from typing import Any

N = 1 << 20  # float32 elements


def hazard_cupy_api(use_graphpool: bool) -> dict[str, Any]:
    """The issue's program, verbatim, through CuPy's own capture API."""
    import cupy

    import graphpool as gp
    import graphpool.cupy as gcupy

    if use_graphpool:
        gcupy.install()
    else:
        gcupy.uninstall()
        cupy.cuda.set_allocator(cupy.cuda.MemoryPool().malloc)
    try:
        gc.collect()
        cupy.cuda.Device().synchronize()
        if use_graphpool:
            gp.empty_cache()
        before = gp.memory_reserved() if use_graphpool else 0
        x = cupy.ones(N, dtype=cupy.float32)
        (x * 3.0 + 1.0).sum()  # compile the kernels before the capture
        s = cupy.cuda.Stream(non_blocking=True)
        with s:
            s.begin_capture()
            t = x * 3.0
            out = t + 1.0
            del t
            g = s.end_capture()
            y = cupy.full(N, 7.0, dtype=cupy.float32)  # eager, same stream, after the capture
            s.synchronize()
            g.launch(s)
            s.synchronize()
        overwritten = int((y != 7.0).sum().item())
        out_ok = bool((out == 4.0).all().item())
        row: dict[str, Any] = {
            "allocator": "graphpool" if use_graphpool else "cupy MemoryPool",
            "hooked": gcupy.hooked() if use_graphpool else False,
            "elements": N,
            "overwritten": overwritten,
            "output_correct": out_ok,
        }
        del g, y, x
        gc.collect()
        if use_graphpool:
            gp.memory_stats()  # notices the graph's release
            row["output_correct_after_graph_dropped"] = bool((out == 4.0).all().item())
            del out
            gc.collect()
            cupy.cuda.Device().synchronize()
            gp.empty_cache()
            row["reserved_before"] = before
            row["reserved_after_del"] = gp.memory_reserved()
        return row
    finally:
        if not use_graphpool:
            cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)


def hazard_raw_capture(detect: bool, mode: str) -> dict[str, Any]:
    """A raw cudaStreamBeginCapture through cuda.bindings, CuPy arrays on graphpool."""
    import cupy
    from cuda.bindings import runtime as rt

    import graphpool as gp
    import graphpool.cupy as gcupy

    gcupy.install()
    gp.set_capture_detection(detect)
    modes = {
        "global": rt.cudaStreamCaptureMode.cudaStreamCaptureModeGlobal,
        "relaxed": rt.cudaStreamCaptureMode.cudaStreamCaptureModeRelaxed,
    }
    try:
        gc.collect()
        cupy.cuda.Device().synchronize()
        gp.empty_cache()
        before = gp.memory_reserved()
        x = cupy.ones(N, dtype=cupy.float32)
        (x * 3.0 + 1.0).sum()
        s = cupy.cuda.Stream(non_blocking=True)
        with s:
            assert rt.cudaStreamBeginCapture(s.ptr, modes[mode])[0] == 0
            t = x * 3.0
            out = t + 1.0
            del t
            err, graph = rt.cudaStreamEndCapture(s.ptr)
            assert err == 0, err
            err, exe = rt.cudaGraphInstantiate(graph, 0)
            assert err == 0, err
            y = cupy.full(N, 7.0, dtype=cupy.float32)
            s.synchronize()
            rt.cudaGraphLaunch(exe, s.ptr)
            s.synchronize()
        row: dict[str, Any] = {
            "mode": mode,
            "detection": detect,
            "elements": N,
            "overwritten": int((y != 7.0).sum().item()),
            "output_correct": bool((out == 4.0).all().item()),
        }
        rt.cudaGraphExecDestroy(exe)
        rt.cudaGraphDestroy(graph)
        del y, x
        gc.collect()
        gp.memory_stats()
        row["output_correct_after_graph_destroyed"] = bool((out == 4.0).all().item())
        del out
        gc.collect()
        cupy.cuda.Device().synchronize()
        gp.empty_cache()
        row["reserved_before"] = before
        row["reserved_after_destroy"] = gp.memory_reserved()
        return row
    finally:
        gp.set_capture_detection(True)


def cuda_core_builder() -> dict[str, Any]:
    """cuda.core GraphBuilder: a buffer from GraphpoolMemoryResource written by the graph."""
    import cupy

    try:
        from cuda.core import Device
    except ImportError:
        from cuda.core.experimental import Device
    from cuda.bindings import runtime as rt

    import graphpool as gp
    from graphpool.cuda_core import GraphpoolMemoryResource, hooked

    dev = Device(0)
    dev.set_current()
    mr = GraphpoolMemoryResource(0)
    stream = dev.create_stream()
    gc.collect()
    gp.empty_cache()
    before = gp.memory_reserved()
    gb = (
        stream.create_graph_builder()
        if hasattr(stream, "create_graph_builder")
        else dev.create_graph_builder()
    )
    gb.begin_building()
    handle = int(gb.stream.handle)
    tmp = mr.allocate(4 * N, stream=gb)
    assert rt.cudaMemsetAsync(int(tmp.handle), 0x3F, 4 * N, handle)[0] == 0  # the graph writes it
    tmp_ptr = int(tmp.handle)
    tmp.close(gb)  # dropped inside the capture
    gb.end_building()
    graph = gb.complete()
    eager = mr.allocate(4 * N, stream=stream)
    eager_ptr = int(eager.handle)
    y = cupy.ndarray(
        (N,), cupy.float32, cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(eager_ptr, 4 * N, eager), 0)
    )
    with cupy.cuda.ExternalStream(int(stream.handle)):
        y.fill(7.0)
    stream.sync()
    graph.launch(stream)
    stream.sync()
    row = {
        "hooked": hooked(),
        "eager_got_the_graphs_block": eager_ptr == tmp_ptr,
        "overwritten": int((y != 7.0).sum().item()),
        "elements": N,
    }
    del y
    eager.close(stream)
    graph.close() if hasattr(graph, "close") else None
    del graph, gb
    gc.collect()
    gp.memory_stats()
    cupy.cuda.Device().synchronize()
    gp.empty_cache()
    row["reserved_before"] = before
    row["reserved_after"] = gp.memory_reserved()
    return row


def routing(rounds: int = 15, calls: int = 20000) -> dict[str, Any]:
    """Cached pair cost in four conditions and CuPy's, interleaved in rounds (us per pair)."""
    import cupy

    import graphpool as gp
    from graphpool import runtime

    dev = runtime.get().device(0)
    s1, s2 = gp.Stream(), gp.Stream()
    pool = cupy.cuda.MemoryPool()
    size = 4096

    def gp_pair(s: Any) -> float:
        alloc = gp.alloc
        t0 = time.perf_counter()
        for _ in range(calls):
            alloc(size, s).free()
        return (time.perf_counter() - t0) / calls * 1e6

    def cupy_pair() -> float:
        malloc = pool.malloc
        t0 = time.perf_counter()
        for _ in range(calls):
            m = malloc(size)
            del m
        return (time.perf_counter() - t0) / calls * 1e6

    names = ("cupy", "detect_on", "detect_off", "other_stream", "capturing", "capturing_gp_graph")
    out: dict[str, list[float]] = {k: [] for k in names}
    gp_pair(s1), cupy_pair()  # warm
    gc.collect()
    gc.disable()  # as bench does: no collector pause inside a timed round (any side)
    try:
        _rounds(rounds, out, gp_pair, cupy_pair, s1, s2, dev, size)
    finally:
        gc.enable()
    med = {k: statistics.median(v) for k, v in out.items()}
    best = {k: min(v) for k, v in out.items()}
    return {
        "us_per_pair_median": med,
        "us_per_pair_fastest": best,
        "us_per_pair_rounds": out,
        "ratio graphpool(detect on)/cupy time": med["detect_on"] / med["cupy"],
        "ratio graphpool(detect off)/cupy time": med["detect_off"] / med["cupy"],
        "ratio detect on/detect off time": med["detect_on"] / med["detect_off"],
        "ratio other stream during capture/no capture time": med["other_stream"] / med["detect_on"],
        "ratio capturing stream/no capture time": med["capturing"] / med["detect_on"],
        "ratio capturing stream (gp.graph)/no capture time": med["capturing_gp_graph"] / med["detect_on"],
        "rounds": rounds,
        "calls_per_round": calls,
        "size": size,
    }


def _rounds(
    rounds: int,
    out: dict[str, list[float]],
    gp_pair: Any,
    cupy_pair: Any,
    s1: Any,
    s2: Any,
    dev: Any,
    size: int,
) -> None:
    """The conditions of ``routing``, interleaved round by round."""
    import graphpool as gp
    from graphpool.device.protocol import CAPTURE_MODES

    for _ in range(rounds):
        out["cupy"].append(cupy_pair())
        gp.set_capture_detection(True)
        out["detect_on"].append(gp_pair(s1))
        gp.set_capture_detection(False)
        out["detect_off"].append(gp_pair(s1))
        gp.set_capture_detection(True)
        dev.begin_capture(s2.handle, CAPTURE_MODES["relaxed"])
        keep = gp.alloc(size, s2)  # the capture is adopted at its first allocation
        out["other_stream"].append(gp_pair(s1))
        out["capturing"].append(gp_pair(s2))
        del keep
        dev.destroy_graph(dev.end_capture(s2.handle))
        gp.memory_stats()
        g = gp.CUDAGraph()  # the same pair in a capture begun by gp.graph (it keeps footprints)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "captured no work": allocations only
            with gp.graph(g, stream=s2):
                keep = gp.alloc(size, s2)
                out["capturing_gp_graph"].append(gp_pair(s2))
                del keep
        del g
        gp.memory_stats()


def main() -> int:
    import graphpool as gp
    from graphpool.device import cuda

    gp.set_backend("cuda")
    report: dict[str, Any] = {
        "compiled": gp.compiled(),
        "native_capture_module": cuda.native_missing or "loaded",
    }
    steps = [
        ("cupy_api_on_cupy_pool", lambda: hazard_cupy_api(False)),
        ("cupy_api_on_graphpool", lambda: hazard_cupy_api(True)),
        ("raw_global_detect_on", lambda: hazard_raw_capture(True, "global")),
        ("raw_relaxed_detect_on", lambda: hazard_raw_capture(True, "relaxed")),
        ("raw_relaxed_detect_off", lambda: hazard_raw_capture(False, "relaxed")),
        ("cuda_core_graph_builder", cuda_core_builder),
        ("routing", routing),
    ]
    for name, fn in steps:
        try:
            report[name] = fn()
        except Exception as exc:  # report and go on: one failing step must not hide the others
            import traceback

            report[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-1500:]}
        print(name, json.dumps(report[name], default=str)[:600], flush=True)
    if "--json" in sys.argv:
        with open(sys.argv[sys.argv.index("--json") + 1], "w") as fh:
            json.dump(report, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
