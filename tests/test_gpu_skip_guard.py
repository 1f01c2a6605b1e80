"""The GPU-skip guard (tests/gpu_guard.py) and the CUDA layer's reason for saying no."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import gpu_guard
from graphpool.device import cuda

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"


# ------------------------------------------------------------------ the decision itself
@pytest.mark.parametrize(
    ("reason", "allowed"),
    [
        ("could not import 'cupy': No module named 'cupy'", True),
        ("Skipped: could not import 'torch': No module named 'torch'", True),
        ("could not import 'numba.cuda': No module named 'numba'", True),
        ("could not import 'cuda.core.experimental': No module named 'cuda.core'", True),
        ("could not import 'jax.numpy': No module named 'jax'", True),
        ("optional framework missing: torch (built without CUDA)", True),
        ("optional framework missing: jax (no GPU backend)", True),
        ("host has too few GPUs: needs two devices", True),
        ("GRAPHPOOL_NO_GPU is set", True),
        # what the guard exists for: the CUDA layer itself failing
        ("no usable CUDA GPU (CUDA layer broken: importing cuda.bindings failed)", False),
        ("no usable CUDA GPU (no CUDA driver: cudaGetDeviceCount returned ...)", False),
        ("no usable CUDA GPU", False),
        ("could not import 'cuda.bindings': No module named 'cuda'", False),  # not optional
        ("could not import 'graphpool.cupy': boom", False),
        ("optional framework missing: graphpool", False),
        ("optional framework missing:", False),
        ("some other reason", False),
    ],
)
def test_skip_allowed(reason: str, allowed: bool) -> None:
    assert gpu_guard.skip_allowed(reason) is allowed


def test_verdict_only_fails_gpu_tests_on_gpu_hosts() -> None:
    bad = "no usable CUDA GPU (CUDA layer broken: x)"
    assert gpu_guard.verdict(True, False, bad) is None  # no GPU here: the skip stands
    assert gpu_guard.verdict(False, True, bad) is None  # not a gpu test
    assert gpu_guard.verdict(True, True, "could not import 'cupy': no") is None
    message = gpu_guard.verdict(True, True, "Skipped: " + bad)
    assert message is not None
    assert message.startswith("GPU-skip guard: this host has an NVIDIA GPU")
    assert repr(bad) in message


def test_gpu_host_override(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu_guard.gpu_host.cache_clear()
    try:
        monkeypatch.setenv("GRAPHPOOL_GPU_HOST", "1")
        assert gpu_guard.gpu_host() is True
        gpu_guard.gpu_host.cache_clear()
        monkeypatch.setenv("GRAPHPOOL_GPU_HOST", "0")
        assert gpu_guard.gpu_host() is False
    finally:
        gpu_guard.gpu_host.cache_clear()


# ------------------------------------------------------------- the hook, in a real run
_CASES = """
import pytest

pytestmark = pytest.mark.gpu

def test_broken_layer():
    pytest.skip("no usable CUDA GPU (CUDA layer broken: importing cuda.bindings failed)")

def test_missing_framework():
    pytest.importorskip("a_framework_nobody_has_graphpool_test")

def test_missing_cupy(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "cupy", None)
    pytest.importorskip("cupy")

def test_torch_cpu_only():
    pytest.skip("optional framework missing: torch (built without CUDA)")

@pytest.fixture
def broken_fixture():
    pytest.skip("no usable CUDA GPU (no CUDA driver: x)")

def test_skip_in_fixture(broken_fixture):
    pass

def test_passes():
    pass

@pytest.mark.xfail(reason="expected", strict=False)
def test_xfail():
    assert False
"""

_PLAIN = """
import pytest

def test_not_gpu_marked():
    pytest.skip("no usable CUDA GPU")
"""


def _run(tmp_path: Path, gpu_host: str) -> dict[str, str]:
    (tmp_path / "conftest.py").write_text(
        "from gpu_guard import pytest_runtest_makereport  # noqa: F401\n"
        "def pytest_configure(config):\n"
        "    config.addinivalue_line('markers', 'gpu: needs a GPU')\n"
    )
    (tmp_path / "test_cases.py").write_text(textwrap.dedent(_CASES))
    (tmp_path / "test_plain.py").write_text(textwrap.dedent(_PLAIN))
    env = dict(os.environ, GRAPHPOOL_GPU_HOST=gpu_host, PYTHONPATH=f"{TESTS}{os.pathsep}{SRC}")
    env.pop("GRAPHPOOL_NO_GPU", None)
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", "-q", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out: dict[str, str] = {}
    for line in r.stdout.splitlines():
        parts = line.split(" ", 2)
        if len(parts) >= 2 and parts[0] in ("PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL"):
            name = parts[1].split("::")[-1] if "::" in parts[1] else parts[-1]
            out[name.split(" ")[0]] = parts[0]
    return out | {"_stdout": r.stdout}


def test_hook_on_a_gpu_host(tmp_path: Path) -> None:
    got = _run(tmp_path, "1")
    stdout = got.pop("_stdout")
    assert got["test_broken_layer"] == "FAILED", stdout
    assert got["test_skip_in_fixture"] == "ERROR", stdout  # a setup-time skip fails the setup
    assert got["test_passes"] == "PASSED", stdout
    assert got["test_xfail"] == "XFAIL", stdout
    assert "GPU-skip guard" in stdout
    skipped = [line for line in stdout.splitlines() if line.startswith("SKIPPED")]
    # missing framework? no: an unknown module is not an optional framework, so it fails
    assert got["test_missing_framework"] == "FAILED", stdout
    # allowed: cupy not importable, torch without CUDA, and the test not marked gpu
    assert len(skipped) == 3, stdout
    assert sorted(s.split(": ", 1)[1] for s in skipped) == sorted(
        [
            "could not import 'cupy': import of cupy halted; None in sys.modules",
            "optional framework missing: torch (built without CUDA)",
            "no usable CUDA GPU",
        ]
    ), skipped


def test_hook_on_a_host_without_gpu(tmp_path: Path) -> None:
    got = _run(tmp_path, "0")
    stdout = got.pop("_stdout")
    assert "GPU-skip guard" not in stdout
    assert [line for line in stdout.splitlines() if line.startswith(("FAILED", "ERROR"))] == []
    assert len([line for line in stdout.splitlines() if line.startswith("SKIPPED")]) == 6, stdout


# ------------------------------------------------------- cuda.unavailable_reason()
class _Err(int):
    """A cudaError_t stand-in: an int with a name (0 is success)."""

    def __new__(cls, code: int, name: str) -> _Err:
        obj = super().__new__(cls, code)
        obj.name = name  # type: ignore[attr-defined]
        return obj


def _rt(result: Any = None, raises: BaseException | None = None) -> Any:
    def count() -> Any:
        if raises is not None:
            raise raises
        return result

    return SimpleNamespace(cudaGetDeviceCount=count)


@pytest.fixture
def fresh_reason() -> Iterator[None]:
    cuda.unavailable_reason.cache_clear()
    yield
    cuda.unavailable_reason.cache_clear()


def _load_raising(exc: BaseException) -> Any:
    def load() -> Any:
        raise exc

    return load


@pytest.mark.parametrize(
    ("load", "prefix"),
    [
        (_load_raising(ModuleNotFoundError("No module named 'cuda'", name="cuda")), cuda.NO_BINDINGS),
        (
            _load_raising(ModuleNotFoundError("No module named 'cuda.bindings'", name="cuda.bindings")),
            cuda.NO_BINDINGS,
        ),
        (_load_raising(ModuleNotFoundError("No module named 'numpy'", name="numpy")), cuda.BROKEN),
        (_load_raising(ImportError("libcudart.so: undefined symbol")), cuda.BROKEN),
        (_load_raising(AttributeError("cudaError_t")), cuda.BROKEN),
        (lambda: _rt((_Err(35, "cudaErrorInsufficientDriver"), 0)), cuda.NO_DRIVER),
        (lambda: _rt((_Err(34, "cudaErrorStubLibrary"), 0)), cuda.NO_DRIVER),
        (lambda: _rt((_Err(100, "cudaErrorNoDevice"), 0)), cuda.NO_GPU),
        (lambda: _rt((_Err(0, "cudaSuccess"), 0)), cuda.NO_GPU),
        (lambda: _rt((_Err(999, "cudaErrorUnknown"), 0)), cuda.BROKEN),
        (lambda: _rt((_Err(3, "cudaErrorInitializationError"), 0)), cuda.BROKEN),
        (lambda: _rt(raises=RuntimeError("driver crashed")), cuda.BROKEN),
        (lambda: _rt((_Err(0, "cudaSuccess"), object())), cuda.BROKEN),
    ],
)
def test_unavailable_reason_says_why(
    monkeypatch: pytest.MonkeyPatch, fresh_reason: None, load: Any, prefix: str
) -> None:
    monkeypatch.setattr(cuda, "_load", load)
    reason = cuda.unavailable_reason()
    assert reason is not None and reason.startswith(prefix + ": "), reason
    assert cuda.is_available() is False


def test_unavailable_reason_none_when_a_device_is_there(
    monkeypatch: pytest.MonkeyPatch, fresh_reason: None
) -> None:
    monkeypatch.setattr(cuda, "_load", lambda: _rt((_Err(0, "cudaSuccess"), 2)))
    assert cuda.unavailable_reason() is None
    assert cuda.is_available() is True


def test_unavailable_reason_on_this_host_agrees_with_is_available() -> None:
    reason = cuda.unavailable_reason()
    assert cuda.is_available() is (reason is None)
    if reason is not None:
        assert reason.split(":")[0] in (cuda.NO_BINDINGS, cuda.NO_DRIVER, cuda.NO_GPU, cuda.BROKEN)
