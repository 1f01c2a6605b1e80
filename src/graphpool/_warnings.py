"""Warnings that point at the caller's line, not into graphpool's own files.

A fixed ``stacklevel`` is right for one call path only: the same warning raised through
``gp.graph(...).__exit__`` or a finalizer drained by the allocator would blame a
graphpool file. ``warn`` counts the frames that lie inside the graphpool package (and
Python's import machinery, which ``warnings`` skips itself) and warns at the first frame
outside it.
"""

from __future__ import annotations

import os
import sys
import warnings

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def stacklevel() -> int:
    """The ``stacklevel`` that makes a ``warnings.warn`` made by the caller of this function
    point at the first frame outside graphpool. Frames of Python's import machinery are not
    counted: ``warnings`` skips them itself."""
    frame = sys._getframe(1)  # the function that will call warnings.warn: level 1
    level = 1
    while frame is not None:
        name = frame.f_code.co_filename
        if "importlib" in name and "_bootstrap" in name:
            frame = frame.f_back  # type: ignore[assignment]
            continue
        if not name.startswith(_PACKAGE):
            break
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the first caller outside graphpool."""
    warnings.warn(message, category, stacklevel=stacklevel())


__all__ = ["stacklevel", "warn"]
