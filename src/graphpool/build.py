"""Which build runs: the hot path compiled by mypyc (setup.py) or plain Python.

An install compiles the modules of ``COMPILED`` when it can. Built in a source tree (an
editable install, ``setup.py build_ext --inplace``) the compiled modules sit next to their
sources and are imported instead of them, so an edit to a source has no effect until the
next build. setup.py then records each source's hash in ``_compiled_sources.json``;
``stale()`` compares, and importing graphpool warns about sources that changed.
"""

from __future__ import annotations

import hashlib
import json
import os

COMPILED = (
    "policy/block",
    "policy/freelist",
    "policy/pools",
    "policy/stats",
    "policy/private_pools",
    "policy/logs",
    "policy/heap",
    "policy/captures",
    "policy/stream_uses",
    "policy/segments",
    "policy/expandable",
    "policy/reports",
    "policy/allocator",
    "routing",
    "memory",
    "buffer",
    "hooks",
)
"""The modules setup.py compiles, relative to the package (setup.py lists the same)."""

_ROOT = os.path.dirname(os.path.abspath(__file__))


def compiled() -> bool:
    """True when the allocator's hot path runs compiled by mypyc, else plain Python.

    Both builds behave the same, interrupts included, so plain Python is no reason for a
    warning: in both, graphpool guards the default SIGINT handler so that a KeyboardInterrupt
    waits until the call's update is complete (``guard_signal_handler``, docs/behaviour.rst
    "Interrupts"). Plain Python is about 10x slower per cached
    allocation and free (README, "Compiled or pure Python").
    """
    from graphpool.policy import allocator

    return not (allocator.__file__ or "").endswith(".py")


def stale() -> list[str]:
    """Compiled sources edited since they were built in this source tree. O(their size)."""
    if not compiled():
        return []
    try:
        with open(os.path.join(_ROOT, "_compiled_sources.json")) as fh:
            recorded = json.load(fh)
    except (OSError, ValueError):
        return []  # not built in a source tree (a wheel install, or plain Python)
    out = []
    for name in COMPILED:
        try:
            with open(os.path.join(_ROOT, name + ".py"), "rb") as fh:
                digest = hashlib.sha256(fh.read()).hexdigest()
        except OSError:
            continue
        if recorded.get(name) != digest:
            out.append(name + ".py")
    return out
