"""Where a segmentation fault seen once on the H200 comes from (stop 16, run 5): the state a
failed test left (a capture begun outside graphpool on a graphpool stream, a CuPy array
dropped during it and carried out before the capture was detected, the graph and its
executable never destroyed), then its objects let go one at a time, each step printed
before it runs. Each variant runs in a child process, so a crash names its step.

    python3 benchmarks/gc_crash_probe_gpu.py
"""

from __future__ import annotations

import subprocess
import sys

N = 1 << 18


def variant(order: str) -> None:
    """One child: build the state, then let go of its parts in ``order`` (letters: y, z, t
    the arrays; g the garbage collector; e, G destroy the executable and the graph; s
    synchronize and empty the cache)."""
    import cupy

    import graphpool as gp
    import graphpool.cupy as gcupy
    from graphpool import runtime
    from graphpool.device.protocol import CAPTURE_MODES

    gcupy.install()
    dev = runtime.get().device(gp.current_device())
    s = gp.Stream()
    held: dict[str, object] = {}
    with gp.stream(s):
        w = cupy.zeros(N, dtype=cupy.float32)
        z = cupy.ones(N, dtype=cupy.float32)
        s.synchronize()
        dev.begin_capture(s.handle, CAPTURE_MODES["relaxed"])
        w.fill(5.0)
        del w
        runtime.allocator(gp.current_device())._drain()  # the free carried out before detection
        t = z + 1.0
        graph = dev.end_capture(s.handle)
        exe = dev.instantiate(graph)
        y = cupy.full(N, 7.0, dtype=cupy.float32)
    held.update(y=y, z=z, t=t)
    del y, z, t
    print("state built", flush=True)
    import gc

    for step in order:
        print("step", step, flush=True)
        if step in "yzt":
            del held[step]
        elif step == "g":
            gc.collect()
        elif step == "e":
            dev.destroy_graph_exec(exe)
        elif step == "G":
            dev.destroy_graph(graph)
        elif step == "s":
            gp.synchronize()
            gp.empty_cache()
    print("survived", flush=True)


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        variant(sys.argv[2])
        return 0
    for order in ("yztgs", "tzygs", "gyzts", "yztseG", "eGyzts"):
        proc = subprocess.run(
            [sys.executable, "-X", "faulthandler", __file__, "--child", order],
            capture_output=True,
            text=True,
            timeout=60,
        )
        last = [ln for ln in proc.stdout.splitlines() if ln.startswith(("step", "survived"))][-1:]
        err = proc.stderr.strip().splitlines()
        print(f"order {order}: exit {proc.returncode}, last {last}, stderr {err[:3]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
