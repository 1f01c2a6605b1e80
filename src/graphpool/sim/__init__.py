"""graphpool's simulated device: a CPU model of a CUDA device (docs/behaviour.rst).

Cheap to import (numpy only; never cuda.bindings). The ``xp`` array namespace
(``from graphpool.sim import xp``) is a submodule that allocates through graphpool's public
API, so it sits above the API in the import graph; importing the device does not import it.
"""

from __future__ import annotations

from graphpool.sim.device import SimBackend, SimDevice, configure

__all__ = ["SimBackend", "SimDevice", "configure"]
