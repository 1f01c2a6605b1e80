"""benchmarks/process_modes.py: the fast-mode reading of a bench run's JSON made before the bench
printed it (the reading that explains run 16's 1.34x for PyTorch); the split itself is the
bench's (``frameworks_bench.modes``, tested with the bench)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from graphpool.tools import frameworks_bench as fb

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "process_modes.py"


@pytest.fixture(scope="module")
def modes() -> ModuleType:
    if not SCRIPT.exists():
        pytest.skip("not run from a source checkout")
    spec = importlib.util.spec_from_file_location("process_modes", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_script_splits_by_the_benchs_own_rule_with_its_cut(modes: ModuleType) -> None:
    assert modes.split([2.0, 2.2, 3.9, 2.1, 4.1], 1.4) == fb.modes([2.0, 2.2, 3.9, 2.1, 4.1])
    assert modes.split([2.0, 2.9], 1.5).slow == 0 and modes.split([2.0, 2.9], 1.4).slow == 1


def test_the_fast_mode_ratio_takes_the_draw_out_of_the_median(modes: ModuleType) -> None:
    # The framework's processes drew no slow one, graphpool's three of five: the median says
    # 1.7x, the fast modes 0.9x.
    run = {
        "torch": {
            "per_process": {
                "torch": {"torch.empty": [2.0, 2.1, 2.0, 2.2, 2.1], "program: step": [9.0]},
                "graphpool": {"torch.empty": [1.8, 3.6, 3.7, 1.9, 3.5], "program: step": [9.0]},
            }
        },
        "skipped": [],
    }
    lines = modes.report(run, 1.4)
    assert len(lines) == 2 and "program" not in lines[1]
    assert "torch slow 0/5, fast 2.10;" in lines[1]
    assert "graphpool slow 3/5, fast 1.85, slow 3.60" in lines[1]
    assert lines[1].endswith("fast-mode graphpool/torch 0.88x")


def test_main_reads_json_files(modes: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "run.json"
    f.write_text('{"cupy": {"per_process": {"cupy": {"a": [1.0, 2.0]}, "graphpool": {"a": [1.0, 1.1]}}}}')
    assert modes.main(["--cut", "1.5", str(f)]) == 0
    out = capsys.readouterr().out
    assert "cupy slow 1/2, fast 1.00, slow 2.00" in out and "graphpool/cupy 1.05x" in out
    assert modes.main([]) == 2
