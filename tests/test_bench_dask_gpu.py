"""benchmarks/dask_gpu.py on the CPU: its pure helpers and the dask graphs of its workloads
(on NumPy blocks); the GPU runs are the lead's (it needs CuPy, Dask-CUDA and RMM)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "dask_gpu.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    if not SCRIPT.exists():
        pytest.skip("not run from a source checkout")
    spec = importlib.util.spec_from_file_location("dask_gpu", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["dask_gpu"] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop("dask_gpu", None)
    return module


def test_sizes_are_fractions_or_bytes(bench: ModuleType) -> None:
    assert bench.parse_size("0.8") == 0.8 and bench.parse_size("1") == 1.0
    assert bench.parse_size("20GB") == 20 * 10**9 and bench.parse_size("512MiB") == 512 << 20
    assert bench.parse_size("1e9") == 10**9
    for bad in ("0", "-1", "lots", "12XB"):
        with pytest.raises(ValueError, match="size"):
            bench.parse_size(bad)


def test_the_plan_names_what_is_skipped_and_why(bench: ModuleType) -> None:
    every = ("cupy", "rmm", "graphpool")
    run, skipped, kind = bench.plan(every, 1, lambda m: m != "rmm")
    assert (run, kind) == (["cupy", "graphpool"], "LocalCUDACluster")
    assert skipped == {"rmm": "rmm not importable"}
    run, skipped, kind = bench.plan(every, 2, lambda m: m != "dask_cuda")
    assert (run, skipped, kind) == (list(every), {}, "LocalCluster")  # several workers: no Dask-CUDA
    run, skipped, _ = bench.plan(every, 1, lambda m: m not in ("cupy", "dask_cuda"))
    assert run == [] and all("cupy" in why and "dask_cuda" in why for why in skipped.values())
    run, skipped, kind = bench.plan(every, 1, lambda m: True, xp="numpy")
    assert (run, kind) == (["graphpool"], "LocalCluster") and set(skipped) == {"cupy", "rmm"}


def test_arguments(bench: ModuleType) -> None:
    args = bench.parse_args(["--modes", "graphpool", "--workers", "2", "--rmm-pool-size", "8GiB"])
    assert args.modes == ["graphpool"] and args.workloads == ["matmul", "fft"]
    assert args.rmm_pool_size == 8 << 30 and args.workers == 2
    for bad in (["--modes", "tf"], ["--workloads", "sort"], ["--workers", "0"], ["--memory-fraction", "2"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_the_table_gives_each_worker_its_peaks(bench: ModuleType) -> None:
    r = bench.Result("graphpool", "matmul", 2, "LocalCluster", cold_s=1.5, warm_s=[0.3, 0.1, 0.2])
    r.peak_reserved = {"tcp://b": 3 << 30, "tcp://a": 20 << 20}
    r.peak_allocated = {"tcp://a": 10 << 20, "tcp://b": None}
    r.value = 12345.678
    failed = bench.Result("rmm", "fft", 2, "LocalCluster", error="MemoryError: out of memory")
    text = bench.format_table([r, failed], {"cupy": "cupy not importable"})
    row = next(line for line in text.splitlines() if line.startswith("graphpool"))
    assert "1.500" in row and "0.200" in row  # cold, warm median
    assert "20.00 MiB | 3.00 GiB" in row and "10.00 MiB | n/a" in row  # workers in address order
    assert "12345.7" in row
    assert "skipped cupy: cupy not importable" in text
    assert "failed rmm / fft: MemoryError: out of memory" in text


def test_results_must_agree_between_modes(bench: ModuleType) -> None:
    a = bench.Result("cupy", "matmul", 1, "x", value=100.0)
    b = bench.Result("graphpool", "matmul", 1, "x", value=100.01)
    c = bench.Result("rmm", "fft", 1, "x", value=1.0)
    d = bench.Result("graphpool", "fft", 1, "x", value=1.5)
    assert bench.values_agree([a, b, c, d]) == ["fft"]


@pytest.mark.parametrize("workload", ["matmul", "fft"])
def test_the_workloads_compute_what_they_say(bench: ModuleType, workload: str) -> None:
    pytest.importorskip("dask.array")
    got = bench._workload(workload, 96, 32, xp_name="numpy").compute(scheduler="synchronous")

    def block(i: int, j: int, shape: tuple[int, int]) -> np.ndarray:
        return bench._block(1, "numpy", {None: {"chunk-location": (i, j), "chunk-shape": shape}})

    if workload == "matmul":
        x = np.block([[block(i, j, (32, 32)) for j in range(3)] for i in range(3)])
        want = float((x @ x.T).sum())
    else:
        x = np.concatenate([block(i, 0, (32, 96)) for i in range(3)])
        want = float(np.abs(np.fft.fft(x, axis=1)).mean())
    assert x.dtype == np.float32 and len(np.unique(x)) > 9000  # seeded per block, not one block repeated
    assert got == pytest.approx(want, rel=1e-5)


def test_a_dry_run_prints_the_plan_and_starts_nothing(
    bench: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench.main(["--dry-run", "--modes", "cupy,rmm"], importable=lambda m: m != "rmm") == 0
    out = capsys.readouterr().out
    assert "modes to run: cupy" in out and "skipped rmm: rmm not importable" in out
