"""What a bound lane costs a hooks call that it does not answer (the simulator, this machine).

The CuPy hooks (``graphpool.hooks.CupyHooks``) over the simulated device's allocator, with
and without the shim's lane bound (``graphpool.lanes.binder``): ``cycle`` frees each of four
sizes before asking for the next (the lane never answers; every call reaches the policy),
``same`` repeats one size (the Python-side park and take-back). Needs the compiled shim.

    python benchmarks/lane_miss_cost.py lane     # the lane bound
    python benchmarks/lane_miss_cost.py none     # no lane
"""

from __future__ import annotations

import sys
import timeit

import graphpool as gp
from graphpool import lanes, routing, runtime
from graphpool.hooks import CupyHooks
from graphpool.routing import Route
from graphpool.streams import resolve_handle


class _Legacy:
    ptr = 0  # CuPy's default stream's handle


def main() -> None:
    gp.set_backend("sim")
    a = runtime.allocator()

    def find(device: int, raw: int) -> Route:
        generation = routing.routes.generation
        handle = resolve_handle(raw, "lane_miss_cost", "the stream")
        return Route(handle, runtime.allocator(device), generation)

    bind = lanes.binder("graphpool.cupy") if sys.argv[1:] == ["lane"] else None
    h = CupyHooks(lambda device: _Legacy, find, bind)

    def cycle() -> None:
        for n in (512, 4096, 65536, 1 << 20):
            h.free(h.malloc_on(n, 0, 0), 0)

    def same() -> None:
        h.free(h.malloc_on(4096, 0, 0), 0)

    cycle()
    print(f"lane bound: {getattr(a, '_lane', None) is not None}; compiled {gp.compiled()}")
    for name, fn, k in (("cycle", cycle, 4), ("same", same, 1)):
        best = min(timeit.repeat(fn, number=20000, repeat=5)) / 20000 / k
        print(f"{name}: {best * 1e6:.3f} us a malloc+free")


if __name__ == "__main__":
    main()
