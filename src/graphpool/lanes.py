"""The compiled shim (``graphpool._torch_shim``) and its lanes, for the framework hooks.

The shim holds the C entry points that PyTorch's pluggable allocator and CuPy's
``CFunctionAllocator`` call, and one *lane* per device: the block graphpool parked last
(policy/heap.py, Note [Parking]), which the shim hands to the next request of its size and
stream, and parks again when that array or tensor dies, without calling Python. Both
frameworks share the lanes (a lane keys on the framework's raw stream handle). An allocator
is connected to its device's lane once (``binder``): it then takes the block back from the
lane before each of its own calls, so the plain-Python policy stays the one that decides.
``GRAPHPOOL_LANE=0`` (or ``GRAPHPOOL_TORCH_LANE=0``) leaves every call to the hooks.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from graphpool import routing

if TYPE_CHECKING:
    from graphpool.policy.allocator import CachingAllocator

_lock = threading.Lock()
_listening = False  # routing.on_invalidate(shim.lanes_off) registered
_owners: dict[int, CachingAllocator] = {}
"""The allocator each device's lane serves (the lanes are the process's; held, as the
frameworks hold their allocators for the process)."""


def shim(who: str = "graphpool.torch") -> Any:
    """The compiled shim module; RuntimeError naming the fix when the install has none."""
    try:
        from graphpool import _torch_shim  # type: ignore[attr-defined]
    except ImportError as e:
        raise RuntimeError(
            f"{who} needs graphpool's compiled shim (graphpool/_torch_shim, C++), which this "
            "install lacks: reinstall graphpool on a machine with a C++ compiler and without "
            "GRAPHPOOL_COMPILE=0"
        ) from e
    return _torch_shim


def enabled() -> bool:
    """Whether the lanes may answer (neither ``GRAPHPOOL_LANE`` nor ``GRAPHPOOL_TORCH_LANE`` is "0")."""
    return os.environ.get("GRAPHPOOL_LANE", "1") != "0" and os.environ.get("GRAPHPOOL_TORCH_LANE", "1") != "0"


def binder(who: str = "graphpool.torch") -> Callable[[int, CachingAllocator], None] | None:
    """``bind(device, allocator)`` for the hooks: connects the allocator to the shim's lane of
    the device (None without the compiled shim, with a shim without lanes, or with the lanes
    turned off). A lane serves one allocator: binding another first settles the one it served.
    """
    try:
        mod = shim(who)
    except RuntimeError:
        return None
    if not hasattr(mod, "lane_take"):  # a shim without lanes (a stand-in, in tests)
        return None
    if not enabled():
        mod.set_lanes_enabled(False)
        return None
    global _listening
    with _lock:
        if not _listening:
            routing.on_invalidate(mod.lanes_off)  # a kept answer no generation guards
            _listening = True

    def bind(device: int, a: CachingAllocator) -> None:
        with _lock:
            old = _owners.get(device)
            if old is a:
                return
            if old is not None:
                old.set_lane(None)  # settles its park with the lane first
            query = getattr(a.device, "capture_query_address", None)
            mod.lane_query(device, int(query()) if query is not None else 0)
            a.set_lane(functools.partial(mod.lane_take, device))
            _owners[device] = a

    return bind


__all__ = ["binder", "enabled", "shim"]
