"""allocate + close through GraphpoolMemoryResource on the simulator, with the cuda.core twin.

    python benchmarks/cuda_core_twin_bench.py [--module PATH]

Times ``mr.allocate(4096, stream=s).close(s)`` (graphpool's share plus the twin's Buffer, which
is plain Python, unlike cuda.core's) and the twin's ``Buffer.from_handle`` alone. ``--module``
loads another version of graphpool/cuda_core.py in place of this tree's (a side-by-side
comparison of the integration alone; everything else is this tree's). Run from the repo root.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import timeit

sys.path.insert(0, "tests")

import graphpool as gp
import twins


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--module", help="a cuda_core.py to load instead of this tree's")
    ap.add_argument("--number", type=int, default=20000)
    ns = ap.parse_args()
    twins.use_sim_as_cuda()
    fake = twins.make_cuda_core("1.x")
    sys.modules["cuda.core"] = fake
    if ns.module:
        spec = importlib.util.spec_from_file_location("graphpool.cuda_core", ns.module)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules["graphpool.cuda_core"] = mod
        spec.loader.exec_module(mod)
    import graphpool.cuda_core as gcore

    mr = gcore.GraphpoolMemoryResource(0)
    s = fake.Device(0).create_stream()

    def one() -> None:
        mr.allocate(4096, stream=s).close(s)

    def buffer_only() -> None:
        fake.Buffer.from_handle(1234, 4096, mr=None, stream=s)

    for _ in range(10):
        one()
    n = ns.number
    pair = min(timeit.repeat(one, number=n, repeat=7)) / n * 1e6
    buf = min(timeit.repeat(buffer_only, number=n, repeat=7)) / n * 1e6
    print(f"module {ns.module or 'this tree'}; compiled {gp.compiled()}")
    print(f"allocate + close: {pair:.2f} us (min of 7); the twin's Buffer.from_handle alone: {buf:.2f} us")


if __name__ == "__main__":
    main()
