"""CI smoke test of ``python -m graphpool bench --quick`` on the simulator."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"

# Keys the lead's GPU scripts (benchmarks/gpu_run.sh) read: they must stay.
LEGACY = {
    "routing": {
        "no capture (us)",
        "capture on another stream (us)",
        "ratio capture on another stream / no capture",
        "on the capturing stream (us)",
        "ratio on the capturing stream / no capture",
    },
    "replay": {"CUDAGraph.replay (us)", "bare launch (us)", "ratio replay / bare launch"},
}
PAIR_KEYS = {
    "graphpool alloc+free",
    "graphpool alloc+free, current stream",
    "graphpool alloc+drop",
    "policy malloc+free",
}


def _bench(*args: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess[str], float]:
    env = dict(os.environ, PYTHONPATH=str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "graphpool", "bench", "--quick", "--backend", "sim", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    return r, time.perf_counter() - t0


@pytest.fixture(scope="module")
def table_and_json(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, dict[str, Any], float]:
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    r, seconds = _bench("--json", str(path))
    assert r.returncode == 0, r.stderr
    return r.stdout, r.stderr, json.loads(path.read_text()), seconds


def test_quick_bench_is_quick(table_and_json: tuple[str, str, dict[str, Any], float]) -> None:
    assert table_and_json[3] < 20


def test_table(table_and_json: tuple[str, str, dict[str, Any], float]) -> None:
    table = table_and_json[0]
    lines = table.splitlines()
    assert lines[0].startswith("graphpool bench: backend sim")
    assert "(quick)" in lines[0]
    assert lines[1] == "ratios: A/B time is A's time divided by B's (above 1: A is slower)"
    for header in (
        "== cached malloc+free pair, one size",
        "== cached malloc+free pair, mixed sizes (cycling)",
        "== pair while a capture is underway (rounds alternate with the no-capture pair)",
        "== graph replay vs raw launch (synchronized between runs)",
        "== allocation traces: us per operation, warm and cold; peak reserved",
        "== comparisons skipped (8)",
    ):
        assert header in lines
    # figures are rounded, with units; every ratio says its direction
    row = next(line for line in lines if line.strip().startswith("512 B: policy malloc+free"))
    assert row.endswith(" us") and len(row.split()[-2].replace(".", "")) <= 4
    ratios = [line for line in lines if line.endswith(" x")]
    assert len(ratios) == 8  # 2 capture-routing, 3 reserved/live (+1 with expandable), 2 expandable/policy
    assert all("/" in line and (" time" in line or "peak reserved/peak live" in line) for line in ratios), (
        ratios
    )
    assert "ratio " not in table  # the legacy keys, ambiguous about direction, stay out of the table
    assert "  CuPy" not in table and "malloc+free pair vs CuPy MemoryPool: " in table
    assert table.count("this is the simulator") == 8
    # the trace section: the short synthetic trace through graphpool and its policy, sizes in MiB
    assert any(
        line.strip().startswith("synthetic-0: graphpool, warm") and line.endswith(" us") for line in lines
    )
    assert any(line.strip().startswith("synthetic-0: peak live") and line.endswith(" MiB") for line in lines)
    assert "{" not in table  # not JSON
    # what the raw launch is, in words: once read "raw launch is  raw launch (simulated device)"
    row = next(line for line in lines if line.strip().startswith("raw launch calls"))
    assert row.split("raw launch calls", 1)[1].strip() == "the simulated device's own launch (no graphpool)"


def test_progress_on_stderr(table_and_json: tuple[str, str, dict[str, Any], float]) -> None:
    progress = table_and_json[1].splitlines()
    assert progress[0].startswith("[bench") and progress[-1].endswith("] done")
    assert any("graph replay vs raw launch" in line for line in progress)
    assert any("allocation trace synthetic-0" in line for line in progress)


def test_json_keys(table_and_json: tuple[str, str, dict[str, Any], float]) -> None:
    r = table_and_json[2]
    assert set(r) == {
        "backend",
        "device",
        "compiled",
        "meta",
        "malloc_free_pair_us",
        "malloc_free_mixed_us",
        "routing",
        "replay",
        "traces",
        "skipped",
    }
    assert r["backend"] == "sim"
    assert r["meta"] == {"number": 1000, "repeat": 3, "quick": True}
    assert set(r["malloc_free_pair_us"]) == {"512", "65536", "4194304"}
    for row in r["malloc_free_pair_us"].values():
        assert set(row) == PAIR_KEYS  # no CuPy on the simulator: no ratios to it
        assert all(v > 0 for v in row.values())
    mixed = r["malloc_free_mixed_us"]
    assert mixed["sizes"] == [512, 65536, 1048576, 4194304, 25165824]
    assert set(mixed) == {"sizes", "graphpool alloc+free (us)", "policy malloc+free (us)"}
    for section, keys in LEGACY.items():
        assert keys <= set(r[section]), section
    assert r["routing"]["rounds"] == 3
    assert r["routing"]["capture on another stream/no capture time"] == pytest.approx(
        r["routing"]["capture on another stream (us)"] / r["routing"]["no capture (us)"]
    )
    rep = r["replay"]
    assert rep["raw launch is"] == "the simulated device's own launch (no graphpool)"
    assert rep["CUDAGraph.replay, checker off (us)"] == rep["CUDAGraph.replay (us)"]
    assert rep["replay (checker on)/raw launch time"] == pytest.approx(
        rep["CUDAGraph.replay, checker on (us)"] / rep["raw launch (us)"]
    )
    assert rep["calls per run"] == 500
    assert [s["comparison"] for s in r["skipped"]] == [
        "malloc+free pair vs CuPy MemoryPool",
        "mixed-size pair vs CuPy MemoryPool",
        "CUDA graph vs eager kernels (CuPy)",
        "the CuPy capture hazard",
        "allocation traces vs CuPy MemoryPool",
        "allocation traces vs PyTorch caching allocator",
        "allocation traces vs cudaMallocAsync",
        "frameworks: CuPy, PyTorch, Numba, cuda.core, replay",
    ]
    assert list(r["traces"]["traces"]) == ["synthetic-0"]
    assert set(r["traces"]["sides"]) == {"graphpool", "policy", "expandable"}


def test_json_to_stdout() -> None:
    r, _ = _bench("--json", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    data = json.loads(r.stdout)
    assert data["backend"] == "sim" and "routing" in data


def test_a_section_runs_and_prints_from_its_registry_entry(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """bench.SECTIONS alone decides what runs, in which order, under which key and title; a
    section that returns None has noted why in the plan's ``skipped``."""
    from graphpool.tools import bench, benchkit

    seen: list[bench.Plan] = []

    def extra(plan: bench.Plan) -> dict[str, Any]:
        seen.append(plan)
        return {"one call (us)": 1.5, "a/b time": 0.5}

    def absent(plan: bench.Plan) -> None:
        benchkit.skip(plan.skipped, "a comparison", "not here")

    monkeypatch.setattr(
        bench,
        "SECTIONS",
        [bench.Section("extra", "an extra section", extra), bench.Section("absent", "never shown", absent)],
    )
    assert bench.run(quick=True, as_json=True, progress=False) == 0
    results = json.loads(capsys.readouterr().out)
    assert results["extra"] == {"one call (us)": 1.5, "a/b time": 0.5} and "absent" not in results
    assert results["skipped"] == [{"comparison": "a comparison", "why": "not here"}]
    assert seen[0].quick and seen[0].repeat == results["meta"]["repeat"]
    text = bench.table(results)
    assert "== an extra section" in text and "never shown" not in text
    assert "one call" in text and "1.5 us" in text and "0.50 x" in text
    assert "a comparison: not here" in text
