"""``python -m graphpool demo``: the seed's scenarios with their results and memory figures.

Runs on the GPU with CuPy arrays when a GPU (and CuPy) is usable, else on the simulated
device with ``graphpool.sim.xp``. Every figure printed is measured in this run.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

import graphpool as gp
from graphpool import runtime
from graphpool.snapshot import fmt_bytes

MiB = 1 << 20
SHARING = ("none", "via pool()", "via graph_pool_handle()")


def _f(t: Any, v: float) -> Any:
    x = t.copy() + v
    y = t.copy() + v
    return x + y


def _settle() -> None:
    gc.collect()
    gp.synchronize()
    gp.empty_cache()


def _per_elem(arr: Any, n: int) -> float:
    return float(arr.sum().item()) / n


def _pool_args(share: str, g0: gp.CUDAGraph | None, first: tuple[Any, ...]) -> tuple[Any, ...]:
    if g0 is None:
        return (gp.graph_pool_handle(),) if share == "via graph_pool_handle()" else ()
    return (g0.pool(),) if share == "via pool()" else first


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [headers] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = "  ".join("-" * w for w in widths)
    out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)), line]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells[1:]]
    return "\n".join("    " + s for s in out)


def two_successive(xp: Any) -> str:
    n = 1000
    s = gp.Stream()
    rows = []
    base = None
    for share in SHARING:
        _settle()
        a = xp.ones(n, dtype=xp.float32)
        g0, g1 = gp.CUDAGraph(), gp.CUDAGraph()
        s.wait_stream(gp.current_stream())
        with gp.stream(s):
            first = _pool_args(share, None, ())
            g0.capture_begin(*first)
            b = a.copy()
            for _ in range(5):
                b = _f(b, 1)
            g0.capture_end()
            g1.capture_begin(*_pool_args(share, g0, first))
            for _ in range(5):
                b = _f(b, 1)
            g1.capture_end()
        gp.current_stream().wait_stream(s)
        c = a.copy()
        for _ in range(2):
            c = _f(c, 3)
        g0.replay()
        for _ in range(2):
            c = _f(c, 3)
        g1.replay()
        for _ in range(2):
            c = _f(c, 3)
        reserved = gp.memory_reserved()
        base = reserved if base is None else base
        rows.append(
            [
                share,
                f"{_per_elem(b, n):g}",
                f"{_per_elem(c, n):g}",
                fmt_bytes(reserved),
                "-" if share == "none" else f"{base - reserved:,} B",
            ]
        )
        del a, b, c, g0, g1
    return _table(["sharing", "b/elem (3070)", "c/elem (442)", "reserved", "saved by sharing"], rows)


def concurrent_replay(xp: Any, spin: Callable[[gp.Stream], None]) -> str:
    n = 1_000_000
    s = gp.Stream()
    rows = []
    for share in SHARING:
        _settle()
        g0, g1 = gp.CUDAGraph(), gp.CUDAGraph()
        s0, s1 = gp.Stream(), gp.Stream()
        a = xp.ones(n, dtype=xp.float32)
        s.wait_stream(gp.current_stream())
        with gp.stream(s):
            first = _pool_args(share, None, ())
            g0.capture_begin(*first)
            b = a.copy()
            for _ in range(5):
                b = _f(b, 1)
            g0.capture_end()
            g1.capture_begin(*_pool_args(share, g0, first))
            c = a.copy()
            for _ in range(5):
                c = _f(c, 2)
            g1.capture_end()
        gp.synchronize()
        with gp.stream(s0):
            spin(s0)
            s1.wait_stream(s0)
            g0.replay()
        with gp.stream(s1):
            g1.replay()
        gp.current_stream().wait_stream(s0)
        gp.current_stream().wait_stream(s1)
        pb, pc = _per_elem(b, n), _per_elem(c, n)
        intact = abs(pb - 94) < 1e-3 and abs(pc - 156) < 1e-3
        rows.append([share, f"{pb:.4g}", f"{pc:.4g}", "intact" if intact else "corrupted"])
        del a, b, c, g0, g1
    return _table(["sharing", "b/elem (94)", "c/elem (156)", "overlapping replays"], rows)


def three_successive(xp: Any) -> str:
    n = 1000
    s = gp.Stream()
    rows = []
    for share in SHARING:
        _settle()
        a = xp.ones(n, dtype=xp.float32)
        g0, g1, g2 = gp.CUDAGraph(), gp.CUDAGraph(), gp.CUDAGraph()
        s.wait_stream(gp.current_stream())
        with gp.stream(s):
            first = _pool_args(share, None, ())
            g0.capture_begin(*first)
            b = a.copy()
            c = b + 1
            d = b + 2
            g0.capture_end()
            args = _pool_args(share, g0, first)
            g1.capture_begin(*args)
            e = c + 3
            del c
            g1.capture_end()
            g2.capture_begin(*args)
            f = d + 4
            g2.capture_end()
        gp.current_stream().wait_stream(s)
        g0.replay()
        g1.replay()
        g2.replay()
        in_order = f"{_per_elem(e, n):g}, {_per_elem(f, n):g}"
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
        rows.append([share, in_order, f"{_per_elem(e, n):g}, {_per_elem(f, n):g}", report])
        del a, b, d, e, f, g0, g1, g2
    return _table(["sharing", "g0,g1,g2: e, f (5, 7)", "g0,g2,g1: e, f", "checker on g0,g2,g1"], rows)


def memory_stats_after_destroy(xp: Any) -> str:
    cases = (
        (128, "small_pool"),
        (262144, "small_pool"),
        (262272, "large_pool"),
        (2621312, "large_pool"),
        (2621568, "large_pool"),
    )
    rows = []
    s = gp.Stream()
    for numel, pool in cases:
        _settle()
        g = gp.CUDAGraph()
        s.wait_stream(gp.current_stream())
        with gp.stream(s):
            a = xp.ones(numel, dtype=xp.float32)
            pre = gp.memory_stats()
            g.capture_begin()
            b = a.copy()
            for _ in range(5):
                b = b.copy() + 1
            g.capture_end()
        gp.current_stream().wait_stream(s)
        gc.collect()
        post = gp.memory_stats()
        g.replay()
        ok = _per_elem(b, numel) == 6

        def d(after: dict[str, int], stat: str, pool: str = pool, pre: dict[str, int] = pre) -> int:
            key = f"{stat}.{pool}.current"
            return after[key] - pre[key]

        seg, res = d(post, "segment"), d(post, "reserved_bytes")
        act, actb = d(post, "active"), d(post, "active_bytes")
        del g
        _settle()
        after = gp.memory_stats()
        ok = ok and _per_elem(b, numel) == 6
        rows.append(
            [
                f"{numel:,}",
                pool,
                f"+{seg}",
                f"+{res // MiB} MiB",
                f"+{act}",
                f"+{actb:,} B",
                f"+{d(after, 'segment')} / +{d(after, 'reserved_bytes') // MiB} MiB",
                "6 per elem" if ok else "WRONG",
            ]
        )
        del a, b
    return _table(
        ["numel", "pool", "segments", "reserved", "active", "active bytes", "after graph deleted", "b"], rows
    )


def hazard_closed(xp: Any) -> str:
    n = 1 << 20
    _settle()
    s = gp.Stream()
    with gp.stream(s):
        a = xp.ones(n, dtype=xp.float32)
        g = gp.CUDAGraph()
        g.capture_begin()
        t = a * 2
        out = t + 1
        del t
        g.capture_end()
        y = xp.full(n, 7, dtype=xp.float32)
        g.replay()
        s.synchronize()
        wrong = int((y.get() != 7).sum())
        total = float(y.sum().item())
    del a, out, y, g
    return (
        f"    eager y = full({n:,}, 7) made after the capture freed t, then one replay: "
        f"{wrong:,} of {n:,} elements overwritten (sum {total:,.0f}, expected {7 * n:,})"
    )


def run(backend: str | None = None) -> int:
    """Run every scenario and print the tables; return a process exit status."""
    if backend is not None:
        gp.set_backend(backend)
    name = gp.backend()
    xp: Any
    spin: Callable[[gp.Stream], None]
    if name == "cuda":
        import cupy

        import graphpool.cupy as gcupy

        gcupy.install()
        xp = cupy
        from graphpool.bench import cuda_spin as spin

        dev = runtime.get().device(0)
        where = f"CUDA, {dev.name}, CuPy {cupy.__version__}"
    else:
        from graphpool.sim import xp as simxp

        xp = simxp

        def spin(st: gp.Stream) -> None:
            runtime.get().device(st.device).launch_sleep(st.handle, rounds=50)  # type: ignore[attr-defined]

        where = "the simulated device (no GPU here); arrays from graphpool.sim.xp"
    print(f"graphpool demo on {where}\n")
    t0 = time.perf_counter()
    sections = (
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
    _settle()
    gp.check_invariants()
    print(
        f"allocator invariants hold; {gp.memory_reserved():,} B reserved at exit; "
        f"{time.perf_counter() - t0:.2f} s"
    )
    return 0
