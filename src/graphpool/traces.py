"""``graphpool.traces``: the allocation traces (format, recorders, synthetic traces, the
shipped ones), whose home is ``graphpool.tools.traces``; this name stays importable."""

from graphpool.tools.traces import *  # noqa: F403
from graphpool.tools.traces import __all__ as __all__
