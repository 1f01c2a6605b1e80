"""Where a PyTorch program's time goes with graphpool as its allocator (stop 17, issue 27).

Runs the frameworks bench's two PyTorch programs (graphpool.tools.frameworks_bench) with
graphpool installed, the shim's hooks wrapped in timers, and prints, per step: the step's
time, the time inside graphpool's malloc and free, the calls of each, and the allocator's
driver calls (num_device_alloc / num_device_free), syncs and retries. Run once per tree
(PYTHONPATH names it): `python3 benchmarks/torch_program_probe.py LABEL`.

Modes (environment): ``PROBE_UNTIMED=1`` leaves the shim's hooks as installed (the lane
works; only the step is timed); ``PROBE_COUNT=1`` wraps them in counters that pass every
answer through (the lane still parks), so ``mallocs`` and ``frees`` are the calls the lane
did not answer; ``PROBE_NATIVE=1`` does not install graphpool at all (PyTorch's own
allocator, for the step time beside it); ``PROBE_GC_OFF=1`` turns the GC off. The timed
wrappers (the default) return nothing from ``free``, so nothing parks and every allocation
reaches the hooks: the miss path's own time.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import sys
import time

import graphpool as gp


def main(label: str) -> None:
    if os.environ.get("PROBE_GC_OFF"):
        gc.disable()
    gp.set_backend("cuda")
    import torch

    import graphpool.torch as gtorch
    from graphpool import runtime

    # this checkout's bench file, whichever graphpool is measured (an older one lacks it)
    spec = importlib.util.spec_from_file_location("fb", "src/graphpool/tools/frameworks_bench.py")
    assert spec is not None and spec.loader is not None
    fb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fb)

    native = bool(os.environ.get("PROBE_NATIVE"))
    if not native:
        gtorch.install()
    malloc, free = gtorch.hooks(runtime.get())
    acc = {"malloc_ns": 0, "free_ns": 0, "mallocs": 0, "frees": 0}
    clock = time.perf_counter_ns

    def tmalloc(size: int, device: int, stream: int) -> int:
        t = clock()
        try:
            return malloc(size, device, stream)
        finally:
            acc["malloc_ns"] += clock() - t
            acc["mallocs"] += 1

    def tfree(ptr: int, size: int, device: int, stream: int) -> None:
        t = clock()
        try:
            free(ptr, size, device, stream)
        finally:
            acc["free_ns"] += clock() - t
            acc["frees"] += 1

    def cmalloc(size: int, device: int, stream: int) -> int:
        acc["mallocs"] += 1
        return malloc(size, device, stream)

    def cfree(ptr: int, size: int, device: int, stream: int) -> object:
        acc["frees"] += 1
        return free(ptr, size, device, stream)

    if native:
        pass
    elif os.environ.get("PROBE_COUNT"):
        gtorch._shim().set_hooks(cmalloc, cfree)
    elif not os.environ.get("PROBE_UNTIMED"):
        gtorch._shim().set_hooks(tmalloc, tfree)
    out: dict[str, object] = {
        "label": label,
        "compiled": getattr(gp, "compiled", lambda: None)(),
        "gc_off": bool(os.environ.get("PROBE_GC_OFF")),
        "mode": "native"
        if native
        else "count"
        if os.environ.get("PROBE_COUNT")
        else "untimed"
        if os.environ.get("PROBE_UNTIMED")
        else "timed",
        "lane": os.environ.get("GRAPHPOOL_LANE", "1") != "0",
    }
    keys = ("num_device_alloc", "num_device_free", "num_sync_all_streams", "num_alloc_retries")
    for name, prog in fb._torch_programs(torch).items():
        for _ in range(10):
            prog()
        torch.cuda.synchronize()
        steps = 50
        s0 = {} if native else gp.memory_stats()
        for k in acc:
            acc[k] = 0
        t0 = time.perf_counter()
        for _ in range(steps):
            prog()
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / steps
        s1 = {} if native else gp.memory_stats()
        row = {"step_us": dt * 1e6}
        row.update({k: v / steps for k, v in acc.items()})
        row["malloc_us_per_step"] = acc["malloc_ns"] / steps / 1e3
        row["free_us_per_step"] = acc["free_ns"] / steps / 1e3
        row.update({k: (s1.get(k, 0) - s0.get(k, 0)) / steps for k in keys})
        row["reserved_MiB"] = (
            torch.cuda.memory_reserved() if native else s1["reserved_bytes.all.current"]
        ) / 2**20
        out[name] = row
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tree")
