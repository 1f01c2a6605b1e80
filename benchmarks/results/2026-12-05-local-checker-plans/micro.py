"""Micro-profile of the replay checker on the simulator: us per call of ``_check_replay`` and
``_note_replay`` for a pair of graphs sharing a pool, with empty footprints (one memset each)
and with realistic ones: "real", two graphs of 50 allocations of mixed sizes each, all kept
(outputs: the older per-replay scan compared 50 x 50); "B", one graph whose 50 temporaries
(10 kept) the other is handed for its own 45 (the footprints meet). Also a replay pair in
capture order, checker on and off. Prints two JSON lines.

    PYTHONPATH=<tree> python benchmarks/results/2026-12-05-local-checker-plans/micro.py <label>
"""

import json
import random
import sys
import time

import graphpool as gp
from graphpool import graphs, runtime

gp.set_backend("sim")
s = gp.Stream()
dev = runtime.get().device(s.device)
buf = gp.alloc(1 << 12, s)


def t(fn, n):
    r = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        r.append((time.perf_counter() - t0) / n * 1e6)
    return round(min(r), 3)


out = {"label": sys.argv[1]}
m0, m1 = gp.CUDAGraph(), gp.CUDAGraph()
with gp.stream(s):
    m0.capture_begin()
    dev.memset(buf.ptr, 1, buf.nbytes, s.handle)
    m0.capture_end()
    m1.capture_begin(m0.pool())
    dev.memset(buf.ptr, 1, buf.nbytes, s.handle)
    m1.capture_end()
gp.set_replay_checks("raise")
with gp.stream(s):
    m1.replay()
    m0.replay()
    out["empty: check"] = t(lambda: graphs._check_replay(m0, s), 20000)
    out["empty: note"] = t(lambda: graphs._note_replay(m0, s), 20000)
gp.set_replay_checks("off")

rng = random.Random(1)
sizes = [rng.choice([512, 4096, 1 << 16, 1 << 20, 3 << 20]) for _ in range(100)]
r0, r1 = gp.CUDAGraph(), gp.CUDAGraph()
keep = []
with gp.stream(s):
    r0.capture_begin()
    for n in sizes[:50]:
        keep.append(gp.alloc(n, s))
    dev.memset(buf.ptr, 1, buf.nbytes, s.handle)
    r0.capture_end()
    r1.capture_begin(r0.pool())
    for n in sizes[50:]:
        keep.append(gp.alloc(n, s))
    dev.memset(buf.ptr, 1, buf.nbytes, s.handle)
    r1.capture_end()
out["real: written/outputs/inputs"] = [len(r0._rec.written), len(r1._rec.outputs), len(r1._rec.inputs)]
gp.set_replay_checks("raise")
with gp.stream(s):
    r0.replay()
    r1.replay()  # capture order; r1 replayed after r0: r0's check 3 scans r1's outputs
    out["real: check r0 (after r1)"] = t(lambda: graphs._check_replay(r0, s), 500)
    out["real: check r1 (inputs)"] = t(lambda: graphs._check_replay(r1, s), 500)

    def cyc():
        r0.replay()
        r1.replay()

    out["real: cycle r0,r1 on"] = t(cyc, 500)
gp.set_replay_checks("off")
with gp.stream(s):
    out["real: cycle r0,r1 off"] = t(cyc, 500)
s.synchronize()
print(json.dumps(out))

# realistic B: r0 makes 50 temporaries (freed during the capture) and keeps 10 outputs; r1,
# in the same pool, is handed r0's temporaries for its own 50 temporaries: footprints meet
out2 = {"label": sys.argv[1]}
b0, b1 = gp.CUDAGraph(), gp.CUDAGraph()
keep2 = []
with gp.stream(s):
    b0.capture_begin()
    for i, n in enumerate(sizes[:60]):
        x = gp.alloc(n, s)
        if i % 6 == 0:
            keep2.append(x)
        else:
            x.free()
    dev.memset(buf.ptr, 1, buf.nbytes, s.handle)
    b0.capture_end()
    b1.capture_begin(b0.pool())
    for n in sizes[40:90]:
        gp.alloc(n, s).free()
    dev.memset(buf.ptr, 1, buf.nbytes, s.handle)
    b1.capture_end()
out2["B: written b0/b1, inputs b1"] = [len(b0._rec.written), len(b1._rec.written), len(b1._rec.inputs)]
gp.set_replay_checks("raise")
with gp.stream(s):
    b0.replay()
    b1.replay()
    out2["B: check b0"] = t(lambda: graphs._check_replay(b0, s), 500)
    out2["B: check b1"] = t(lambda: graphs._check_replay(b1, s), 500)

    def cyc2():
        b0.replay()
        b1.replay()

    out2["B: cycle on"] = t(cyc2, 500)
gp.set_replay_checks("off")
with gp.stream(s):
    out2["B: cycle off"] = t(cyc2, 500)
s.synchronize()
print(json.dumps(out2))
