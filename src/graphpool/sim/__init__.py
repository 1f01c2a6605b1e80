"""graphpool's simulated device: a CPU model of a CUDA device, and the ``xp`` array namespace.

Cheap to import (numpy only; never cuda.bindings). See SPEC section 6.
"""

from __future__ import annotations

from graphpool.sim import xp
from graphpool.sim.device import SimBackend, SimDevice, configure

__all__ = ["SimBackend", "SimDevice", "configure", "xp"]
