"""A CuPy-backed dask.array workload on one GPU, three ways: CuPy's pool, RMM's pool, graphpool.

    python benchmarks/dask_gpu.py [--workers K] [--workloads matmul,fft] [--n 16384]
        [--chunk 2048] [--repeat 5] [--modes cupy,rmm,graphpool] [--rmm-pool-size 0.8]
        [--memory-fraction F] [--json FILE] [--dry-run]

Each mode gets a fresh cluster (fresh worker processes), then runs each workload once cold
and ``--repeat`` times warm:

* ``cupy``: CuPy's default ``MemoryPool`` (no setup);
* ``rmm``: RMM's pool, as Dask-CUDA sets it up (``LocalCUDACluster(rmm_pool_size=...)``), with
  CuPy allocating from RMM (``rmm_cupy_allocator``);
* ``graphpool``: ``client.register_plugin(graphpool.dask.GraphpoolSetup(backend="cuda",
  integrations=("cupy",)))``.

One worker (the default) runs in Dask-CUDA's ``LocalCUDACluster``; ``--workers K`` > 1 puts K
workers on GPU 0 in a ``distributed.LocalCluster`` (Dask-CUDA gives each worker a GPU of its
own), each capped at ``--memory-fraction`` of the device (default 0.9 / K: CuPy's
``set_limit(fraction=...)``, RMM's pool size, graphpool's ``memory_fraction``).

Workloads (float32, seeded, the same values in every mode; the result column lets them be
compared): ``matmul``, ``(x @ x.T).sum()`` blocked by ``--chunk``; ``fft``, row FFTs of x
(row blocks of ``--chunk``), ``abs(...).mean()``.

Per worker, peak reserved / peak allocated bytes over the whole run (cold and warm):
graphpool's ``memory_stats()`` (``reserved_bytes.all.peak``, ``allocated_bytes.all.peak``);
CuPy's pool read after each of its own allocations by a thin allocator around
``MemoryPool.malloc`` (``total_bytes()`` / ``used_bytes()``: they rise only there); RMM's
``rmm.statistics`` (``peak_bytes``) and the pool's ``pool_size()``. Each column says where it
is not available. What cannot run here (no CuPy, Dask-CUDA or RMM; no GPU) is skipped and
named. ``--dry-run`` prints the plan and what would be skipped, and starts nothing;
``--xp numpy`` checks the driver on a machine without a GPU (NumPy blocks, graphpool mode on
its simulator: timings and results only, the peaks are graphpool's and stay 0).

"cold" is the first run in a fresh cluster: it includes one-time costs (CuPy loading its
kernel cache, cuBLAS and cuFFT plans, pools growing); "warm" is the median of the repeats,
the figure to compare between modes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

MODES = ("cupy", "rmm", "graphpool")
WORKLOADS = ("matmul", "fft")
NEEDS = {
    "cupy": ("cupy", "distributed"),
    "rmm": ("cupy", "distributed", "rmm"),
    "graphpool": ("cupy", "distributed"),
}
"""The modules each mode needs (besides dask.array); Dask-CUDA is needed for one worker."""


# --------------------------------------------------------------------------- pure helpers
@dataclass
class Result:
    """One mode and workload: timings, per-worker peaks (address -> bytes, None: unknown)."""

    mode: str
    workload: str
    workers: int
    cluster: str
    cold_s: float | None = None
    warm_s: list[float] = field(default_factory=list)
    peak_reserved: dict[str, int | None] = field(default_factory=dict)
    peak_allocated: dict[str, int | None] = field(default_factory=dict)
    value: float | None = None
    error: str | None = None
    notes: list[str] = field(default_factory=list)
    summary: str | None = None  # graphpool.dask.memory_summary(client) after the mode's runs (JSON only)


def fmt_bytes(n: int | None) -> str:
    """Bytes in GiB/MiB/KiB; "n/a" for None."""
    if n is None:
        return "n/a"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{n} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


def parse_size(text: str) -> float | int:
    """``--rmm-pool-size``: a fraction of the device (0 < f <= 1) or bytes ("20GB", "512MiB", "1e9")."""
    t = text.strip()
    try:
        value = float(t)
    except ValueError:
        pass
    else:
        if 0 < value <= 1:
            return value
        if value > 1:
            return int(value)
        raise ValueError(f"size {text!r}: give a fraction in (0, 1] or a byte count")
    units = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30, "b": 1}
    lower = t.lower()
    for suffix in sorted(units, key=len, reverse=True):
        if lower.endswith(suffix):
            try:
                return int(float(lower[: -len(suffix)]) * units[suffix])
            except ValueError:
                break
    raise ValueError(f"size {text!r}: give a fraction in (0, 1] or bytes such as 20GB")


def plan(
    modes: Sequence[str], workers: int, importable: Callable[[str], bool], xp: str = "cupy"
) -> tuple[list[str], dict[str, str], str]:
    """Which modes run, which are skipped (mode -> why), and the cluster kind ("LocalCUDACluster"
    for one worker, "LocalCluster" for several on GPU 0, or on the CPU with ``xp`` "numpy")."""
    cluster = "LocalCUDACluster" if workers == 1 and xp == "cupy" else "LocalCluster"
    run: list[str] = []
    skipped: dict[str, str] = {}
    for mode in modes:
        if xp == "numpy":
            if mode == "graphpool" and importable("distributed"):
                run.append(mode)
            else:
                skipped[mode] = "the CPU check (--xp numpy) runs graphpool on its simulator only"
            continue
        needs = list(NEEDS[mode]) + ["dask.array"] + (["dask_cuda"] if workers == 1 else [])
        missing = [m for m in needs if not importable(m)]
        if missing:
            skipped[mode] = f"{', '.join(missing)} not importable"
        else:
            run.append(mode)
    return run, skipped, cluster


def format_table(results: Sequence[Result], skipped: dict[str, str]) -> str:
    """One short table: a row per mode and workload; skipped modes and errors below it."""
    header = [
        "mode",
        "workload",
        "workers",
        "cold s",
        "warm s (median)",
        "peak reserved",
        "peak allocated",
        "result",
    ]
    rows = [header]
    for r in results:
        if r.error is not None:
            continue
        addresses = sorted(r.peak_reserved) or sorted(r.peak_allocated)
        rows.append(
            [
                r.mode,
                r.workload,
                str(r.workers),
                "n/a" if r.cold_s is None else f"{r.cold_s:.3f}",
                f"{statistics.median(r.warm_s):.3f}" if r.warm_s else "n/a",
                " | ".join(fmt_bytes(r.peak_reserved.get(a)) for a in addresses) or "n/a",
                " | ".join(fmt_bytes(r.peak_allocated.get(a)) for a in addresses) or "n/a",
                "n/a" if r.value is None else f"{r.value:.6g}",
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "-" * max(len(line) for line in lines))
    for mode, why in skipped.items():
        lines.append(f"skipped {mode}: {why}")
    for r in results:
        if r.error is not None:
            lines.append(f"failed {r.mode} / {r.workload}: {r.error}")
        for note in dict.fromkeys(r.notes):
            lines.append(f"note {r.mode}: {note}")
    lines.append("peaks are per worker (one column entry per worker, ' | ' between), over cold and warm runs")
    return "\n".join(lines)


def values_agree(results: Sequence[Result], rtol: float = 1e-3) -> list[str]:
    """Workloads whose result differs between modes by more than ``rtol`` (they should agree)."""
    out = []
    for w in {r.workload for r in results}:
        vals = [r.value for r in results if r.workload == w and r.value is not None]
        if vals and max(vals) - min(vals) > rtol * max(abs(v) for v in vals):
            out.append(w)
    return sorted(out)


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


# --------------------------------------------------------------------------- in the workers
def _rmm_cupy_allocator() -> Any:
    try:
        from rmm.allocators.cupy import rmm_cupy_allocator
    except ImportError:  # older RMM
        from rmm import rmm_cupy_allocator  # type: ignore[attr-defined,no-redef]
    return rmm_cupy_allocator


def _rmm_pool_size(resource: Any) -> int | None:
    """The pool size of the first pool resource under ``resource`` (RMM adaptors wrap it)."""
    for _ in range(8):
        if resource is None:
            return None
        size = getattr(resource, "pool_size", None)
        if callable(size):
            return int(size())
        nxt = None
        for attr in ("get_upstream", "upstream_mr", "upstream"):
            up = getattr(resource, attr, None)
            nxt = up() if callable(up) else up
            if nxt is not None:
                break
        resource = nxt
    return None


def _worker_setup(
    mode: str, fraction: float | None, pool_size: float | int | None, dask_worker: Any
) -> list[str]:
    """Set the mode's allocator up in this worker (the cluster made it fresh); notes back."""
    notes: list[str] = []
    state: dict[str, Any] = {"mode": mode}
    dask_worker._gp_bench = state
    if mode == "cupy":
        import cupy

        pool = cupy.get_default_memory_pool()
        if fraction is not None:
            pool.set_limit(fraction=fraction)
        peaks = {"reserved": pool.total_bytes(), "allocated": pool.used_bytes()}

        def malloc(nbytes: int) -> Any:
            mem = pool.malloc(nbytes)
            used, held = pool.used_bytes(), pool.total_bytes()
            if used > peaks["allocated"]:
                peaks["allocated"] = used
            if held > peaks["reserved"]:
                peaks["reserved"] = held
            return mem

        cupy.cuda.set_allocator(malloc)
        state["peaks"] = peaks
    elif mode == "rmm":
        import cupy
        import rmm

        total = cupy.cuda.runtime.memGetInfo()[1]
        if pool_size is not None:  # several workers on one GPU: the pool set here, per worker
            size = int(pool_size * total) if isinstance(pool_size, float) else int(pool_size)
            size -= size % 256
            rmm.reinitialize(pool_allocator=True, initial_pool_size=size, maximum_pool_size=size)
        allocator = _rmm_cupy_allocator()
        if cupy.cuda.get_allocator() is not allocator:
            cupy.cuda.set_allocator(allocator)
            notes.append("CuPy's allocator set to rmm_cupy_allocator in each worker")
        try:
            import rmm.statistics

            rmm.statistics.enable_statistics()
            state["rmm_stats"] = True
        except (ImportError, AttributeError) as exc:
            notes.append(f"rmm.statistics unavailable ({exc}): no peak allocated")
            state["rmm_stats"] = False
    elif mode == "graphpool":
        import graphpool as gp

        gp.reset_peak_memory_stats()
    return notes


def _worker_peaks(dask_worker: Any) -> tuple[int | None, int | None, list[str]]:
    """(peak reserved, peak allocated, notes) of this worker's mode since its setup."""
    state = dask_worker._gp_bench
    mode = state["mode"]
    if mode == "cupy":
        peaks = state["peaks"]
        return peaks["reserved"], peaks["allocated"], []
    if mode == "rmm":
        import rmm

        notes = []
        allocated = None
        if state.get("rmm_stats"):
            import rmm.statistics

            stats = rmm.statistics.get_statistics()
            allocated = None if stats is None else int(stats.peak_bytes)
        reserved = _rmm_pool_size(rmm.mr.get_current_device_resource())
        if reserved is None:
            notes.append("RMM pool size not readable from this RMM version")
        return reserved, allocated, notes
    import graphpool as gp

    s = gp.memory_stats()
    return s["reserved_bytes.all.peak"], s["allocated_bytes.all.peak"], []


def _block(seed: int, xp_name: str, block_info: Any = None) -> Any:
    """One float32 block of x, seeded by its place (the same values in every mode)."""
    xp = importlib.import_module(xp_name)
    info = block_info[None]
    loc = info["chunk-location"]
    rs = xp.random.RandomState(seed * 1_000_003 + loc[0] * 1009 + loc[1])
    return rs.random_sample(info["chunk-shape"]).astype(xp.float32)


def _as_float(x: Any) -> float:
    return float(x)


def _workload(name: str, n: int, chunk: int, seed: int = 1, xp_name: str = "cupy") -> Any:
    """The dask graph of workload ``name`` on ``xp_name`` arrays (cupy; numpy in the CPU test):
    a delayed float."""
    import dask
    import dask.array as da

    xp = importlib.import_module(xp_name)
    row_chunks = (chunk,) * (n // chunk) + ((n % chunk,) if n % chunk else ())
    col_chunks = row_chunks if name == "matmul" else (n,)
    x = da.map_blocks(
        _block,
        seed,
        xp_name,
        chunks=(row_chunks, col_chunks),
        dtype="float32",
        meta=xp.empty((0, 0), "float32"),
    )
    expr = (x @ x.T).sum() if name == "matmul" else abs(da.fft.fft(x, axis=1)).mean()
    return dask.delayed(_as_float)(expr)


# --------------------------------------------------------------------------- the driver
def _cluster(mode: str, args: argparse.Namespace, kind: str) -> Any:
    if args.xp == "numpy":  # the CPU check: no GPU to pin
        from distributed import LocalCluster

        return LocalCluster(
            n_workers=args.workers, threads_per_worker=1, processes=True, dashboard_address=None
        )
    if kind == "LocalCUDACluster":
        from dask_cuda import LocalCUDACluster

        kwargs: dict[str, Any] = {"CUDA_VISIBLE_DEVICES": "0", "n_workers": 1, "threads_per_worker": 1}
        if mode == "rmm":
            kwargs["rmm_pool_size"] = args.rmm_pool_size
        return LocalCUDACluster(dashboard_address=None, **kwargs)
    from distributed import LocalCluster

    return LocalCluster(
        n_workers=args.workers,
        threads_per_worker=1,
        processes=True,
        dashboard_address=None,
        env={"CUDA_VISIBLE_DEVICES": "0"},
    )


def run_mode(mode: str, args: argparse.Namespace, kind: str) -> list[Result]:
    """Start a cluster for ``mode``, set it up, run every workload, read the peaks."""
    from distributed import Client

    results = [Result(mode, w, args.workers, kind) for w in args.workloads]
    fraction = args.memory_fraction
    if fraction is None and args.workers > 1:
        fraction = 0.9 / args.workers
    try:
        with _cluster(mode, args, kind) as cluster, Client(cluster) as client:
            notes: list[str] = []
            if mode == "graphpool":
                import graphpool.dask as gd

                gpu = args.xp == "cupy"
                client.register_plugin(
                    gd.GraphpoolSetup(
                        backend="cuda" if gpu else "sim",
                        memory_fraction=fraction,
                        integrations=("cupy",) if gpu else (),
                    )
                )
                states = client.run(gd.worker_state)
                if gpu and any("cupy" not in s.installed for s in states.values()):
                    raise RuntimeError(f"graphpool's CuPy integration not installed: {states}")
            pool = None
            if mode == "rmm" and kind != "LocalCUDACluster":
                pool = (
                    args.rmm_pool_size
                    if isinstance(args.rmm_pool_size, int)
                    else fraction or args.rmm_pool_size
                )
            for got in client.run(_worker_setup, mode, fraction if mode == "cupy" else None, pool).values():
                notes.extend(got)
            for r in results:
                r.notes.extend(notes)
                try:
                    graph = _workload(r.workload, args.n, args.chunk, xp_name=args.xp)
                    t0 = time.perf_counter()
                    r.value = client.compute(graph).result()
                    r.cold_s = time.perf_counter() - t0
                    for _ in range(args.repeat):
                        t0 = time.perf_counter()
                        client.compute(graph).result()
                        r.warm_s.append(time.perf_counter() - t0)
                except Exception as exc:  # one workload failing (out of memory...) is reported
                    r.error = f"{type(exc).__name__}: {exc}"[:300]
                # peaks over this workload and the ones before it (the cluster is the mode's)
                for address, (reserved, allocated, more) in client.run(_worker_peaks).items():
                    r.peak_reserved[address] = reserved
                    r.peak_allocated[address] = allocated
                    r.notes.extend(more)
            if mode == "graphpool":
                results[-1].summary = gd.memory_summary(client)
    except Exception as exc:
        for r in results:
            if r.error is None:
                r.error = f"{type(exc).__name__}: {exc}"[:300]
    return results


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("dask", "distributed", "dask_cuda", "cupy", "rmm", "graphpool"):
        try:
            out[name] = str(getattr(__import__(name), "__version__", "?"))
        except Exception:
            out[name] = "not importable"
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated, of " + ", ".join(MODES))
    ap.add_argument(
        "--workloads", default=",".join(WORKLOADS), help="comma-separated, of " + ", ".join(WORKLOADS)
    )
    ap.add_argument("--workers", type=int, default=1, help="workers on GPU 0 (1: LocalCUDACluster)")
    ap.add_argument("--n", type=int, default=16384, help="x is n x n float32")
    ap.add_argument("--chunk", type=int, default=2048, help="block edge (matmul), row block (fft)")
    ap.add_argument("--repeat", type=int, default=5, help="warm runs after the cold one")
    ap.add_argument("--rmm-pool-size", type=parse_size, default=0.8, help="fraction of the device or bytes")
    ap.add_argument("--memory-fraction", type=float, default=None, help="per worker; default 0.9/K for K > 1")
    ap.add_argument("--json", help="write the results and versions here")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    ap.add_argument(
        "--xp",
        choices=("cupy", "numpy"),
        default="cupy",
        help="numpy: check the driver on the CPU (graphpool mode on its simulator, NumPy blocks)",
    )
    args = ap.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    args.workloads = [w for w in args.workloads.split(",") if w]
    for m in args.modes:
        if m not in MODES:
            ap.error(f"unknown mode {m!r}: choose among {', '.join(MODES)}")
    for w in args.workloads:
        if w not in WORKLOADS:
            ap.error(f"unknown workload {w!r}: choose among {', '.join(WORKLOADS)}")
    if args.workers < 1 or args.n < 1 or args.chunk < 1 or args.repeat < 0:
        ap.error("--workers, --n and --chunk must be >= 1, --repeat >= 0")
    if args.memory_fraction is not None and not 0 < args.memory_fraction <= 1:
        ap.error("--memory-fraction must be in (0, 1]")
    return args


def main(argv: Sequence[str] | None = None, importable: Callable[[str], bool] = _importable) -> int:
    args = parse_args(argv)
    run, skipped, kind = plan(args.modes, args.workers, importable, args.xp)
    print(
        f"dask_gpu: {args.workers} worker(s) on {'GPU 0' if args.xp == 'cupy' else 'the CPU'} ({kind}), "
        f"workloads {', '.join(args.workloads)}, "
        f"n={args.n}, chunk={args.chunk}, {args.repeat} warm runs; modes to run: {', '.join(run) or 'none'}"
    )
    if args.dry_run:
        print(format_table([], skipped))
        return 0
    results: list[Result] = []
    for mode in run:
        results.extend(run_mode(mode, args, kind))
    print(format_table(results, skipped))
    differ = values_agree(results)
    if differ:
        print(f"WARNING: results differ between modes for {', '.join(differ)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "argv": sys.argv,
                    "versions": _versions(),
                    "skipped": skipped,
                    "results": [asdict(r) for r in results],
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
