"""The replay checker's cost on the simulator, per replay, beside the simulated launch.

`PYTHONPATH=SRC python benchmarks/checker_cost_sim.py LABEL` prints one JSON line: the median
microseconds per call of the simulator's own launch, ``replay()`` with the checker off, on
for a graph alone in its pool, on for a graph whose pool is shared with a second graph that
replays on the same stream, and on for one whose mate replays on another stream. Alternate
trees process by process and compare ratios to the launch, never absolute times (no GPU: the
device calls are the simulator's).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable

import graphpool as gp
from graphpool import runtime


def per_call(fn: Callable[[], None], n: int, sync: Callable[[], None]) -> float:
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - t0) / n * 1e6


def main(label: str) -> None:
    gp.set_backend("sim")
    s, other = gp.Stream(), gp.Stream()
    dev = runtime.get().device(s.device)
    buf = gp.alloc(1 << 12, s)
    g, m0, m1, n0, n1 = (gp.CUDAGraph() for _ in range(5))
    with gp.stream(s):
        for graph, mate in ((g, None), (m0, None), (m1, m0), (n0, None), (n1, n0)):
            graph.capture_begin(None if mate is None else mate.pool())
            dev.memset(buf.ptr, 1, buf.nbytes, s.handle)
            graph.capture_end()
    exe = g._exec
    gp.set_replay_checks("raise")
    with gp.stream(s):
        m1.replay()
        n0.replay()
    with gp.stream(other):
        other.wait_stream(s)
        n1.replay()  # n0's pool has seen two streams
    gp.synchronize()

    def two_streams() -> None:
        n0.replay()  # on s, after n1's last replay on other, which s waited for

    cases: list[tuple[str, str, Callable[[], None]]] = [
        ("simulated launch", "off", lambda: dev.launch(exe, s.handle)),
        ("checker off", "off", g.replay),
        ("checker on, alone in its pool", "raise", g.replay),
        ("checker on, pool shared, one stream", "raise", m0.replay),
        ("checker on, pool shared, mate on another stream", "raise", two_streams),
    ]
    runs: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    with gp.stream(s):
        s.wait_stream(other)
        for r in range(8):
            for name, mode, fn in cases:
                gp.set_replay_checks(mode)
                t = per_call(fn, 1000, s.synchronize)
                if r:
                    runs[name].append(t)
    gp.set_replay_checks("off")
    med = {k: statistics.median(v) for k, v in runs.items()}
    launch = med["simulated launch"]
    print(
        json.dumps(
            {
                "label": label,
                **{k: round(v, 3) for k, v in med.items()},
                **{f"{k} / launch": round(v / launch, 3) for k, v in med.items() if k != "simulated launch"},
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tree")
