"""The CPU side of graphpool's framework entry points, two graphpool trees side by side (no GPU).

    python benchmarks/frameworks_cpu.py --tree new=SRC --tree old=SRC [--rounds N] [--cupy SITE]

What graphpool itself adds per CuPy array, per PyTorch tensor and per graph replay, on the
simulator named "cuda" (the integrations accept it; the legacy stream, which never captures,
so no simulated driver query is timed). Each tree runs in its own worker processes, the trees
taking turns process by process; every figure is microseconds per operation, min and median
over all runs.

* ``cupy, function``: ``graphpool.cupy.malloc(4096)`` made and dropped (CuPy's
  ``UnownedMemory``/``MemoryPointer`` around a DeviceBuffer; the DeviceBuffer's finalizer
  queues the free). With real CuPy classes when ``--cupy SITE`` names a folder holding CuPy
  (CuPy imports without a GPU; its current device and stream are stood in for by C-level
  calls that return 0 and a stream object with ``ptr`` 0, as CuPy's Cython calls would).
* ``cupy, native``: what CuPy's ``PythonFunctionAllocator.malloc`` does, in Python: its
  ``PythonFunctionAllocatorMemory`` over graphpool's compiled hooks, then ``MemoryPointer``,
  then dropped (trees that have graphpool.hooks).
* ``torch shim``: the shim's exported ``graphpool_torch_malloc``/``graphpool_torch_free``
  through ctypes (which releases the GIL, as PyTorch does: the shim takes it back), 4 KiB on
  the legacy stream (compiled trees only).
* ``replay``: ``CUDAGraph.replay()`` with the checker off, and the simulated device's own
  ``launch`` of the same executable; their difference is graphpool's cost per replay.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable
from typing import Any


def _timed(fn: Callable[[], None], number: int, rounds: int) -> list[float]:
    out = []
    for r in range(rounds + 1):
        n = number // 10 if r == 0 else number
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        if r:
            out.append((time.perf_counter() - t0) / n * 1e6)
    return out


def _captured(gp: Any, dev: Any, s: Any) -> tuple[Any, Any]:
    buf = gp.alloc(1 << 12, s)
    g = gp.CUDAGraph()
    with gp.stream(s):
        g.capture_begin()
        dev.memset(buf.ptr, 1, buf.nbytes, s.handle)
        g.capture_end()
    return g, buf


def cases(with_cupy: bool) -> dict[str, Callable[[], None]]:
    """Each measurement's one operation, set up (names as the module docstring)."""
    import graphpool as gp
    from graphpool import runtime
    from graphpool.sim import SimBackend
    from graphpool.tools.benchkit import torch_entry_points

    class SimAsCuda(SimBackend):  # type: ignore[misc]
        name = "cuda"

    runtime.set_backend("cuda", backend=SimAsCuda())
    out: dict[str, Callable[[], None]] = {}
    import graphpool.cupy as gcupy

    if with_cupy:
        import cupy.cuda.memory as cm

        unowned, pointer, pfa_memory = cm.UnownedMemory, cm.MemoryPointer, cm.PythonFunctionAllocatorMemory
    else:  # stand-ins of the same shape (Python classes: slower than CuPy's Cython ones)

        class Unowned:
            def __init__(self, ptr: int, size: int, owner: Any, device_id: int) -> None:
                self.ptr, self.size, self._owner, self.device_id = ptr, size, owner, device_id

        class Pointer:
            def __init__(self, mem: Any, offset: int) -> None:
                self.mem, self.ptr = mem, mem.ptr + offset

        class PfaMemory:
            def __init__(self, size: int, malloc: Any, free: Any, device_id: int) -> None:
                self._free, self.device_id, self.ptr = free, device_id, malloc(size, device_id)

            def __del__(self) -> None:
                self._free(self.ptr, self.device_id)

        unowned, pointer, pfa_memory = Unowned, Pointer, PfaMemory
    stream0 = types.SimpleNamespace(ptr=0)
    get_device = (0).__int__  # C-level calls, as CuPy's Cython ones
    current = {0: stream0}.__getitem__
    gcupy._calls = (get_device, current, unowned, pointer)
    gcupy._cp = types.SimpleNamespace(cuda=types.SimpleNamespace(Memory=None))
    malloc = gcupy.malloc

    def function_path() -> None:
        malloc(4096)

    out["cupy, function: malloc(4096) + drop"] = function_path
    try:
        from graphpool.hooks import CupyHooks
    except ImportError:
        pass
    else:
        hooks = CupyHooks(current, gcupy._find)
        hm, hf = hooks.malloc, hooks.free

        def native_path() -> None:
            pointer(pfa_memory(4096, hm, hf, 0), 0)

        out["cupy, native: PythonFunctionAllocator's malloc(4096) + drop"] = native_path
    try:
        import graphpool.torch as gtorch

        shim = gtorch._shim()
    except RuntimeError:
        shim = None
    if shim is not None:
        shim.set_hooks(*gtorch.hooks())
        lib = torch_entry_points()
        tm, tf = lib.graphpool_torch_malloc, lib.graphpool_torch_free

        def torch_pair() -> None:
            tf(tm(4096, 0, None), 4096, 0, None)

        out["torch shim: malloc+free 4 KiB through ctypes"] = torch_pair
    s = gp.Stream()
    dev = runtime.get().device(0)
    buf = gp.alloc(1 << 12, s)
    g = gp.CUDAGraph()
    with gp.stream(s):
        g.capture_begin()
        dev.memset(buf.ptr, 1, buf.nbytes, s.handle)
        g.capture_end()
    exe = g._exec
    gp.stream(s).__enter__()  # the graph's stream current from now on (left entered)
    out["replay, checker off"] = g.replay
    g2, _buf2 = _captured(gp, dev, s)
    g2._dev = types.SimpleNamespace(launch=max)  # a C no-op: graphpool's own cost per replay
    out["replay, launch stubbed"] = g2.replay
    out["the device's own launch"] = lambda: dev.launch(exe, s.handle)
    out["sync"] = lambda: dev.stream_synchronize(s.handle)
    return out


def worker(number: int, rounds: int, with_cupy: bool) -> dict[str, list[float]]:
    ops = cases(with_cupy)
    sync = ops.pop("sync")
    out: dict[str, list[float]] = {}
    for name, fn in ops.items():
        if name.startswith(("replay, checker", "the device")):
            runs: list[float] = []
            for _ in range(rounds):  # short runs, the queue drained between them
                runs += _timed(fn, max(1, number // 20), 1)
                sync()
            out[name] = runs
        else:
            out[name] = _timed(fn, number, rounds)
    return out


def count(case: str, n: int, with_cupy: bool) -> None:
    """Run ``case`` n times (after a warm-up): for callgrind's instruction totals."""
    ops = cases(with_cupy)
    fn = next(f for k, f in ops.items() if k.startswith(case))
    sync = ops["sync"]
    for _ in range(1000):
        fn()
    sync()
    for i in range(n):
        fn()
        if i % 200 == 199:
            sync()


COUNTED = ("cupy, function", "cupy, native", "torch shim", "replay, launch stubbed")


def instructions(src: str, case: str, cupy: str | None, n: int) -> int | None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(x for x in (src, cupy) if x))
    cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, __file__]
    cmd += ["--count", case, "--number", str(n)] + (["--cupy", cupy] if cupy else [])
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    m = re.search(r"Collected : (\d+)", r.stderr)
    if r.returncode or m is None:
        return None
    return int(m.group(1))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", action="append", default=[], help="NAME=SRC")
    ap.add_argument("--processes", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--number", type=int, default=20000)
    ap.add_argument("--cupy", help="a folder holding CuPy (imported without a GPU)")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--count", help="run this case --number times (for callgrind)")
    ap.add_argument("--instructions", action="store_true", help="callgrind instructions per operation")
    ap.add_argument("--case", action="append", help="with --instructions: only these (name prefixes)")
    ap.add_argument("--json")
    ns = ap.parse_args()
    if ns.count:
        count(ns.count, ns.number, bool(ns.cupy))
        return 0
    if ns.instructions:
        trees = dict(t.split("=", 1) for t in ns.tree)
        found: dict[str, float] = {}
        for case in ns.case or COUNTED:
            for name, src in trees.items():
                lo, hi = instructions(src, case, ns.cupy, 2000), instructions(src, case, ns.cupy, 12000)
                if lo is None or hi is None:
                    print(f"{case} | {name}: not available in this tree")
                    continue
                found[f"{case} | {name}"] = (hi - lo) / 10000
                print(f"{case} | {name}: {(hi - lo) / 10000:,.0f} instructions per operation", flush=True)
        if ns.json:
            with open(ns.json, "w") as fh:
                json.dump(found, fh, indent=1)
        return 0
    if ns.worker:
        gc.collect()
        gc.disable()
        print(json.dumps(worker(ns.number, ns.rounds, bool(ns.cupy))))
        return 0
    trees = dict(t.split("=", 1) for t in ns.tree)
    runs: dict[str, dict[str, list[float]]] = {name: {} for name in trees}
    order = list(trees.items())
    for p in range(ns.processes):
        for name, src in order if p % 2 == 0 else order[::-1]:
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(x for x in (src, ns.cupy) if x))
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                "--rounds",
                str(ns.rounds),
                "--number",
                str(ns.number),
            ]
            if ns.cupy:
                cmd += ["--cupy", ns.cupy]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
            if proc.returncode:
                print(f"{name}: {proc.stderr.strip()[-400:]}", file=sys.stderr)
                continue
            for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items():
                runs[name].setdefault(k, []).extend(v)
    keys = list(dict.fromkeys(k for r in runs.values() for k in r))
    summary: dict[str, Any] = {}
    for k in keys:
        print(k)
        for name in trees:
            v = runs[name].get(k)
            if v:
                summary[f"{k} | {name}"] = {"min": min(v), "median": statistics.median(v), "runs": len(v)}
                print(
                    f"  {name:<8} min {min(v):8.3f} us  "
                    f"median {statistics.median(v):8.3f} us  ({len(v)} runs)"
                )
    for name in trees:
        r = runs[name]
        if "replay, checker off" in r and "the device's own launch" in r:
            extra = statistics.median(r["replay, checker off"]) - statistics.median(
                r["the device's own launch"]
            )
            summary[f"replay - launch | {name}"] = extra
            print(f"replay's own cost (median replay - median launch), {name}: {extra:.3f} us")
    if ns.json:
        with open(ns.json, "w") as fh:
            json.dump({"summary": summary, "runs": runs}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
