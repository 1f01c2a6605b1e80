"""The policy's logger, and a level test that runs no Python code compiled.

Slow paths only (segments, captures, pools, out-of-memory, limits) log, each behind an
``enabled`` test: the cached malloc and free never touch the logger (docs/behaviour.rst,
"Logging"). Every layer of the allocator reads ``logs.log`` and ``logs.enabled`` through
this module, so a test can stand in for the logger in one place.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("graphpool")
_cached: Any = getattr(log, "_cache", None)
LEVELS: dict[int, bool] = _cached if isinstance(_cached, dict) else {}
"""The logger's own cache of ``isEnabledFor`` answers (cleared in place on level changes)."""
log.isEnabledFor(logging.DEBUG)  # fill it for the levels the allocator tests
log.isEnabledFor(logging.INFO)


def enabled(level: int) -> bool:
    """``log.isEnabledFor(level)``, read from the logger's cache when it holds the answer.

    Compiled, that read runs no Python code, so no signal handler can run inside it (Python
    runs handlers between bytecodes, and ``isEnabledFor`` is bytecode): the allocator tests the
    level in the middle of updates, where a KeyboardInterrupt would leave a block filed
    nowhere. A miss (the first test after a level change) asks the logger itself, which
    fills the cache.
    """
    if log.disabled:
        return False
    hit = LEVELS.get(level)
    return log.isEnabledFor(level) if hit is None else hit
