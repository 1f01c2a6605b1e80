"""``python -m graphpool demo``: five example scenarios with their results and memory figures.

The scenarios are the test plan PyTorch's graph-pool design was checked against (they are
described in docs/behaviour.rst, "Scenarios"). Runs on the GPU with CuPy arrays when a GPU
(and CuPy) is usable, else on the simulated device with ``graphpool.sim.xp``. Every figure
printed is measured in this run.

How to read the tables (each table also prints its own key):

- A number in parentheses in a column title is the value that column should show, e.g.
  "b/elem (3070)": each element of the graphs' result ``b`` (its sum divided by its
  length) should be 3070.
- "corrupted" in scenario 2 is the expected outcome for the shared pools: two graphs
  sharing one pool that replay at the same time on two streams overwrite each other's
  temporaries, exactly as they would on a GPU. That is why replays of pool-sharing graphs
  must not overlap; with separate pools ("none") the results stay intact.
- "+1 / +2 MiB" in scenario 4 ("after graph deleted") is segments / reserved memory still
  held, compared with before the capture, once the graph is deleted and the cache emptied:
  the graph's output ``b`` is still referenced, so the segment holding it stays.
- "all back" in scenario 4: after ``a`` and ``b`` are dropped too and the cache is emptied,
  every memory statistic is back to its value before the scenario.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from typing import Any

import graphpool as gp
from graphpool import runtime
from graphpool.policy.units import fmt_bytes
from graphpool.tools import scenarios as sc
from graphpool.tools.scenarios import SHARING

MiB = 1 << 20


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [headers] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = "  ".join("-" * w for w in widths)
    out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)), line]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells[1:]]
    return "\n".join("    " + s for s in out)


def _key(text: str, width: int = 92) -> str:
    """A table's key, wrapped and indented under it."""
    import textwrap

    return "\n" + "\n".join(textwrap.wrap(text, width, initial_indent="    ", subsequent_indent="    "))


def two_successive(xp: Any) -> str:
    rows = []
    base = None
    for share in SHARING:
        r = sc.two_successive(xp, share)
        base = r.reserved if base is None else base
        saved = "-" if share == "none" else f"{base - r.reserved:,} B"
        rows.append([share, f"{r.b_per_elem:g}", f"{r.c_per_elem:g}", fmt_bytes(r.reserved), saved])
    table = _table(["sharing", "b/elem (3070)", "c/elem (442)", "reserved", "saved by sharing"], rows)
    return table + _key(
        "b/elem and c/elem: each element of the graphs' result b and of the eager result c "
        "(expected value in parentheses); reserved: device memory held after the scenario; "
        "saved by sharing: reserved memory saved against separate pools (expected 2,097,152 B)."
    )


def concurrent_replay(xp: Any, spin: Callable[[gp.Stream], None]) -> str:
    rows = []
    for share in SHARING:
        b, c = sc.concurrent_replay(xp, spin, share)
        intact = abs(b - 94) < 1e-3 and abs(c - 156) < 1e-3
        rows.append([share, f"{b:.4g}", f"{c:.4g}", "intact" if intact else "corrupted"])
    table = _table(["sharing", "b/elem (94)", "c/elem (156)", "overlapping replays"], rows)
    return table + _key(
        "Two graphs replay at the same time on two streams. 'corrupted' is the expected outcome "
        "when they share a pool: their temporaries share memory, so the replays overwrite each "
        "other's (as on a GPU); with separate pools ('none') both results stay intact."
    )


def three_successive(xp: Any) -> str:
    rows = []
    for share in SHARING:
        r = sc.three_graphs(xp, share)
        g0, g1, g2, n = r["g0"], r["g1"], r["g2"], r["n"]
        g0.replay()
        g1.replay()
        g2.replay()
        in_order = f"{sc.per_elem(r['e'], n):g}, {sc.per_elem(r['f'], n):g}"
        gp.set_replay_checks("raise")
        try:
            g0.replay()
            g2.replay()
            g1.replay()
            report = "nothing to report"
        except gp.ReplayHazardError:
            report = "ReplayHazardError raised"
            gp.set_replay_checks("off")
            g1.replay()  # what the unchecked program would have done
        finally:
            gp.set_replay_checks("off")
        rows.append([share, in_order, f"{sc.per_elem(r['e'], n):g}, {sc.per_elem(r['f'], n):g}", report])
        del r, g0, g1, g2
    table = _table(["sharing", "g0,g1,g2: e, f (5, 7)", "g0,g2,g1: e, f", "checker on g0,g2,g1"], rows)
    return table + _key(
        "e, f: each element of the outputs of g1 and g2. Replayed out of capture order, graphs "
        "sharing a pool give e = 10 instead of 5: the expected failure this scenario shows. "
        "The replay checker (gp.set_replay_checks('raise')) refuses that order before it runs."
    )


def memory_stats_after_destroy(xp: Any) -> str:
    rows = []
    for numel, pool, *_ in sc.MEMORY_CASES:
        r = sc.memory_case(xp, numel, pool)
        d, after = r.after_capture[0], r.after_delete
        ok = r.b_after_replay == [6, 6] and r.b_after_delete == 6
        rows.append(
            [
                f"{numel:,}",
                pool,
                f"+{d['segment']}",
                f"+{d['reserved_bytes'] // MiB} MiB",
                f"+{d['active']}",
                f"+{d['active_bytes']:,} B",
                f"+{after['segment']} / +{after['reserved_bytes'] // MiB} MiB",
                "6 per elem" if ok else "WRONG",
                "yes" if r.back_to_start else "NO",
            ]
        )
    headers = [
        "numel",
        "pool",
        "segments",
        "reserved",
        "active",
        "active bytes",
        "after graph deleted",
        "b",
        "all back",
    ]
    return _table(headers, rows) + _key(
        "segments, reserved, active, active bytes: change from before the capture to after it. "
        "after graph deleted: segments / reserved still held once the graph is deleted and the "
        "cache emptied (the output b is still referenced). b: each element after replays "
        "(expected 6). all back: after a and b are dropped too and the cache emptied, every "
        "statistic is back where it started."
    )


def hazard_closed(xp: Any) -> str:
    n = 1 << 20
    wrong, y_total, _ = sc.hazard(xp, n)
    return (
        f"    eager y = full({n:,}, 7) made after the capture freed t, then one replay: "
        f"{wrong:,} of {n:,} elements overwritten (sum {y_total:,.0f}, expected {7 * n:,})"
    )


def run(backend: str | None = None) -> int:
    """Run every scenario and print the tables; return a process exit status."""
    if backend is not None:
        gp.set_backend(backend)
    name = gp.backend()
    xp: Any
    spin: Callable[[gp.Stream], None]
    if name == "cuda" and importlib.util.find_spec("cupy") is None:
        print(
            "A GPU is usable but CuPy is not installed (pip install -e '.[cu12]' or '.[cu13]', "
            "for the driver's CUDA version): running the scenarios on the simulated device instead.\n"
        )
        gp.set_backend("sim")
        name = "sim"
    if name == "cuda":
        import cupy

        import graphpool.cupy as gcupy

        gcupy.install()
        xp = cupy
        from graphpool.tools.benchkit import cuda_spin as spin

        dev = runtime.get().device(0)
        where = f"CUDA, {dev.name}, CuPy {cupy.__version__}"
    else:
        from graphpool.sim import xp as simxp

        xp = simxp

        def spin(st: gp.Stream) -> None:
            runtime.get().device(st.device).launch_sleep(st.handle, rounds=50)  # type: ignore[attr-defined]

        where = "the simulated device (no GPU here); arrays from graphpool.sim.xp"
    build = "compiled by mypyc" if gp.compiled() else "plain Python"
    print(f"graphpool demo on {where}; allocator {build}\n")
    t0 = time.perf_counter()
    sections: tuple[tuple[str, Callable[[], str]], ...] = (
        ("1. two_successive: g1 continues g0's work; a shared pool saves memory", lambda: two_successive(xp)),
        ("2. concurrent_replay: overlapping replays on two streams", lambda: concurrent_replay(xp, spin)),
        ("3. three_successive: replay order g0,g2,g1 is unsafe when shared", lambda: three_successive(xp)),
        ("4. memory stats across capture, replay and graph deletion", lambda: memory_stats_after_destroy(xp)),
        ("5. CuPy's hazard (a block freed during capture), closed", lambda: hazard_closed(xp)),
    )
    for title, fn in sections:
        print(title)
        print(fn())
        print()
    sc.settle()
    gp.check_invariants()
    print(
        f"allocator invariants hold; {gp.memory_reserved():,} B reserved at exit; "
        f"{time.perf_counter() - t0:.2f} s"
    )
    return 0
