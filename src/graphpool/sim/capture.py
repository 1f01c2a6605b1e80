"""Process-wide stream-capture state: ids, per-thread capture modes, and the unsafe-call rule.

CUDA keeps these per process, not per device: a ``cudaMalloc`` on device 1 is refused
while another thread captures on device 0 in global mode. So they live here, shared by
every ``SimDevice``, behind one module lock (taken after a device's lock, never before).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from graphpool.device.protocol import (
    CAPTURE_MODE_GLOBAL,
    CAPTURE_MODE_RELAXED,
    CAPTURE_MODE_THREAD_LOCAL,
    CAPTURE_MODES,
    CAPTURE_STATUS_ACTIVE,
    CAPTURE_STATUS_INVALIDATED,
)
from graphpool.sim.cudaerr import cuda_error

_lock = threading.Lock()
_ids = itertools.count(1)
_modes = threading.local()
_ongoing: dict[int, Capture] = {}


@dataclass(frozen=True)
class Node:
    """One graph node: a kernel (``fn``) or, when ``fn`` is None, a sleep of ``rounds`` rounds."""

    name: str
    fn: Callable[[], None] | None
    rounds: int = 0


@dataclass
class Capture:
    """One capture sequence: its graph so far and the streams taking part.

    Join tracking: ``seq[s]`` counts the work of stream ``s`` in the capture (a joined
    stream starts at 1, so a fork never joined back counts as unjoined) and ``covers[s]``
    maps each stream to the last of its ``seq`` that ``s``'s next work depends on. The
    capture can end when the origin covers every other stream's latest ``seq``.
    """

    id: int
    origin: int
    mode: int
    thread: threading.Thread  # the thread that began it (an object: idents are reused)
    status: int = CAPTURE_STATUS_ACTIVE
    nodes: list[Node] = field(default_factory=list)
    seq: dict[int, int] = field(default_factory=dict)
    covers: dict[int, dict[int, int]] = field(default_factory=dict)
    ended: bool = False
    tokens: list[int] = field(default_factory=list)  # user objects retained by its graph

    def add(self, stream: int, node: Node) -> None:
        """Append ``node``, queued on member ``stream``, to the graph."""
        self.nodes.append(node)
        self.seq[stream] += 1
        self.covers[stream][stream] = self.seq[stream]

    def join(self, stream: int, deps: dict[int, int]) -> None:
        """``stream`` now depends on ``deps`` (an event recorded in this capture); it may be new."""
        if stream not in self.seq:
            self.seq[stream] = 1
            self.covers[stream] = {stream: 1}
        mine = self.covers[stream]
        for s, n in deps.items():
            if n > mine.get(s, 0):
                mine[s] = n

    def unjoined(self) -> list[int]:
        """Member streams whose latest work the origin does not wait for."""
        done = self.covers[self.origin]
        return [s for s, n in self.seq.items() if s != self.origin and done.get(s, 0) < n]


def check_mode(call: str, mode: int) -> None:
    """Raise cudaErrorInvalidValue unless ``mode`` is one of the three capture modes."""
    if mode not in CAPTURE_MODES.values():
        raise cuda_error(call, "cudaErrorInvalidValue", f"unknown capture mode {mode!r}")


def thread_mode() -> int:
    """The calling thread's capture mode (global until changed)."""
    mode: int = getattr(_modes, "mode", CAPTURE_MODE_GLOBAL)
    return mode


def exchange_mode(mode: int) -> int:
    """Set the calling thread's capture mode; return the previous one."""
    check_mode("cudaThreadExchangeStreamCaptureMode", mode)
    old = thread_mode()
    _modes.mode = mode
    return old


def start(origin: int, mode: int) -> Capture:
    """Register a new ongoing capture begun on ``origin`` by the calling thread."""
    with _lock:
        cap = Capture(next(_ids), origin, mode, threading.current_thread())
        cap.seq[origin] = 0
        cap.covers[origin] = {origin: 0}
        _ongoing[cap.id] = cap
        return cap


def finish(cap: Capture) -> None:
    """Unregister ``cap``: it is no longer ongoing."""
    with _lock:
        cap.ended = True
        _ongoing.pop(cap.id, None)


def ongoing() -> list[Capture]:
    """Every capture begun and not yet ended, on any device (for tests and diagnostics)."""
    with _lock:
        return list(_ongoing.values())


def invalidate(cap: Capture) -> None:
    """Mark ``cap`` invalidated: its later work is dropped and ending it fails."""
    cap.status = CAPTURE_STATUS_INVALIDATED


def check_unsafe(call: str) -> None:
    """Refuse a potentially unsafe call (malloc, free, query, synchronize) CUDA would prohibit.

    The calling thread T is prohibited when its mode is global and T began an ongoing
    non-relaxed capture or another thread began an ongoing global one; when its mode is
    thread-local and T began an ongoing non-relaxed capture; never when it is relaxed.
    Raises cudaErrorStreamCaptureUnsupported and invalidates the capture(s) concerned.
    """
    mode = thread_mode()
    if mode == CAPTURE_MODE_RELAXED or not _ongoing:
        return
    me = threading.current_thread()
    with _lock:
        offending = [
            cap
            for cap in _ongoing.values()
            if (cap.thread is me and cap.mode != CAPTURE_MODE_RELAXED)
            or (mode == CAPTURE_MODE_GLOBAL and cap.thread is not me and cap.mode == CAPTURE_MODE_GLOBAL)
        ]
        for cap in offending:
            invalidate(cap)
    if offending:
        ids = ", ".join(str(c.id) for c in offending)
        raise cuda_error(
            call,
            "cudaErrorStreamCaptureUnsupported",
            f"prohibited in capture mode {_MODE_NAMES[mode]}; invalidated capture {ids}",
        )


_MODE_NAMES = {
    CAPTURE_MODE_GLOBAL: "global",
    CAPTURE_MODE_THREAD_LOCAL: "thread_local",
    CAPTURE_MODE_RELAXED: "relaxed",
}
