"""graphpool.tools.frameworks_bench off the GPU: what it skips and says, and how it pairs the
sides' runs into ratios (the workers themselves run only on a GPU: PART=2 of benchmarks/gpu_stop16.sh)."""

from __future__ import annotations

import importlib.util
import platform
import shutil
import subprocess
import sys
from typing import Any

import pytest

from graphpool.tools import frameworks_bench as fb


def test_without_a_gpu_every_case_is_skipped_with_its_reason() -> None:
    res = fb.run_all(quick=True)
    assert [s["comparison"] for s in res["skipped"]] == [f"frameworks: {c}" for c in fb.CASES]
    assert all(s["why"] for s in res["skipped"])
    assert fb.table(res).splitlines()[0] == "== skipped"


def test_sides_alternate_and_ratios_divide_by_the_frameworks_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, str]] = []
    times = {"numba": [2.0, 4.0], "graphpool": [1.0, 3.0]}

    def spawn(case: str, side: str, src: str, number: int, rounds: int, timeout: float) -> dict[str, Any]:
        calls.append((side, src))
        return {"device_array": times[side]}

    monkeypatch.setattr(fb, "_spawn", spawn)
    out = fb.compare("numba", {"new": "/a", "old": "/b"}, processes=2)
    assert calls == [("numba", "/a"), ("graphpool", "/a"), ("graphpool", "/b")] + [
        ("graphpool", "/a"),
        ("graphpool", "/b"),
        ("numba", "/a"),
    ]  # rotated: over three rounds each side would run once in each slot
    row = out["rows"]["device_array"]
    assert row["numba min (us)"] == 2.0 and row["numba median (us)"] == 3.0
    assert row["graphpool[new]/numba (median)"] == pytest.approx(2.0 / 3.0)
    assert row["graphpool[old]/numba (min)"] == pytest.approx(0.5)
    assert out["errors"] == {}
    # each process's median, in the order the processes ran, and the table shows them
    assert out["per_process"]["numba"] == {"device_array": [3.0, 3.0]}
    assert out["per_process"]["graphpool[new]"] == {"device_array": [2.0, 2.0]}
    assert "each process: 3 3" in fb.table({"numba": out})


def test_over_as_many_rounds_as_sides_each_side_runs_once_in_each_slot() -> None:
    sides = [("a", "a", "/"), ("b", "b", "/"), ("c", "c", "/")]
    orders = [[label for label, _, _ in fb._order(sides, p)] for p in range(6)]
    assert orders[:3] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]] and orders[3:] == orders[:3]
    for slot in range(3):
        assert sorted(order[slot] for order in orders[:3]) == ["a", "b", "c"]
    assert [label for label, _, _ in fb._order(sides[:2], 1)] == ["b", "a"]  # two sides alternate


def test_a_failed_worker_is_reported_not_averaged(monkeypatch: pytest.MonkeyPatch) -> None:
    def spawn(case: str, side: str, *args: Any) -> dict[str, Any]:
        return {"error": "boom"} if side == "graphpool" else {"x": [1.0]}

    monkeypatch.setattr(fb, "_spawn", spawn)
    out = fb.compare("cuda_core", {"": "/a"}, processes=1)
    assert out["errors"] == {"graphpool": "boom"}
    assert out["rows"]["x"] == {"cuda.core min (us)": 1.0, "cuda.core median (us)": 1.0}
    assert "graphpool: FAILED: boom" in fb.table({"cuda_core": out})


def test_each_processes_median_is_kept_in_the_order_they_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    """A side whose processes split between two levels shows it (run 16: 1.9 and 3.0 us)."""
    level = {"graphpool": iter([[1.9, 2.1, 2.0], [3.0, 2.9, 3.1]]), "cuda.core": iter([[1.0], [1.2]])}

    def spawn(case: str, side: str, *args: Any) -> dict[str, Any]:
        return {"x": next(level[side])}

    monkeypatch.setattr(fb, "_spawn", spawn)
    out = fb.compare("cuda_core", {"": "/a"}, processes=2)
    assert out["per_process"] == {"cuda.core": {"x": [1.0, 1.2]}, "graphpool": {"x": [2.0, 3.0]}}
    assert out["rows"]["x"]["graphpool median (us)"] == pytest.approx(2.5)
    table = fb.table({"cuda_core": out})
    assert "each process: 2 3" in table and "each process: 1 1.2" in table


def test_modes_split_a_sides_processes_at_the_cut() -> None:
    m = fb.modes([2.0, 2.2, 3.9, 2.1, 4.1])
    assert (m.slow, m.processes, m.fast_median, m.slow_median) == (2, 5, 2.1, 4.0)
    assert fb.modes([2.0, 2.8]).slow == 0  # 2.8 is 1.4x the fastest: still the fast mode
    assert fb.modes([2.0, 2.81]).slow == 1
    assert fb.modes([2.0]).slow_median is None
    with pytest.raises(ValueError, match="no processes"):
        fb.modes([])
    with pytest.raises(ValueError, match="above 1"):
        fb.modes([1.0], 1.0)


def test_each_row_gives_the_slow_processes_and_the_fast_mode_ratio(monkeypatch: pytest.MonkeyPatch) -> None:
    """The framework's processes drew one slow process of five, graphpool's three: the median
    ratio says 1.59x, the fast modes 0.86x; a program's row gets no split."""
    level = {
        "cuda.core": iter([2.0, 2.2, 4.0, 2.1, 2.2]),
        "graphpool": iter([1.8, 3.7, 3.6, 1.9, 3.5]),
    }

    def spawn(case: str, side: str, *args: Any) -> dict[str, Any]:
        t = next(level[side])
        return {"x": [t], "program: p": [100 * t]}

    monkeypatch.setattr(fb, "_spawn", spawn)
    out = fb.compare("cuda_core", {"": "/a"}, processes=5)
    row = out["rows"]["x"]
    assert row["cuda.core slow processes"] == [1, 5] and row["graphpool slow processes"] == [3, 5]
    assert row["graphpool/cuda.core (fast mode)"] == pytest.approx(1.85 / 2.15)  # fast medians
    assert row["graphpool/cuda.core (median)"] == pytest.approx(3.5 / 2.2)
    assert "cuda.core/cuda.core (fast mode)" not in row
    assert not any("mode" in col or "slow" in col for col in out["rows"]["program: p"])
    table = fb.table({"cuda_core": out})
    assert "(slow mode: 3 of 5)" in table and "(slow mode: 1 of 5)" in table
    assert "graphpool/cuda.core (fast mode)" in table and "slow processes" not in table


def test_few_processes_or_no_framework_side_give_counts_but_no_fast_mode_ratio(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two processes a side may both have drawn the slow mode: counts, no ratio. A failed
    framework side, or replay (no framework side), still gets each side's count."""
    times = iter([2.0, 1.8, 4.0, 3.9])

    def spawn(case: str, side: str, *args: Any) -> dict[str, Any]:
        return {"x": [next(times)]}

    monkeypatch.setattr(fb, "_spawn", spawn)
    row = fb.compare("cuda_core", {"": "/a"}, processes=2)["rows"]["x"]
    assert row["graphpool slow processes"] == [1, 2] and not any("fast mode" in c for c in row)

    def failing(case: str, side: str, *args: Any) -> dict[str, Any]:
        return {"error": "boom"} if side == "cuda.core" else {"x": [next(times2)]}

    times2 = iter([1.0, 1.1, 3.0, 1.0])
    monkeypatch.setattr(fb, "_spawn", failing)
    out = fb.compare("cuda_core", {"": "/a"}, processes=4)
    assert out["rows"]["x"]["graphpool slow processes"] == [1, 4]
    assert not any("fast mode" in c for c in out["rows"]["x"])


def test_the_bench_file_loads_by_its_path_outside_sys_modules() -> None:
    """The workers and benchmarks/torch_program_probe.py load this file by path, unregistered
    (a dataclass there would fail to build): ``modes`` must work so loaded."""
    spec = importlib.util.spec_from_file_location("fb_by_path", fb.__file__)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert "fb_by_path" not in sys.modules
    assert module.modes([1.0, 3.0]).slow == 1


def test_no_aslr_runs_each_worker_under_setarch(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--no-aslr``: the worker command starts with ``setarch <machine> -R`` where setarch is
    installed (nothing where it is not); without the flag, with the interpreter."""
    seen: list[list[str]] = []

    def run(cmd: list[str], **kwargs: Any) -> Any:
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout='{"x": [1.0]}\n', stderr="")

    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setattr(fb, "WORKER_PREFIX", [])
    assert fb._spawn("numba", "numba", "/a", 10, 1, 5.0) == {"x": [1.0]}
    assert seen[-1][0] == sys.executable
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/setarch" if name == "setarch" else None)
    fb.WORKER_PREFIX[:] = fb.no_aslr_prefix()
    fb._spawn("numba", "numba", "/a", 10, 1, 5.0)
    assert seen[-1][:4] == ["/usr/bin/setarch", platform.machine(), "-R", sys.executable]
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert fb.no_aslr_prefix() == []


def test_the_no_aslr_flag_sets_the_workers_prefix(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    """``main(["--no-aslr"])`` runs the comparison with the ``setarch`` prefix in place; without
    the flag, with none."""
    prefixes: list[list[str]] = []

    def run_all(*args: Any, **kwargs: Any) -> dict[str, Any]:
        prefixes.append(list(fb.WORKER_PREFIX))
        return {"skipped": []}

    monkeypatch.setattr(fb, "run_all", run_all)
    monkeypatch.setattr(fb, "WORKER_PREFIX", [])
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/setarch" if name == "setarch" else None)
    assert fb.main(["--case", "numba"]) == 0
    assert fb.main(["--case", "numba", "--no-aslr"]) == 0
    assert prefixes == [[], ["/usr/bin/setarch", platform.machine(), "-R"]]
    capsys.readouterr()
