"""``python -m graphpool bench``: allocator and graph benchmarks, measured side by side.

Honesty rules every comparison here follows:

* Both sides of a ratio are measured in the same process, interleaved: the conditions
  alternate in rounds (A, B, A, B, ...), so they share the host's drift; each figure is
  the median over the rounds (the least disturbed round is reported too where it helps).
* Every ratio names its direction: ``"graphpool/cupy time"`` is graphpool's time divided
  by CuPy's, so above 1 means graphpool is slower.
* Graph replays are synchronized between timed runs (work queued by one run never
  slows the next), and compared with the raw launch underneath: ``cudaGraphLaunch``
  called through cuda.bindings on a GPU, the device's own ``launch`` on the simulator,
  with graphpool's replay checker off and on.
* CUDA's own gain (one graph replay against the same kernels launched eagerly) is
  labelled as CUDA's, not graphpool's.
* A comparison that cannot run here (CuPy missing, no GPU) is listed with the reason.
* Trace replays (``graphpool.traces``) run every allocator through the same loop over the
  same prebuilt event list, so the loop's own cost is common to all sides.

Layout: ``SECTIONS`` lists the sections in order (a new section is one ``Section`` entry:
its JSON key, its title and the function that runs it); the sections here time the cached
pair, routing and replays, graphpool.tools.trace_bench replays the traces, and
graphpool.tools.benchkit holds what they share (interleaved timing, progress, skips, number
formats), so a section in a module of its own imports benchkit, never this module.

Output: a table (rounded, with units) on stdout; ``--json`` prints the machine-readable
form instead, ``--json PATH`` writes it to PATH as well as printing the table. Progress
goes to stderr. ``--quick``: small iteration counts (the CI smoke test). Absolute times
only mean something on a real GPU.
"""

from __future__ import annotations

import dataclasses
import errno
import gc
import itertools
import json
import os
import statistics
import threading
from collections.abc import Callable
from typing import Any

import graphpool as gp
from graphpool import runtime
from graphpool.tools.benchkit import (
    Skipped,
    fmt_size,
    fmt_value,
    interleaved,
    label_of,
    new_cupy_pool,
    note_progress,
    per_call,
    shown,
    skip,
    start_progress,
    timed_runs,
)
from graphpool.tools.trace_bench import bench_traces, trace_rows

PAIR_SIZES = (512, 65536, 4 << 20)
MIXED_SIZES = (512, 64 << 10, 1 << 20, 4 << 20, 24 << 20)
CUPY_POOL = "cupy MemoryPool malloc+free"


def bench_malloc_free(number: int, repeat: int, skipped: Skipped | None = None) -> dict[str, Any]:
    """A cached malloc+free pair at one size: graphpool's public call, its policy alone, and CuPy's pool."""
    skipped = [] if skipped is None else skipped
    s = gp.current_stream()
    alloc = runtime.allocator()
    results: dict[str, Any] = {}
    cupy_pool = new_cupy_pool(skipped, "malloc+free pair vs CuPy MemoryPool")
    for n in PAIR_SIZES:
        note_progress(f"malloc+free pair, {fmt_size(n)}")
        fns: dict[str, Callable[[], None]] = {}

        def gp_pair(n: int = n) -> None:
            gp.alloc(n, s).free()

        def gp_pair_current(n: int = n) -> None:
            gp.alloc(n).free()  # on the current stream (the same stream, found per thread)

        def gp_collect(n: int = n) -> None:
            gp.alloc(n, s)  # freed by its finalizer, drained by the next call

        def policy_pair(n: int = n) -> None:
            alloc.free(alloc.malloc(n, stream=s.handle))

        fns["graphpool alloc+free"] = gp_pair
        fns["graphpool alloc+free, current stream"] = gp_pair_current
        fns["graphpool alloc+drop"] = gp_collect
        fns["policy malloc+free"] = policy_pair
        if cupy_pool is not None:

            def cupy_pair(n: int = n, pool: Any = cupy_pool) -> None:
                p = pool.malloc(n)
                del p

            fns[CUPY_POOL] = cupy_pair
        runs = timed_runs(fns, number, repeat)
        med = {k: statistics.median(v) for k, v in runs.items()}
        best = {k: min(v) for k, v in runs.items()}  # the least disturbed run of each
        row: dict[str, Any] = {k: v * 1e6 for k, v in med.items()}
        if cupy_pool is not None:
            for key in ("alloc+free", "alloc+free, current stream", "alloc+drop"):
                for name, stat in (("", med), (" (min)", best)):
                    ratio = stat[f"graphpool {key}"] / stat[CUPY_POOL]
                    row[f"ratio {key} / cupy{name}"] = ratio  # the key the GPU scripts read
                    row[f"graphpool/cupy time, {key}{name}"] = ratio
        results[str(n)] = row
    return results


def bench_mixed_sizes(number: int, repeat: int, skipped: Skipped | None = None) -> dict[str, Any]:
    """Pairs whose sizes cycle through small and large requests (MIXED_SIZES), interleaved
    with the same measurement for CuPy's MemoryPool."""
    skipped = [] if skipped is None else skipped
    note_progress("malloc+free pair, mixed sizes")
    s = gp.current_stream()
    alloc = runtime.allocator()
    cupy_pool = new_cupy_pool(skipped, "mixed-size pair vs CuPy MemoryPool")
    fns: dict[str, Callable[[], None]] = {}
    gp_sizes = itertools.cycle(MIXED_SIZES)
    policy_sizes = itertools.cycle(MIXED_SIZES)

    def gp_pair() -> None:
        gp.alloc(next(gp_sizes), s).free()

    def policy_pair() -> None:
        alloc.free(alloc.malloc(next(policy_sizes), stream=s.handle))

    fns["graphpool alloc+free"] = gp_pair
    fns["policy malloc+free"] = policy_pair
    if cupy_pool is not None:
        cupy_sizes = itertools.cycle(MIXED_SIZES)

        def cupy_pair(pool: Any = cupy_pool) -> None:
            p = pool.malloc(next(cupy_sizes))
            del p

        fns[CUPY_POOL] = cupy_pair
    # a multiple of the cycle, so every run sees each size equally often
    n = max(len(MIXED_SIZES), number - number % len(MIXED_SIZES))
    runs = timed_runs(fns, n, repeat)
    med = {k: statistics.median(v) for k, v in runs.items()}
    best = {k: min(v) for k, v in runs.items()}
    out: dict[str, Any] = {"sizes": list(MIXED_SIZES)}
    out.update({f"{k} (us)": v * 1e6 for k, v in med.items()})
    if cupy_pool is not None:
        out["graphpool/cupy time, alloc+free"] = med["graphpool alloc+free"] / med[CUPY_POOL]
        out["graphpool/cupy time, alloc+free (min)"] = best["graphpool alloc+free"] / best[CUPY_POOL]
    return out


def bench_routing(number: int, repeat: int) -> dict[str, Any]:
    """A cached pair with no capture underway, and (in the same rounds, alternating) the same
    pair while another stream captures, and on the capturing stream itself.

    Each round: the no-capture pair on a worker thread; then a capture begins, the same pair
    runs on a worker thread on the eager stream and on the capturing stream, and the capture
    ends. The conditions thus alternate round by round instead of one running before the other.
    """
    note_progress("routing (pair with and without a capture underway)")
    n = 4096
    eager = gp.Stream()
    cap = gp.Stream()
    dev = runtime.get().device(eager.device)

    def pair_on(st: gp.Stream) -> Callable[[], None]:
        def fn() -> None:
            gp.alloc(n, st).free()

        return fn

    def in_thread(fn: Callable[[], None], count: int) -> float:
        got: list[float] = []
        err: list[BaseException] = []

        def body() -> None:
            try:
                got.extend(per_call(fn, count, 1))
            except BaseException as exc:  # re-raised below
                err.append(exc)

        t = threading.Thread(target=body)
        t.start()
        t.join()
        if err:
            raise err[0]
        return got[0]

    names = ("no capture", "capture on another stream", "on the capturing stream")
    runs: dict[str, list[float]] = {k: [] for k in names}
    for r in range(repeat + 1):  # round 0 warms up and is dropped
        count = max(1, number // 10) if r == 0 else number
        base = in_thread(pair_on(eager), count)
        g = gp.CUDAGraph()
        with gp.stream(cap):
            g.capture_begin(capture_error_mode="relaxed")
            warm = gp.alloc(n, cap)  # the private pool's first segment
            warm.free()
            other = in_thread(pair_on(eager), count)
            own = per_call(pair_on(cap), count, 1)[0]
            buf = gp.alloc(n, cap)
            dev.memset(buf.ptr, 0, n, cap.handle)
            g.capture_end()
        del buf
        g.reset()
        if r:
            for k, v in zip(names, (base, other, own), strict=True):
                runs[k].append(v)
    med = {k: statistics.median(v) for k, v in runs.items()}
    out: dict[str, Any] = {"no capture (us)": med["no capture"] * 1e6}
    for k in names[1:]:
        out[f"{k} (us)"] = med[k] * 1e6
        out[f"ratio {k} / no capture"] = med[k] / med["no capture"]  # the key the GPU scripts read
        out[f"{k}/no capture time"] = med[k] / med["no capture"]
    out["rounds"] = repeat
    return out


def _raw_launch(dev: Any, exe: int, stream: gp.Stream) -> tuple[str, Callable[[], None]]:
    """The launch underneath CUDAGraph.replay, without graphpool: cudaGraphLaunch through
    cuda.bindings on a GPU, the simulated device's own launch on the simulator."""
    if gp.backend() == "cuda":
        # cuda.bindings' runtime module as device/cuda.py loaded it (the one module that
        # imports the bindings); the call itself is the bare binding, no graphpool wrapper.
        from graphpool.device import cuda as gcuda

        launch = gcuda._load().cudaGraphLaunch
        handle = gcuda._stream(stream.handle)

        def raw() -> None:
            launch(exe, handle)

        return "cudaGraphLaunch through cuda.bindings (no graphpool)", raw

    def sim_raw() -> None:
        dev.launch(exe, stream.handle)

    return "the simulated device's own launch (no graphpool)", sim_raw


def bench_replay(number: int, repeat: int) -> dict[str, Any]:
    """Replay cost: gp.CUDAGraph.replay() with the replay checker off and on, against the raw
    launch of the same executable graph; the stream is synchronized between timed runs."""
    note_progress("graph replay vs raw launch")
    s = gp.Stream()
    dev = runtime.get().device(s.device)
    buf = gp.alloc(1 << 16, s)
    g = gp.CUDAGraph()
    with gp.stream(s):
        g.capture_begin()
        dev.memset(buf.ptr, 1, buf.nbytes, s.handle)
        g.capture_end()
    exe = g._exec
    assert exe is not None
    raw_name, raw = _raw_launch(dev, exe, s)
    mode = gp.replay_checks()

    def replay() -> None:
        g.replay()

    def bare() -> None:  # graphpool's device wrapper (the old baseline)
        dev.launch(exe, s.handle)

    # (name, checker mode set untimed before each run, fn). Launches queue work: runs are
    # kept short enough that the queue never fills, and drained between runs so one run's
    # work never slows the next.
    calls = max(1, min(number, 500))
    cases: list[tuple[str, str, Callable[[], None]]] = [
        ("CUDAGraph.replay, checker off", "off", replay),
        ("CUDAGraph.replay, checker on", "raise", replay),
        ("bare launch", "off", bare),
        (raw_name, "off", raw),
    ]
    runs: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    try:
        with gp.stream(s):
            for r in range(repeat + 1):  # round 0 warms up and is dropped
                for name, checks, fn in cases:
                    gp.set_replay_checks(checks)
                    s.synchronize()
                    t = per_call(fn, max(1, calls // 10) if r == 0 else calls, 1)[0]
                    if r:
                        runs[name].append(t)
            s.synchronize()
    finally:
        gp.set_replay_checks(mode)
    med = {k: statistics.median(v) for k, v in runs.items()}
    out: dict[str, Any] = {  # the first three keys: the GPU scripts read them
        "CUDAGraph.replay (us)": med["CUDAGraph.replay, checker off"] * 1e6,
        "bare launch (us)": med["bare launch"] * 1e6,
        "ratio replay / bare launch": med["CUDAGraph.replay, checker off"] / med["bare launch"],
    }
    out["CUDAGraph.replay, checker off (us)"] = med["CUDAGraph.replay, checker off"] * 1e6
    out["CUDAGraph.replay, checker on (us)"] = med["CUDAGraph.replay, checker on"] * 1e6
    out["raw launch (us)"] = med[raw_name] * 1e6
    out["raw launch is"] = raw_name
    out["replay (checker off)/raw launch time"] = med["CUDAGraph.replay, checker off"] / med[raw_name]
    out["replay (checker on)/raw launch time"] = med["CUDAGraph.replay, checker on"] / med[raw_name]
    out["calls per run"] = calls
    buf.free()
    g.reset()
    return out


def bench_cupy_graph_vs_eager(repeat: int) -> dict[str, Any]:
    """CUDA's gain, not graphpool's: 200 small CuPy kernels launched eagerly vs one replay of a
    graph of them (device time by wall clock + sync)."""
    note_progress("CUDA graph vs eager kernels (CuPy)")
    import cupy

    import graphpool.cupy as gcupy

    gcupy.install()
    s = gp.Stream()
    with gp.stream(s):
        x = cupy.ones(1024, dtype=cupy.float32)

        def work() -> Any:
            y = x
            for _ in range(200):
                y = y + 1
            return y

        work()
        s.synchronize()
        g = gp.CUDAGraph()
        with gp.graph(g, stream=s):
            out = work()

        def eager() -> None:
            work()
            s.synchronize()

        def replay() -> None:
            g.replay()
            s.synchronize()

        med = interleaved({"eager": eager, "graph replay": replay}, 20, repeat)
        ok = float(out[0].item()) == 201.0
    return {
        "eager 200 kernels (us)": med["eager"] * 1e6,
        "graph replay (us)": med["graph replay"] * 1e6,
        "speedup": med["eager"] / med["graph replay"],  # the GPU scripts' key
        "CUDA's graph speedup (eager/replay time)": med["eager"] / med["graph replay"],
        "replay result correct": ok,
    }


def bench_cupy_hazard() -> dict[str, Any]:
    """The CuPy hazard through CuPy's own capture API (``Stream.begin_capture``), the same
    program on CuPy's pool and then with graphpool installed as CuPy's allocator."""
    note_progress("the CuPy capture hazard")
    import cupy

    import graphpool.cupy as gcupy

    n = 1 << 20

    def program() -> tuple[int, bool]:
        st = cupy.cuda.Stream(non_blocking=True)
        with st:
            a = cupy.ones(n, dtype=cupy.float32)
            (a * 2 + 1).sum()  # kernels compiled before the capture
            st.synchronize()
            st.begin_capture()
            t = a * 2
            res = t + 1
            del t
            graph = st.end_capture()
            y = cupy.full(n, 7, dtype=cupy.float32)  # eager, same stream, after the capture
            st.synchronize()
            graph.launch(st)
            st.synchronize()
            return int((y != 7).sum().item()), bool((res == 3).all().item())

    out: dict[str, Any] = {}
    gcupy.uninstall()
    cupy.cuda.set_allocator(cupy.cuda.MemoryPool().malloc)
    try:
        wrong, _ = program()
    finally:
        cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)
    out["cupy pool: elements of y overwritten by one replay"] = wrong
    gcupy.install()
    wrong, ok = program()
    out["graphpool: elements of y overwritten by one replay"] = wrong
    out["graphpool: graph output correct"] = ok
    out["elements"] = n
    out["capture API, both sides"] = "cupy.cuda.Stream.begin_capture"
    return out


@dataclasses.dataclass(frozen=True)
class Plan:
    """What every section is given: calls per timed run, rounds, quick mode, and the list
    of comparisons skipped (a section adds the ones it cannot run, with the reason)."""

    number: int
    repeat: int
    quick: bool
    skipped: Skipped


Rows = list[tuple[str, str, str]]
"""Table rows: (label, figure, unit)."""


@dataclasses.dataclass(frozen=True)
class Section:
    """One section of the bench: its key in the JSON, its title in the table, how to run it
    (None: it did not run, and said why in ``plan.skipped``) and, where its figures are not
    one flat mapping of label to value, how to lay them out as rows."""

    key: str
    title: str
    run: Callable[[Plan], dict[str, Any] | None]
    rows: Callable[[dict[str, Any]], Rows] | None = None


def _flat_rows(data: dict[str, Any]) -> Rows:
    return [(label_of(k), *fmt_value(k, v)) for k, v in data.items() if shown(k)]


def _pair_rows(data: dict[str, Any]) -> Rows:
    """The pair section's rows, per size; its plain keys are times in microseconds."""
    rows: Rows = []
    for size, row in data.items():
        for k, v in row.items():
            if shown(k):
                key = k if "/" in k else k + " (us)"
                rows.append((f"{fmt_size(int(size))}: {label_of(k)}", *fmt_value(key, v)))
    return rows


_CUPY_COMPARISONS = ("CUDA graph vs eager kernels (CuPy)", "the CuPy capture hazard")


def _cupy_here(plan: Plan, what: str) -> bool:
    """Whether a CuPy comparison can run (the cuda backend, CuPy installed); if not, noted."""
    if gp.backend() != "cuda":
        skip(plan.skipped, what, "needs the cuda backend and CuPy (this is the simulator)")
        return False
    try:
        import cupy  # noqa: F401
    except ImportError:
        skip(plan.skipped, what, "cupy not installed")
        return False
    return True


SECTIONS: list[Section] = [
    Section(
        "malloc_free_pair_us",
        "cached malloc+free pair, one size",
        lambda p: bench_malloc_free(p.number, p.repeat, p.skipped),
        _pair_rows,
    ),
    Section(
        "malloc_free_mixed_us",
        "cached malloc+free pair, mixed sizes (cycling)",
        lambda p: bench_mixed_sizes(p.number, p.repeat, p.skipped),
    ),
    Section(
        "routing",
        "pair while a capture is underway (rounds alternate with the no-capture pair)",
        lambda p: bench_routing(p.number, p.repeat),
    ),
    Section(
        "replay",
        "graph replay vs raw launch (synchronized between runs)",
        lambda p: bench_replay(p.number, p.repeat),
    ),
    Section(
        "cupy_graph_vs_eager",
        "CUDA's graph speedup (CuPy kernels; CUDA's gain, not graphpool's)",
        lambda p: bench_cupy_graph_vs_eager(p.repeat) if _cupy_here(p, _CUPY_COMPARISONS[0]) else None,
    ),
    Section(
        "cupy_hazard",
        "the CuPy capture hazard",
        lambda p: bench_cupy_hazard() if _cupy_here(p, _CUPY_COMPARISONS[1]) else None,
    ),
    Section(
        "traces",
        "allocation traces: us per operation, warm and cold; peak reserved",
        lambda p: bench_traces(p.repeat, p.quick, p.skipped),
        trace_rows,
    ),
    Section(
        "frameworks",
        "frameworks: per array/tensor/replay, medians over worker processes (frameworks_bench)",
        lambda p: _frameworks(p),
    ),
]
"""The sections, in the order they run and print. A new section is one entry here."""


def _frameworks(plan: Plan) -> dict[str, Any] | None:
    """Each framework's own pool against graphpool, in worker processes (cuda backend only)."""
    if gp.backend() != "cuda":
        why = "needs the cuda backend (this is the simulator)"
        skip(plan.skipped, "frameworks: CuPy, PyTorch, Numba, cuda.core, replay", why)
        return None
    from graphpool.tools import frameworks_bench

    note_progress("frameworks (graphpool.tools.frameworks_bench)")
    return frameworks_bench.section(plan.quick, plan.skipped)


def table(results: dict[str, Any]) -> str:
    """The results as a readable table: sections, labels, rounded figures with units."""
    lines = [
        f"graphpool bench: backend {results['backend']} ({results['device']}), "
        f"{'compiled' if results['compiled'] else 'plain Python'}, "
        f"{results['meta']['number']} calls x {results['meta']['repeat']} rounds"
        + (" (quick)" if results["meta"]["quick"] else ""),
        "ratios: A/B time is A's time divided by B's (above 1: A is slower)",
    ]
    rows: Rows = []
    for section in SECTIONS:
        data = results.get(section.key)
        if not isinstance(data, dict):
            continue
        rows.append(("", "", ""))
        rows.append((f"== {section.title}", "", ""))
        rows.extend((section.rows or _flat_rows)(data))
    figures = [r for r in rows if r[1] and not r[0].startswith("==")]
    width = max(len(r[0]) for r in figures)
    vwidth = max(len(r[1]) for r in figures if r[2])
    for label, value, unit in rows:
        if label.startswith("==") or not value:
            lines.append(label)
        elif not unit and not value[:1].isdigit():  # text: left-aligned
            lines.append(f"  {label.ljust(width)}  {value}")
        else:
            lines.append(f"  {label.ljust(width)}  {value.rjust(vwidth)} {unit}".rstrip())
    skipped = results.get("skipped") or []
    lines += ["", f"== comparisons skipped ({len(skipped)})"]
    lines += [f"  {s['comparison']}: {s['why']}" for s in skipped] or ["  none"]
    return "\n".join(lines)


def run(
    backend: str | None = None,
    quick: bool = False,
    json_path: str | None = None,
    *,
    as_json: bool = False,
    progress: bool = True,
) -> int:
    """Run the benchmarks for this backend; print a table (or, ``as_json``, the JSON).

    ``json_path``: also write the JSON there; checked first (OSError before anything runs if
    it cannot be written).
    """
    if json_path:
        writable_file(json_path, "bench --json")
    start_progress(progress)
    if backend is not None:
        gp.set_backend(backend)
    number, repeat = (1000, 3) if quick else (20000, 15)
    plan = Plan(number, repeat, quick, [])
    results: dict[str, Any] = {
        "backend": gp.backend(),
        "device": runtime.get().device(0).name,
        "compiled": gp.compiled(),
        "meta": {"number": number, "repeat": repeat, "quick": quick},
    }
    gc.collect()
    gc.disable()  # keep collector pauses out of the per-call times
    try:
        for section in SECTIONS:
            data = section.run(plan)
            if data is not None:
                results[section.key] = data
    finally:
        gc.enable()
    results["skipped"] = plan.skipped
    note_progress("done")
    text = json.dumps(results, indent=2, default=str)
    print(text if as_json else table(results))
    if json_path:
        try:
            with open(json_path, "w") as fh:
                fh.write(text + "\n")
        except OSError as exc:
            raise OSError(f"bench --json {json_path}: cannot write there ({exc.strerror or exc})") from None
    return 0


def writable_file(path: str, option: str) -> None:
    """Check that the file ``path`` can be written (it is left as it was); OSError naming
    ``option`` and the path otherwise."""
    existed = os.path.exists(path)
    try:
        if os.path.isdir(path):
            raise IsADirectoryError(errno.EISDIR, "a folder, not a file")
        with open(path, "a"):
            pass
        if not existed:
            os.remove(path)
    except OSError as exc:
        raise OSError(f"{option} {path}: cannot write there ({exc.strerror or exc})") from None
