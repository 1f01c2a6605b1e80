"""What every section of ``python -m graphpool bench`` shares: timing in interleaved rounds,
progress lines, the comparisons skipped and why, and the table's number formats.

A section (graphpool.tools.bench, graphpool.tools.trace_bench) times its conditions with
``timed_runs``/``interleaved`` so that both sides of a ratio share the host's drift, notes a
comparison it cannot run with ``skip``, and reports progress with ``note_progress``.
"""

from __future__ import annotations

import ctypes
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import graphpool as gp

_SPIN_SRC = r"""
extern "C" __global__ void gp_spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""
_spin: Any = None


def cuda_spin(stream: gp.Stream, cycles: int = 200_000_000) -> None:
    """Queue a one-thread kernel that spins ``cycles`` clock ticks (about 0.1 s) on ``stream``."""
    import cupy

    from graphpool.cupy import cupy_stream

    global _spin
    if _spin is None:
        _spin = cupy.RawKernel(_SPIN_SRC, "gp_spin")
    _spin((1,), (1,), (cupy.int64(cycles),), stream=cupy_stream(stream))


class Progress:
    """Progress lines on stderr, with the seconds since the start."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.t0 = time.perf_counter()

    def __call__(self, what: str) -> None:
        if self.enabled:
            print(f"[bench {time.perf_counter() - self.t0:6.1f} s] {what}", file=sys.stderr, flush=True)


_reporter = Progress(enabled=False)


def torch_entry_points() -> Any:
    """The PyTorch shim's two C functions as PyTorch calls them, through ctypes, which releases
    the GIL around each call: ``graphpool_torch_malloc(size, device, stream) -> address``
    (None for 0) and ``graphpool_torch_free(ptr, size, device, stream)``. For tests and
    benchmarks without PyTorch (the hooks must be set: ``graphpool.torch.hooks()``). A failed
    malloc throws a C++ exception, which ctypes cannot catch (the shim's ``try_malloc`` raises
    it as a RuntimeError instead)."""
    import graphpool.torch as gtorch

    lib = ctypes.CDLL(gtorch.library_path())
    lib.graphpool_torch_malloc.restype = ctypes.c_void_p
    lib.graphpool_torch_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.graphpool_torch_free.restype = None
    lib.graphpool_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    return lib


def start_progress(enabled: bool) -> None:
    """Progress lines on stderr from now on (``enabled``), timed from now; or none."""
    global _reporter
    _reporter = Progress(enabled)


def note_progress(what: str) -> None:
    """A progress line, when ``start_progress(True)`` asked for them."""
    _reporter(what)


def per_call(fn: Callable[[], None], number: int, repeat: int) -> list[float]:
    """Seconds per call of ``fn`` for each of ``repeat`` runs of ``number`` calls."""
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        out.append((time.perf_counter() - t0) / number)
    return out


def timed_runs(
    fns: dict[str, Callable[[], None]],
    number: int,
    repeat: int,
    between: Callable[[], None] | None = None,
) -> dict[str, list[float]]:
    """Seconds per call of each fn in each of ``repeat`` rounds, the fns' runs interleaved
    within each round so that they share the host's drift. ``between`` runs, untimed,
    before every timed run (e.g. a synchronize, so queued work never spills over)."""
    runs: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():  # warm up
        if between is not None:
            between()
        per_call(fn, max(1, number // 10), 1)
    for _ in range(repeat):
        for k, fn in fns.items():
            if between is not None:
                between()
            runs[k] += per_call(fn, number, 1)
    if between is not None:
        between()
    return runs


def interleaved(fns: dict[str, Callable[[], None]], number: int, repeat: int) -> dict[str, float]:
    """Median seconds per call of each fn (see ``timed_runs``)."""
    return {k: statistics.median(v) for k, v in timed_runs(fns, number, repeat).items()}


def new_cupy_pool(skipped: list[dict[str, str]], what: str) -> Any:
    """A fresh CuPy MemoryPool to compare with, or None (noted in ``skipped``)."""
    if gp.backend() != "cuda":
        why = "CuPy runs only on the cuda backend (this is the simulator)"
        skipped.append({"comparison": what, "why": why})
        return None
    try:
        import cupy
    except ImportError:
        skipped.append({"comparison": what, "why": "cupy not installed"})
        return None
    return cupy.cuda.MemoryPool()


Skipped = list[dict[str, str]]  # {"comparison": ..., "why": ...} for each comparison not run


def skip(skipped: Skipped, comparison: str, why: str) -> None:
    """Note in ``skipped`` that ``comparison`` did not run, and why."""
    skipped.append({"comparison": comparison, "why": why})


def fmt_size(n: int) -> str:
    for unit, k in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << k and n % (1 << k) == 0:
            return f"{n >> k} {unit}"
    return f"{n} B"


def fmt_value(key: str, value: Any) -> tuple[str, str]:
    """(figure, unit) for a table cell: times in microseconds to 3 significant figures,
    ratios to 2 decimals with an x."""
    if isinstance(value, bool):
        return ("yes" if value else "NO"), ""
    if isinstance(value, int) and key.endswith("(bytes)"):
        return f"{value / (1 << 20):,.1f}", "MiB"
    if isinstance(value, int):
        return f"{value:,}", ""
    if isinstance(value, float):
        if key.endswith("(us)"):
            return f"{value:.3g}" if value < 100 else f"{value:,.0f}", "us"
        return f"{value:.2f}", "x"
    if isinstance(value, list):
        return ", ".join(fmt_size(v) if isinstance(v, int) else str(v) for v in value), ""
    return str(value), ""


# Keys kept in the JSON for the GPU scripts but not shown: the table shows the same figure
# under a label that says what it is (a ratio's direction, the checker's mode).
_LEGACY_PREFIXES = ("ratio ",)
_LEGACY_KEYS = ("speedup", "CUDAGraph.replay (us)")
_LABELS = {"bare launch": "bare launch (graphpool's device wrapper)", "raw launch is": "raw launch calls"}


def shown(key: str) -> bool:
    return key not in _LEGACY_KEYS and not key.startswith(_LEGACY_PREFIXES)


def label_of(key: str) -> str:
    key = key.removesuffix(" (us)")
    return _LABELS.get(key, key)
