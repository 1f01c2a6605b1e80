"""Fixtures for the simulated device's own tests: fresh devices, and no capture left behind."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

try:
    import graphpool.sim  # noqa: F401
except ImportError:  # not installed: run from the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from graphpool.device.protocol import CAPTURE_MODE_GLOBAL
from graphpool.sim import SimBackend, SimDevice, capture

MiB = 1024 * 1024


@pytest.fixture(autouse=True)
def _no_capture_left_behind() -> Iterator[None]:
    """Capture state is process-wide: fail a test that leaves a capture open, then clean up."""
    yield
    leftover = capture.ongoing()
    for cap in leftover:
        capture.finish(cap)
    capture.exchange_mode(CAPTURE_MODE_GLOBAL)
    assert not leftover, f"test left captures open: {[c.id for c in leftover]}"


@pytest.fixture
def backend() -> SimBackend:
    return SimBackend(device_count=2, memory_bytes=64 * MiB)


@pytest.fixture
def dev(backend: SimBackend) -> SimDevice:
    return backend.get_device(0)
