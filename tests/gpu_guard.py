"""The GPU-skip guard: on a host with an NVIDIA GPU, a `gpu` test that skips fails.

A broken CUDA layer (cuda.bindings failing to import, an unexpected driver error) used to
turn into "no GPU" and skip every GPU test quietly. On a host where a GPU is present
(``/dev/nvidia0`` exists or ``nvidia-smi -L`` lists one), a skipped test marked ``gpu``
is reported as a failure unless its reason is one of ``ALLOWED``:

* an optional framework is not importable (``pytest.importorskip`` of cupy, torch, jax,
  numba or cuda.core, or a reason starting with ``OPTIONAL_MISSING``);
* the host has too few GPUs for the test (a reason starting with ``TOO_FEW_GPUS``);
* the user turned GPU tests off on purpose (``GRAPHPOOL_NO_GPU`` set: ``OPTED_OUT``).

``GRAPHPOOL_GPU_HOST=1`` / ``=0`` overrides the host detection (for the guard's own tests).
tests/conftest.py imports the hook from here.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from collections.abc import Generator
from typing import Any

import pytest

FRAMEWORKS = ("cupy", "torch", "jax", "numba", "cuda.core")
OPTIONAL_MISSING = "optional framework missing:"
TOO_FEW_GPUS = "host has too few GPUs:"
OPTED_OUT = "GRAPHPOOL_NO_GPU is set"
_IMPORTORSKIP = re.compile(r"could not import '([\w.]+)'")


@functools.lru_cache(maxsize=1)
def gpu_host() -> bool:
    """Whether an NVIDIA GPU is present on this host, whatever the CUDA layer says."""
    forced = os.environ.get("GRAPHPOOL_GPU_HOST")
    if forced is not None:
        return forced == "1"
    if os.path.exists("/dev/nvidia0"):
        return True
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return any(line.startswith("GPU ") for line in out.splitlines())


def cuda_unusable() -> str | None:
    """None when the CUDA backend is usable; else the skip reason for a GPU test."""
    if os.environ.get("GRAPHPOOL_NO_GPU"):
        return OPTED_OUT
    from graphpool.device.cuda import unavailable_reason

    reason = unavailable_reason()
    return None if reason is None else f"no usable CUDA GPU ({reason})"


def _framework(module: str) -> bool:
    return any(module == f or module.startswith(f + ".") for f in FRAMEWORKS)


def skip_allowed(reason: str) -> bool:
    """Whether a `gpu` test may skip for ``reason`` on a GPU host."""
    text = reason.removeprefix("Skipped: ").strip()
    m = _IMPORTORSKIP.match(text)
    if m is not None:
        return _framework(m.group(1))
    if text.startswith(OPTIONAL_MISSING):
        rest = text[len(OPTIONAL_MISSING) :].split()
        return bool(rest) and _framework(rest[0])
    return text.startswith(TOO_FEW_GPUS) or text.startswith(OPTED_OUT)


def verdict(marked_gpu: bool, on_gpu_host: bool, reason: str) -> str | None:
    """None if a skip with ``reason`` stands; else the failure message that replaces it."""
    if not marked_gpu or not on_gpu_host or skip_allowed(reason):
        return None
    return (
        "GPU-skip guard: this host has an NVIDIA GPU, yet this `gpu` test skipped: "
        f"{reason.removeprefix('Skipped: ')!r}. Only a missing optional framework "
        f"({', '.join(FRAMEWORKS)}) may skip a GPU test here; fix the CUDA layer "
        "(graphpool.device.cuda.unavailable_reason() says what failed)."
    )


def _skip_reason(longrepr: Any) -> str:
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    rep = outcome.get_result()
    if not rep.skipped or hasattr(rep, "wasxfail"):
        return
    message = verdict(item.get_closest_marker("gpu") is not None, gpu_host(), _skip_reason(rep.longrepr))
    if message is not None:
        rep.outcome = "failed"
        rep.longrepr = message
