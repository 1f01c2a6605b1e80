"""What a framework user pays per array, tensor or replay with graphpool, against the
framework's own pool: ``python -m graphpool.tools.frameworks_bench`` (GPU only).

Each measurement runs in fresh worker processes, one allocator ("side") per process, the
sides taking turns process by process, their order rotated each round (A, B, C, then B, C,
A, then C, A, B, ...): PyTorch and Numba take their allocator once per process, and
interleaved processes share the host's drift. Every
side reports the per-call time of several timed runs; the table gives the minimum and the
median over all of a side's runs, and each graphpool side's ratio to the framework's own
pool (its time divided by the pool's: above 1, graphpool is slower).

Cases (each skipped, and listed as skipped, where its framework is missing):

* ``cupy``: ``cupy.empty(n, uint8)`` made and dropped at 512 B to 64 MiB, on CuPy's default
  stream and on a non-blocking stream; CuPy's ``MemoryPool``, graphpool, RAPIDS RMM's pool;
  and two small programs end to end (an MLP training step and an FFT filter pipeline).
* ``torch``: ``torch.empty(1024, device="cuda")`` made and dropped, default and side stream;
  PyTorch's caching allocator, graphpool (``graphpool.torch``), RMM's pool; and two programs
  (a small transformer's training step, an MLP's training step).
* ``replay``: ``CUDAGraph.replay()`` with the checker off and on (a graph alone in its pool,
  and one whose pool is shared with a second graph) against a raw ``cudaGraphLaunch`` of the
  same executable through cuda.bindings, in one process.
* ``numba``: ``numba.cuda.device_array(4096, uint8)`` made and dropped: Numba's own memory
  manager and graphpool's EMM plugin.
* ``cuda_core``: ``allocate(4096, stream)`` and ``close(stream)``: cuda.core's
  ``DeviceMemoryResource`` and ``GraphpoolMemoryResource``.

Processes come in two modes: on the H100 hosts measured, every allocator's worker processes
(the framework's own too) ran either near their side's fastest or 1.6-2.0x slower, for the
whole process, and how many of a side's processes land slow is a draw that moves its median.
So each row (a program's aside) also gives, per side, how many processes ran slow (above
``MODE_CUT`` times the side's fastest: ``modes``) and, with ``MODE_MIN_PROCESSES`` or more
processes a side, the ratio of the fast modes' medians to the framework's own, beside the
min and median. It is an estimate: the cut is anchored on the side's fastest process.

``--tree NAME=PATH`` (repeatable) measures the graphpool found at PATH (a ``src`` folder)
as side ``graphpool[NAME]``, to compare two versions of graphpool in one run. The workers
run this file by its path, so an older graphpool without this module can be measured.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, Final, NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
CUPY_SIZES = (512, 4096, 64 << 10, 1 << 20, 64 << 20)
CASES = ("cupy", "torch", "replay", "numba", "cuda_core")
NATIVE = {"cupy": "cupy", "torch": "torch", "numba": "numba", "cuda_core": "cuda.core", "replay": ""}
"""Each case's side without graphpool (the framework's own pool); replay compares in-process."""
EXTRA = {"cupy": ("rmm",), "torch": ("rmm",)}
"""Further sides that need no graphpool: RAPIDS RMM's pool, where rmm is installed."""
REQUIRES = {
    "cupy": "cupy",
    "torch": "torch",
    "numba": "numba",
    "cuda_core": "cuda.core",
    "replay": "cuda.bindings",
}
MODE_CUT: Final = 1.4
"""A process slower than this many times its side's fastest process is in the slow mode."""
MODE_MIN_PROCESSES: Final = 4
"""Fewer processes a side give no fast-mode ratio: with two, both may have drawn the slow
mode, and the split cannot tell."""


class Modes(NamedTuple):
    """One side's per-process times on one row, split at ``cut`` times the fastest. (A tuple,
    not a dataclass: this file is also loaded by its path, outside ``sys.modules``.)"""

    slow: int
    processes: int
    fast_median: float
    slow_median: float | None


def modes(times: list[float], cut: float = MODE_CUT) -> Modes:
    """The fast and the slow mode of one side's per-process times (see the module's text)."""
    if not times:
        raise ValueError("no processes")
    if cut <= 1.0:
        raise ValueError(f"cut must be above 1 (got {cut})")
    low = min(times)
    fast = [t for t in times if t <= cut * low]
    slow = [t for t in times if t > cut * low]
    return Modes(len(slow), len(times), statistics.median(fast), statistics.median(slow) if slow else None)


# ======================================================================== the worker side
def _timed(fn: Callable[[], None], number: int, rounds: int, sync: Callable[[], None]) -> list[float]:
    """Microseconds per call of ``fn`` in each of ``rounds`` runs of ``number`` calls (one
    untimed run first; ``sync`` before each run and inside the timing after it)."""
    out = []
    for r in range(rounds + 1):
        sync()
        n = max(1, number // 10) if r == 0 else number
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        if r:
            out.append((time.perf_counter() - t0) / n * 1e6)
    return out


def _gp_install(side: str) -> Any:
    import graphpool as gp

    gp.set_backend("cuda")
    return gp


def _cupy_worker(side: str, number: int, rounds: int) -> dict[str, list[float]]:
    import cupy

    if side == "cupy":
        cupy.cuda.set_allocator(cupy.cuda.MemoryPool().malloc)
    elif side == "rmm":
        import rmm
        from rmm.allocators.cupy import rmm_cupy_allocator

        rmm.reinitialize(pool_allocator=True, initial_pool_size=1 << 30)
        cupy.cuda.set_allocator(rmm_cupy_allocator)
    else:
        _gp_install(side)
        import graphpool.cupy as gcupy

        if side.startswith("graphpool-hooks"):
            gcupy.use_c_allocator = False  # CuPy's PythonFunctionAllocator over the hooks, for comparison
        gcupy.install()
    sync = cupy.cuda.Device().synchronize
    empty, u8 = cupy.empty, cupy.uint8
    out: dict[str, list[float]] = {}
    streams = {
        "default stream": cupy.cuda.Stream.null,
        "non-blocking stream": cupy.cuda.Stream(non_blocking=True),
    }
    for sname, st in streams.items():
        with st:
            for n in CUPY_SIZES:

                def one(n: int = n) -> None:
                    empty(n, u8)

                out[f"cupy.empty {_size(n)}, {sname}"] = _timed(one, number, rounds, sync)
    for name, prog in _cupy_programs(cupy).items():
        out[name] = _timed(prog, max(5, number // 200), rounds, sync)
    return out


def _cupy_programs(cupy: Any) -> dict[str, Callable[[], None]]:
    """Two small CuPy programs with many short-lived arrays (one step each)."""
    rs = cupy.random.RandomState(0)
    f32 = cupy.float32
    dims = (512, 256, 256, 10)
    ws = [rs.standard_normal((a, b), dtype=f32) * 0.05 for a, b in itertools.pairwise(dims)]
    x = rs.standard_normal((64, 512), dtype=f32)
    y = cupy.eye(10, dtype=f32)[rs.randint(0, 10, 64)]

    def mlp_step() -> None:
        acts = [x]
        for w in ws[:-1]:
            acts.append(cupy.maximum(acts[-1] @ w, 0))
        logits = acts[-1] @ ws[-1]
        p = cupy.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        grad = (p - y) / 64
        for i in range(len(ws) - 1, -1, -1):
            gw = acts[i].T @ grad
            if i:
                grad = (grad @ ws[i].T) * (acts[i] > 0)
            ws[i] -= 0.01 * gw

    sig = rs.standard_normal((64, 4096), dtype=f32)
    filt = cupy.exp(-cupy.arange(2049, dtype=f32) / 300.0)

    def fft_pipeline() -> None:
        spec = cupy.fft.rfft(sig, axis=1)
        spec *= filt
        back = cupy.fft.irfft(spec, n=4096, axis=1)
        env = cupy.abs(back)
        (env / (env.max(axis=1, keepdims=True) + 1e-6)).mean()

    return {"program: CuPy MLP training step": mlp_step, "program: CuPy FFT filter pipeline": fft_pipeline}


def _torch_worker(side: str, number: int, rounds: int) -> dict[str, list[float]]:
    import torch

    if side == "rmm":
        import rmm
        from rmm.allocators.torch import rmm_torch_allocator

        rmm.reinitialize(pool_allocator=True, initial_pool_size=1 << 30)
        torch.cuda.memory.change_current_allocator(rmm_torch_allocator)
    elif side != "torch":
        _gp_install(side)
        import graphpool.torch as gtorch

        gtorch.install()
    sync = torch.cuda.synchronize
    out: dict[str, list[float]] = {}
    side_stream = torch.cuda.Stream()
    for sname, st in (("default stream", None), ("side stream", side_stream)):

        def one() -> None:
            torch.empty(1024, device="cuda")

        if st is None:
            out[f"torch.empty(1024), {sname}"] = _timed(one, number, rounds, sync)
        else:
            with torch.cuda.stream(st):
                out[f"torch.empty(1024), {sname}"] = _timed(one, number, rounds, sync)
    for name, prog in _torch_programs(torch).items():
        out[name] = _timed(prog, max(5, number // 500), rounds, sync)
    return out


def _torch_programs(torch: Any) -> dict[str, Callable[[], None]]:
    """A small transformer's and an MLP's training steps (forward, backward, optimizer)."""
    torch.manual_seed(0)
    nn = torch.nn
    layer = nn.TransformerEncoderLayer(d_model=128, nhead=4, dim_feedforward=256, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).cuda()
    head = nn.Linear(128, 10).cuda()
    opt = torch.optim.AdamW([*model.parameters(), *head.parameters()], lr=1e-3)
    tokens = torch.randn(16, 64, 128, device="cuda")
    labels = torch.randint(0, 10, (16,), device="cuda")

    def transformer_step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(head(model(tokens).mean(dim=1)), labels)
        loss.backward()
        opt.step()

    mlp = nn.Sequential(
        nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    ).cuda()
    sgd = torch.optim.SGD(mlp.parameters(), lr=1e-2, momentum=0.9)
    xb = torch.randn(128, 512, device="cuda")
    yb = torch.randint(0, 10, (128,), device="cuda")

    def mlp_step() -> None:
        sgd.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(mlp(xb), yb).backward()
        sgd.step()

    return {
        "program: PyTorch transformer training step": transformer_step,
        "program: PyTorch MLP training step": mlp_step,
    }


def _replay_worker(side: str, number: int, rounds: int) -> dict[str, list[float]]:
    gp = _gp_install(side)
    from graphpool import runtime
    from graphpool.device import cuda as gcuda

    s = gp.Stream()
    dev = runtime.get().device(s.device)
    buf = gp.alloc(1 << 16, s)
    # g alone in its pool; m0 and m1 share one, as graphs captured one after another do
    g, m0, m1 = gp.CUDAGraph(), gp.CUDAGraph(), gp.CUDAGraph()
    with gp.stream(s):
        for graph, pool in ((g, None), (m0, None), (m1, "m0")):
            graph.capture_begin(m0.pool() if pool else None)
            dev.memset(buf.ptr, 1, buf.nbytes, s.handle)
            graph.capture_end()
        m1.replay()  # m0's mate has replayed: m0's checks look at it
    exe = g._exec
    launch = gcuda._load().cudaGraphLaunch
    handle = gcuda._stream(s.handle)
    calls = max(1, min(number, 500))  # short runs: the launch queue never fills
    cases: tuple[tuple[str, str, Callable[[], None]], ...] = (
        ("raw cudaGraphLaunch", "off", lambda: launch(exe, handle)),
        ("replay, checker off", "off", g.replay),
        ("replay, checker on", "raise", g.replay),
        ("replay, checker on, pool shared with a graph", "raise", m0.replay),
    )
    out: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    with gp.stream(s):
        for _ in range(rounds):  # interleaved, round by round
            for name, mode, fn in cases:
                gp.set_replay_checks(mode)
                out[name] += _timed(fn, calls, 3, s.synchronize)
        gp.set_replay_checks("off")
    buf.free()
    for graph in (g, m0, m1):
        graph.reset()
    return out


def _numba_worker(side: str, number: int, rounds: int) -> dict[str, list[float]]:
    if side != "numba":
        os.environ["NUMBA_CUDA_MEMORY_MANAGER"] = "graphpool.numba"
        _gp_install(side)
    import numpy as np
    from numba import cuda

    cuda.current_context()
    sync = cuda.synchronize

    def one() -> None:
        cuda.device_array(4096, dtype=np.uint8)

    return {"numba.cuda.device_array(4096, uint8)": _timed(one, number, rounds, sync)}


def _cuda_core_worker(side: str, number: int, rounds: int) -> dict[str, list[float]]:
    try:
        import cuda.core as cc

        cc.Device  # noqa: B018 (cuda.core 1.x; 0.x has it under cuda.core.experimental)
    except (ImportError, AttributeError):
        import cuda.core.experimental as cc

    dev = cc.Device(0)
    dev.set_current()
    stream = dev.create_stream()
    if side == "cuda.core":
        mr = cc.DeviceMemoryResource(0)
    else:
        _gp_install(side)
        import graphpool.cuda_core as gcc

        mr = gcc.GraphpoolMemoryResource(0)

    def one() -> None:
        mr.allocate(4096, stream=stream).close(stream)

    return {"allocate(4096, stream) + close(stream)": _timed(one, number, rounds, stream.sync)}


WORKERS: dict[str, Callable[[str, int, int], dict[str, list[float]]]] = {
    "cupy": _cupy_worker,
    "torch": _torch_worker,
    "replay": _replay_worker,
    "numba": _numba_worker,
    "cuda_core": _cuda_core_worker,
}


def _size(n: int) -> str:
    for unit, k in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << k and n % (1 << k) == 0:
            return f"{n >> k} {unit}"
    return f"{n} B"


# ======================================================================== the parent side
def available(module: str) -> str | None:
    """None when ``module`` can be found, else why not."""
    import importlib.util

    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    return None if found else f"{module} not installed"


WORKER_PREFIX: list[str] = []
"""What the worker command is run under (``--no-aslr``: ``setarch <machine> -R``)."""


def no_aslr_prefix() -> list[str]:
    """``setarch <machine> -R``: the worker runs with address-space randomization off, so every
    process of a side gets the same memory layout. Runs 15-16 saw one side's processes split
    between two speeds while the other side's did not; with the layout fixed, a split that
    remains is not the layout's. Empty (with a note) where ``setarch`` is missing."""
    exe = shutil.which("setarch")
    if exe is None:
        print("frameworks_bench: no setarch here; --no-aslr ignored", file=sys.stderr)
        return []
    return [exe, platform.machine(), "-R"]


def _spawn(case: str, side: str, src: str, number: int, rounds: int, timeout: float) -> dict[str, Any]:
    """One worker process: ``case`` with allocator ``side``, graphpool from ``src``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    cmd = [
        *WORKER_PREFIX,
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        case,
        side,
        str(number),
        str(rounds),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:300]}
    return dict(json.loads(lines[-1]))


def _order(sides: list[tuple[str, str, str]], p: int) -> list[tuple[str, str, str]]:
    """The order the sides run in for process round ``p``: rotated by ``p``, so that over as
    many rounds as there are sides each side runs once in each slot (run 14 saw one machine's
    times move up to 2x between calls: a side always run in the middle slot would carry a
    slot's drift into its ratio)."""
    k = p % len(sides) if sides else 0
    return sides[k:] + sides[:k]


def compare(
    case: str,
    trees: dict[str, str],
    processes: int = 2,
    number: int = 2000,
    rounds: int = 5,
    timeout: float = 240.0,
    skipped: list[dict[str, str]] | None = None,
) -> dict[str, Any]:
    """Run ``case`` for every side, the sides' order rotating process by process (``_order``:
    give as many processes as sides, or a multiple, for each side to take each slot); min and
    median per side and measurement, and each side's ratio to the framework's own pool."""
    first = next(iter(trees.values()))
    sides: list[tuple[str, str, str]] = []  # (label, worker side, graphpool src)
    if NATIVE[case]:
        sides.append((NATIVE[case], NATIVE[case], first))
    for extra in EXTRA.get(case, ()):
        why = available(extra)
        if why is None:
            sides.append((extra, extra, first))
        elif skipped is not None:
            skipped.append({"comparison": f"{case}: {extra} side", "why": why})
    for name, src in trees.items():
        label = "graphpool" if len(trees) == 1 else f"graphpool[{name}]"
        sides.append((label, "graphpool", src))
        if case == "cupy" and name == next(iter(trees)):
            sides.append((label.replace("graphpool", "graphpool-hooks"), "graphpool-hooks", src))
    runs: dict[str, dict[str, list[float]]] = {label: {} for label, _, _ in sides}
    per_process: dict[str, dict[str, list[float]]] = {label: {} for label, _, _ in sides}
    errors: dict[str, str] = {}
    for p in range(processes):
        for label, side, src in _order(sides, p):
            got = _spawn(case, side, src, number, rounds, timeout)
            if "error" in got:
                errors[label] = str(got["error"])
                continue
            for k, v in got.items():
                runs[label].setdefault(k, []).extend(v)
                per_process[label].setdefault(k, []).append(statistics.median(v))
    out: dict[str, Any] = {"sides": [s[0] for s in sides], "processes": processes, "errors": errors}
    # Each process's median, in the order the processes ran: a side whose processes split
    # between two levels (run 16) shows here, where its min and median hide how.
    out["per_process"] = per_process
    native = NATIVE[case] or None
    rows: dict[str, dict[str, Any]] = {}
    for label, measures in runs.items():
        for k, v in measures.items():
            row = rows.setdefault(k, {})
            row[f"{label} min (us)"] = min(v)
            row[f"{label} median (us)"] = statistics.median(v)
    for k, row in rows.items():
        base_label = native if native and f"{native} median (us)" in row else None
        split: dict[str, Modes] = {}
        if processes > 1 and not k.startswith("program"):  # (a program's processes show no two clean modes)
            split = {lb: modes(per_process[lb][k]) for lb in runs if k in per_process[lb]}
            for lb, m in split.items():
                row[f"{lb} slow processes"] = [m.slow, m.processes]
        if case == "replay":
            for label in runs:
                if f"{label} median (us)" in row and k != "raw cudaGraphLaunch":
                    raw = rows["raw cudaGraphLaunch"].get(f"{label} median (us)")
                    if raw:
                        row[f"{label} / raw launch (median)"] = row[f"{label} median (us)"] / raw
                        row[f"{label} / raw launch (min)"] = (
                            row[f"{label} min (us)"] / rows["raw cudaGraphLaunch"][f"{label} min (us)"]
                        )
            continue
        if base_label is None:
            continue
        for label in runs:
            if label != base_label and f"{label} median (us)" in row:
                row[f"{label}/{base_label} (median)"] = (
                    row[f"{label} median (us)"] / row[f"{base_label} median (us)"]
                )
                row[f"{label}/{base_label} (min)"] = row[f"{label} min (us)"] / row[f"{base_label} min (us)"]
        if processes >= MODE_MIN_PROCESSES and base_label in split:
            for lb, m in split.items():
                if lb != base_label:
                    row[f"{lb}/{base_label} (fast mode)"] = m.fast_median / split[base_label].fast_median
    out["rows"] = rows
    return out


def run_all(
    cases: tuple[str, ...] = CASES,
    trees: dict[str, str] | None = None,
    processes: int = 2,
    number: int = 2000,
    rounds: int = 5,
    quick: bool = False,
) -> dict[str, Any]:
    """Every case whose framework is installed; the others listed under "skipped"."""
    if trees is None:
        import graphpool

        trees = {"": os.path.dirname(os.path.dirname(os.path.abspath(graphpool.__file__)))}
    if quick:
        processes, number, rounds = 1, 200, 2
    skipped: list[dict[str, str]] = []
    results: dict[str, Any] = {}
    from graphpool.device.cuda import unavailable_reason

    gpu = unavailable_reason()
    for case in cases:
        why = available(REQUIRES[case]) or (gpu and f"no usable GPU ({gpu})")
        if why is not None:
            skipped.append({"comparison": f"frameworks: {case}", "why": why})
            continue
        print(f"[frameworks] {case}", file=sys.stderr, flush=True)
        results[case] = compare(case, trees, processes, number, rounds, skipped=skipped)
    results["skipped"] = skipped
    return results


def section(quick: bool, skipped: list[dict[str, str]]) -> dict[str, Any]:
    """The "frameworks" section of ``python -m graphpool bench``: flat rows (``median``
    times and ratios) for its table, the skipped comparisons added to ``skipped``."""
    res = run_all(quick=quick)
    skipped.extend(res.pop("skipped"))
    flat: dict[str, Any] = {}
    for case, data in res.items():
        for label, err in data["errors"].items():
            skipped.append({"comparison": f"frameworks: {case}, {label}", "why": err})
        for k, row in data["rows"].items():
            for col, v in row.items():
                if "median" in col:
                    flat[f"{k}: {col.replace(' median', '')}"] = v
    return flat


def table(results: dict[str, Any]) -> str:
    """A readable table: per case, each measurement's sides (min / median us) and ratios."""
    lines = []
    for case, data in results.items():
        if case == "skipped":
            continue
        lines.append(f"== {case}: sides {', '.join(data['sides'])}; {data['processes']} processes per side")
        for label, err in data["errors"].items():
            lines.append(f"  {label}: FAILED: {err}")
        for k, row in data["rows"].items():
            lines.append(f"  {k}")
            for label in data["sides"]:
                if f"{label} median (us)" in row:
                    lo, mid = row[f"{label} min (us)"], row[f"{label} median (us)"]
                    lines.append(f"    {label:<28} min {lo:9.3f} us   median {mid:9.3f} us")
                    each = data.get("per_process", {}).get(label, {}).get(k, [])
                    if len(each) > 1:
                        slow = row.get(f"{label} slow processes")
                        mode = f" (slow mode: {slow[0]} of {slow[1]})" if slow else ""
                        lines.append(f"    {'':<28} each process: {' '.join(f'{x:.3g}' for x in each)}{mode}")
            for col, v in row.items():
                if "(us)" not in col and not col.endswith("slow processes"):
                    lines.append(f"    {col:<56} {v:6.2f}x")
    lines.append("== skipped")
    lines += [f"  {s['comparison']}: {s['why']}" for s in results.get("skipped", [])] or ["  none"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--worker"]:
        case, side, number, rounds = args[1], args[2], int(args[3]), int(args[4])
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]  # run by path
        gc.collect()
        gc.disable()  # collector pauses out of the per-call times (as graphpool bench)
        print(json.dumps(WORKERS[case](side, number, rounds)))
        return 0
    ap = argparse.ArgumentParser(prog="frameworks_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", action="append", choices=CASES, help="run only these cases")
    ap.add_argument("--tree", action="append", default=[], help="NAME=PATH: measure the graphpool at PATH")
    ap.add_argument(
        "--processes", type=int, default=2, help="worker processes per side (the sides' order rotates)"
    )
    ap.add_argument("--number", type=int, default=2000, help="calls per timed run")
    ap.add_argument("--rounds", type=int, default=5, help="timed runs per process")
    ap.add_argument("--json", help="also write the results there")
    ap.add_argument(
        "--no-aslr", action="store_true", help="run the workers with address-space randomization off"
    )
    ns = ap.parse_args(args)
    if ns.no_aslr:
        WORKER_PREFIX[:] = no_aslr_prefix()
    trees = dict(t.split("=", 1) for t in ns.tree) or None
    res = run_all(tuple(ns.case or CASES), trees, ns.processes, ns.number, ns.rounds)
    print(table(res))
    if ns.json:
        with open(ns.json, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
