"""Plan making and checking cost as footprints grow: four graphs sharing a pool, each capture
making n allocations of mixed sizes (one in five kept). Prints the time to make the four
plans (with and without the merged footprints already made) and a checked replay's
``_check_replay`` per call.

    PYTHONPATH=src python benchmarks/results/2026-12-05-local-checker-plans/plan_build.py
"""

import random
import time

import graphpool as gp
from graphpool import graphs, runtime

gp.set_backend("sim")
s = gp.Stream()
dev = runtime.get().device(s.device)
buf = gp.alloc(4096, s)
rng = random.Random(2)
for n in (50, 500, 2000):
    gs = [gp.CUDAGraph() for _ in range(4)]
    keep = []
    pool = None
    with gp.stream(s):
        for g in gs:
            g.capture_begin(pool)
            for i in range(n):
                b = gp.alloc(rng.choice([512, 4096, 1 << 16, 1 << 20]), s)
                (keep.append(b) if i % 5 == 0 else b.free())
            dev.memset(buf.ptr, 1, 64, s.handle)
            g.capture_end()
            pool = g.pool()
    t0 = time.perf_counter()
    for g in gs:
        g._extent = None
        graphs._plan(g, g._mates)
    t1 = time.perf_counter()
    for g in gs:
        graphs._plan(g, g._mates)  # extents kept
    t2 = time.perf_counter()
    p = gs[-1]._plan
    made, again = 1e3 * (t1 - t0), 1e3 * (t2 - t1)
    outs = sum(len(o) for _, o in p.clobbers)
    print(
        f"n={n} written={[len(g._rec.written) for g in gs]} inputs(last)={len(gs[-1]._rec.inputs)}: "
        f"4 plans with extents {made:.2f} ms, again {again:.2f} ms; "
        f"last plan meets={len(p.meets)} inputs={len(p.inputs)} clobber outs={outs}"
    )
    gp.set_replay_checks("raise")
    with gp.stream(s):
        gs[0].replay()
        t0 = time.perf_counter()
        for _ in range(1000):
            graphs._check_replay(gs[0], s)
        print(f"   check g0 per call {1e3 * (time.perf_counter() - t0):.3f} us")
    gp.set_replay_checks("off")
    for g in gs:
        g.reset()
    del keep
