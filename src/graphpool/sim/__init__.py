"""graphpool's simulated device: a CPU model of a CUDA device (docs/behaviour.rst).

Cheap to import (numpy only; never cuda.bindings). The ``xp`` array namespace lives in
``graphpool.xp`` (an array client, not part of the device); ``from graphpool.sim import xp``
still works, resolved on first use so that importing the device never imports the API.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

from graphpool.sim.device import SimBackend, SimDevice, configure

if TYPE_CHECKING:
    from graphpool import xp


def __getattr__(name: str) -> ModuleType:
    """``graphpool.sim.xp``: the old home of ``graphpool.xp``, forwarded on first access."""
    if name == "xp":
        module = importlib.import_module("graphpool.xp")
        globals()["xp"] = module
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["SimBackend", "SimDevice", "configure", "xp"]
