"""Which build runs: the hot path compiled by mypyc (setup.py) or plain Python.

An install compiles the modules of ``COMPILED`` when it can. In a source tree (an editable
install) the compiled modules sit next to their sources and are imported instead of them,
so an edit to a source has no effect until the next install: ``stale()`` finds those, and
importing graphpool warns about them.
"""

from __future__ import annotations

import os

COMPILED = (
    "policy/block",
    "policy/freelist",
    "policy/pools",
    "policy/stats",
    "policy/private_pools",
    "policy/allocator",
    "memory",
    "buffer",
)
"""The modules setup.py compiles, relative to the package (setup.py lists the same)."""

_ROOT = os.path.dirname(os.path.abspath(__file__))


def compiled() -> bool:
    """True when the allocator's hot path runs compiled by mypyc, else plain Python."""
    from graphpool.policy import allocator

    return not (allocator.__file__ or "").endswith(".py")


def stale() -> list[str]:
    """Sources in a source tree edited after their compiled module was built. O(files)."""
    if not os.path.exists(os.path.join(_ROOT, os.pardir, os.pardir, "setup.py")):
        return []  # an installed package: sources and compiled modules come together
    out = []
    for name in COMPILED:
        source = os.path.join(_ROOT, name + ".py")
        folder, stem = os.path.split(source[: -len(".py")])
        try:
            prefix = stem + "."
            built = [e.path for e in os.scandir(folder) if e.name.startswith(prefix) and e.name[-3:] == ".so"]
            if built and os.path.getmtime(source) > max(os.path.getmtime(p) for p in built):
                out.append(name + ".py")
        except OSError:
            continue
    return out
