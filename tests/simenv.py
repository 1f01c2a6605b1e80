"""A fresh simulated backend for one test, and the check every test ends with.

Fixtures that need a small simulated device (out of memory reached quickly, several devices)
use ``fresh_sim``; tests/conftest.py's teardown uses ``settle``.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import graphpool as gp
from graphpool import runtime
from graphpool.sim import SimBackend

MiB = 1024 * 1024


def settle() -> None:
    """Collect garbage (buffers freed by finalizers), wait for the device, return the cache and
    check every allocator invariant."""
    gc.collect()
    gp.synchronize()
    gp.empty_cache()
    gp.check_invariants()


@contextmanager
def fresh_sim(device_count: int = 1, memory_bytes: int = 64 * MiB, **runtime_options: Any) -> Iterator[Any]:
    """A new simulated backend of ``device_count`` devices of ``memory_bytes`` (``runtime_options``:
    ``set_backend``'s, e.g. ``sizes``); settled on the way out, then the default backend again."""
    runtime.set_backend(
        "sim", backend=SimBackend(device_count=device_count, memory_bytes=memory_bytes), **runtime_options
    )
    try:
        yield runtime.get()
    finally:
        try:
            settle()
        finally:
            gp.set_backend("sim")
