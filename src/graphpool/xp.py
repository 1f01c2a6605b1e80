"""``graphpool.xp``: the older name of ``graphpool.sim.xp``, the CuPy-like arrays on the
simulated device (``from graphpool import xp`` keeps working; new code imports
``from graphpool.sim import xp``)."""

from graphpool.sim.xp import *  # noqa: F403
from graphpool.sim.xp import __all__ as __all__
