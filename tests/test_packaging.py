"""What a user installs: typing marker, license, extras, and mypy strict on the source."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import graphpool

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"


def _project() -> dict[str, Any]:
    if not PYPROJECT.exists():
        pytest.skip("not run from a source checkout")
    data: dict[str, Any] = tomllib.loads(PYPROJECT.read_text())
    return data


def test_py_typed_ships_with_the_package() -> None:
    assert (Path(graphpool.__file__).parent / "py.typed").exists()
    data = _project()
    assert "py.typed" in data["tool"]["setuptools"]["package-data"]["graphpool"]


def test_license_is_spdx_with_its_file() -> None:
    project = _project()["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_cuda_extras_pin_the_cuda_major() -> None:
    extras = _project()["project"]["optional-dependencies"]
    assert extras["cu12"] == ["cuda-bindings>=12.8,<13", "cupy-cuda12x>=13"]
    assert extras["cu13"] == ["cuda-bindings>=13,<14", "cupy-cuda13x>=13"]
    assert extras["cupy"] == ["graphpool[cu13]"]
    assert "sphinx" in " ".join(extras["test"]) and "mypy" in " ".join(extras["test"])


def test_the_dask_extra_brings_distributed_and_ci_installs_it() -> None:
    """graphpool[dask] brings distributed; the test extra includes it, so CI runs the Dask tests
    (tests/test_integrations_dask.py skips only where distributed is missing)."""
    extras = _project()["project"]["optional-dependencies"]
    assert [r for r in extras["dask"] if r.startswith("distributed")], extras["dask"]
    assert "graphpool[dask]" in extras["test"]


def test_versions_agree() -> None:
    assert _project()["project"]["version"] == graphpool.__version__


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is not installed")
def test_mypy_strict_passes(tmp_path: Path) -> None:
    """``mypy`` with the project's settings (strict, see pyproject.toml) finds nothing."""
    config = _project()["tool"]["mypy"]
    assert config["strict"] is True
    r = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is not installed")
def test_the_compiled_modules_type_check_as_the_build_sees_them(tmp_path: Path) -> None:
    """setup.py's mypyc run, as in pip's build environment: no site-packages (numpy and
    cuda.bindings missing, hence Any) and no project config. Any error there would make
    the install fall back to pure Python without a word."""
    from graphpool import build

    if not (ROOT / "setup.py").exists():
        pytest.skip("not run from a source checkout")
    assert '"--config-file", ""' in (ROOT / "setup.py").read_text()
    files = [f"src/graphpool/{name}.py" for name in build.COMPILED]
    r = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", "", "--no-site-packages", "--ignore-missing-imports"]
        + ["--cache-dir", str(tmp_path / "cache"), *files],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
