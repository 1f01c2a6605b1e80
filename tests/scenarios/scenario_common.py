"""Helpers shared by the scenario tests: settle the device, read arrays of either backend."""

from __future__ import annotations

import gc
from typing import Any

import graphpool as gp


def settle() -> int:
    """Collect, synchronize and empty the cache; return what stays reserved."""
    gc.collect()
    gp.synchronize()
    gp.empty_cache()
    return gp.memory_reserved()


def total(arr: Any) -> float:
    """The sum of an array (CuPy's or graphpool.sim.xp's), on the host."""
    return float(arr.sum().item())


def ptr(arr: Any) -> int:
    """The device address of an array's data."""
    return int(arr.data.ptr)
