"""The allocator's history: a bounded ring buffer of events, in PyTorch's trace layout.

``gp.record_memory_history()`` gives each device's allocator a ``History``; while it has
one, the allocator records every allocation, free, segment allocation and release,
out-of-memory error, capture begin and end, and private pool creation and release.
Each event is a dict of PyTorch's ``device_traces`` entries (``action``, ``addr``,
``size``, ``stream``, ``time_us``, ``frames``) plus graphpool's ``device`` and
``pool_id`` (the private pool's id as a plain tuple, None for the ordinary pool).

Actions, PyTorch's names: ``alloc`` (``size`` is the bytes asked for), ``free_requested``
(the user freed it) and ``free_completed`` (it went back to its pool: at once, or when the
stream uses or the graphs holding it are done), ``segment_alloc``, ``segment_free``,
``oom`` (``device_free`` in place of ``addr``, as PyTorch). Graphpool's own, which
PyTorch's viewers list as plain events: ``capture_begin``, ``capture_end``,
``pool_create``, ``pool_release`` (``addr`` and ``size`` 0).

Stacks (``stacks=True``): the Python frames that led to the event, innermost first, at
most ``MAX_FRAMES``, without the frames of graphpool's allocator modules (the policy and
the modules compiled with it, which have no frames at all when compiled), so a stack is
the same in either build. Frame dicts are shared between events (one per code line).
Every value is a plain int, str, tuple, list, dict, bool or None: the pickle of a
snapshot loads without graphpool.
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from types import CodeType
from typing import Any

from graphpool.policy.private_pools import PrivatePool

Frame = dict[str, Any]
"""``{"filename": str, "line": int, "name": str}``, PyTorch's frame dict."""

Entry = dict[str, Any]
"""One event of ``device_traces``."""

MAX_FRAMES = 64
"""The deepest stack an event keeps (innermost frames first)."""

_POLICY = os.path.dirname(__file__)
_PACKAGE = os.path.dirname(_POLICY)
SKIPPED_DIR = _POLICY + os.sep
SKIPPED_FILES = frozenset(
    os.path.join(_PACKAGE, name) for name in ("routing.py", "memory.py", "buffer.py", "hooks.py")
)
"""Frames of these files are left out of stacks: the policy package, and the modules
``graphpool.build.COMPILED`` compiles with it (a test keeps the two in step)."""

_CACHE_LIMIT = 100_000  # distinct (code, line) pairs before the frame cache starts over


def pool_key(pool: PrivatePool | None) -> tuple[int, int] | None:
    """A private pool's id as a plain tuple (None for the ordinary pool)."""
    return None if pool is None else (pool.id.graph, pool.id.handle)


class History:
    """The events of one device, newest last, at most ``max_entries`` (the oldest go first).

    Also the stacks of live blocks and segments (``block_frames``, ``segment_frames``,
    by address), for the snapshot's ``frames`` keys. The allocator calls it under its lock.
    """

    __slots__ = ("device", "entries", "stacks", "block_frames", "segment_frames", "_frames")

    def __init__(self, device: int, max_entries: int, stacks: bool) -> None:
        self.device = device
        self.entries: deque[Entry] = deque(maxlen=max_entries)
        self.stacks = stacks
        self.block_frames: dict[int, list[Frame]] = {}
        self.segment_frames: dict[int, list[Frame]] = {}
        self._frames: dict[tuple[CodeType, int], Frame | None] = {}  # (code, instruction) -> frame

    def configure(self, max_entries: int, stacks: bool) -> None:
        """Change the bound (keeping the newest events) and whether stacks are recorded."""
        if max_entries != self.entries.maxlen:
            self.entries = deque(self.entries, maxlen=max_entries)
        self.stacks = stacks

    def stack(self) -> list[Frame]:
        """The caller's Python stack, innermost first, without graphpool's allocator frames."""
        out: list[Frame] = []
        cache = self._frames
        if len(cache) > _CACHE_LIMIT:
            cache.clear()
        f = sys._getframe(1)
        while f is not None and len(out) < MAX_FRAMES:
            code = f.f_code
            key = (code, f.f_lasti)  # the instruction, not f_lineno: that costs 0.3 us a frame
            if key in cache:
                frame = cache[key]
            else:
                name = code.co_filename
                skip = name.startswith(SKIPPED_DIR) or name in SKIPPED_FILES
                frame = None if skip else {"filename": name, "line": f.f_lineno, "name": code.co_name}
                cache[key] = frame
            if frame is not None:
                out.append(frame)
            f = f.f_back  # type: ignore[assignment]
        return out

    def record(
        self,
        action: str,
        addr: int,
        size: int,
        stream: int,
        pool: PrivatePool | None,
        addr_key: str = "addr",
        frames: list[Frame] | None = None,
        **extra: Any,
    ) -> list[Frame]:
        """Append one event with ``frames`` (default: the caller's stack, or none without
        stacks); return its frames."""
        if frames is None:
            frames = self.stack() if self.stacks else []
        entry: Entry = {
            "action": action,
            addr_key: addr,
            "size": size,
            "stream": stream,
            "time_us": time.time_ns() // 1000,
            "frames": frames,
            "device": self.device,
            "pool_id": pool_key(pool),
        }
        if extra:
            entry.update(extra)
        self.entries.append(entry)
        return frames

    # ------------------------------------------------------------ one per action
    def alloc(self, ptr: int, requested: int, stream: int, pool: PrivatePool | None) -> None:
        """A block handed out (``requested``: the bytes asked for, PyTorch's ``size``)."""
        frames = self.record("alloc", ptr, requested, stream, pool)
        if self.stacks:
            self.block_frames[ptr] = frames

    def free_requested(self, ptr: int, requested: int, stream: int, pool: PrivatePool | None) -> list[Frame]:
        """The user freed the block at ``ptr``; returns the event's frames."""
        return self.record("free_requested", ptr, requested, stream, pool)

    def free_completed(
        self,
        ptr: int,
        requested: int,
        stream: int,
        pool: PrivatePool | None,
        frames: list[Frame] | None = None,
    ) -> None:
        """The block at ``ptr`` went back to its pool (``frames``: those of its
        ``free_requested`` when both happen in one call)."""
        self.record("free_completed", ptr, requested, stream, pool, frames=frames)
        self.block_frames.pop(ptr, None)

    def segment_alloc(self, ptr: int, size: int, stream: int, pool: PrivatePool | None) -> None:
        """A segment of ``size`` bytes came from the driver."""
        frames = self.record("segment_alloc", ptr, size, stream, pool)
        if self.stacks:
            self.segment_frames[ptr] = frames

    def segment_free(self, ptr: int, size: int, stream: int, pool: PrivatePool | None) -> None:
        """A segment went back to the driver."""
        self.record("segment_free", ptr, size, stream, pool)
        self.segment_frames.pop(ptr, None)

    def oom(self, requested: int, stream: int, device_free: int, pool: PrivatePool | None) -> None:
        """An out-of-memory error: PyTorch's entry has ``device_free`` in place of ``addr``."""
        self.record("oom", device_free, requested, stream, pool, "device_free")

    def capture(
        self, action: str, stream: int, pool: PrivatePool, capture_id: int, label: str, **extra: Any
    ) -> None:
        """``capture_begin`` or ``capture_end`` of capture ``capture_id`` (graph ``label``)."""
        self.record(action, 0, 0, stream, pool, capture_id=capture_id, graph=label, **extra)

    def pool(self, action: str, pool: PrivatePool) -> None:
        """``pool_create`` or ``pool_release`` of a private pool."""
        self.record(action, 0, 0, 0, pool)
