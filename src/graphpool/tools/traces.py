"""Allocation traces: what a real program asked of its allocator, to replay through others.

A trace is a name, a description of how it was recorded (program, tool, GPU, date) and a
list of events, each a tuple of ints:

* ``(1, id, nbytes, stream)``: an allocation of ``nbytes`` for work on stream ``stream``
  (an index, 0 for the program's first stream, in order of first appearance);
* ``(0, id)``: the free of the live allocation ``id``.

An id is unique while its allocation is live and may be reused after its free. An
allocation still live at the end has no free: a replay frees the leftovers at its end.
On disk a trace is gzip-compressed JSON with the events as flat lists
(``[1, id, nbytes, stream]`` / ``[0, id]``); the traces shipped with graphpool live in
``graphpool/tools/trace_data/<name>.json.gz`` (``available()``, ``load(name)``) and are made by
``benchmarks/record_traces.py``. ``python -m graphpool bench`` replays them through
graphpool and the allocators it is compared with.

Sources: ``from_torch_snapshot`` converts PyTorch's ``torch.cuda.memory._snapshot()``,
``RecordingAllocator`` records a CuPy program, ``synthetic`` makes a seeded, deterministic
mix. Plain standard-library Python: no NumPy, no GPU.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import random
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

FORMAT = "graphpool-trace"
VERSION = 1
ALLOC = 1
FREE = 0
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_DATA_DIR = "trace_data"
_SUFFIX = ".json.gz"

Event = tuple[int, ...]
"""``(1, id, nbytes, stream)`` or ``(0, id)``."""


@dataclass
class Trace:
    """A named list of alloc/free events and how they were recorded.

    ``description`` says in words what program made it and how; ``info`` holds the same
    facts as fields (program, tool, versions, device, date...) for machines.
    """

    name: str
    description: str
    events: list[Event]
    info: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """The fields' types (TypeError naming the field); ``validate`` checks the events."""
        _check_fields(self)

    @property
    def allocations(self) -> int:
        """How many allocation events the trace has."""
        return sum(1 for e in self.events if e[0] == ALLOC)

    @property
    def streams(self) -> int:
        """How many streams the allocations use (the largest stream index + 1; 0 if none)."""
        return max((e[3] + 1 for e in self.events if e[0] == ALLOC), default=0)

    def __repr__(self) -> str:
        return f"Trace({self.name!r}, {len(self.events)} events, {self.streams} stream(s))"


# ----------------------------------------------------------------------------- checks
def _check_name(name: object) -> None:
    if not isinstance(name, str):
        raise TypeError(f"a trace name must be a str, not {type(name).__name__}")
    if not _NAME.match(name):
        raise ValueError(
            f"trace name {name!r}: use letters, digits, '_', '-' and '.', starting with a letter or digit"
        )


def _check_fields(trace: Trace) -> None:
    if not isinstance(trace.name, str):
        raise TypeError(f"Trace.name must be a str, not {type(trace.name).__name__}")
    if not isinstance(trace.description, str):
        raise TypeError(f"Trace.description must be a str, not {type(trace.description).__name__}")
    if not isinstance(trace.events, list | tuple):
        raise TypeError(f"Trace.events must be a list of events, not {type(trace.events).__name__}")
    _check_info(trace.info, "Trace.info")


def _check_info(info: object, what: str) -> None:
    if not isinstance(info, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in info.items()
    ):
        raise TypeError(f"{what} must be a dict of str to str, not {info!r:.80}")


def _trace(trace: object, call: str) -> Trace:
    """``trace`` if it is a Trace (TypeError naming ``call`` otherwise), its fields' types checked."""
    if not isinstance(trace, Trace):
        raise TypeError(f"graphpool.traces.{call} needs a Trace, not {type(trace).__name__}")
    _check_fields(trace)
    return trace


def _check_count(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, not {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{what} must be >= 0, not {value}")
    return value


def _check_path(path: object, call: str) -> Path:
    if not isinstance(path, str | os.PathLike):
        raise TypeError(
            f"graphpool.traces.{call} needs a file path (str or os.PathLike), not {type(path).__name__}"
        )
    return Path(path)


def validate(trace: Trace) -> None:
    """Raise ValueError, naming the first bad event, unless every event is well formed,
    every size and stream index is >= 0, every alloc's id is not live already and every
    free frees a live allocation (TypeError if ``trace`` is not a Trace)."""
    _trace(trace, "validate")
    _check_name(trace.name)
    for _ in _walk(trace.events):
        pass


def _walk(events: Iterable[Event]) -> Iterator[tuple[int, int]]:
    """Check the events in order; yield (event index, live requested bytes after it)."""
    live: dict[int, tuple[int, int]] = {}  # id -> (nbytes, index of its alloc)
    total = 0
    for i, e in enumerate(events):
        if not isinstance(e, tuple | list) or not all(type(v) is int for v in e):
            raise ValueError(f"trace event {i}: {e!r} is not a tuple of ints")
        if len(e) == 4 and e[0] == ALLOC:
            _, ident, nbytes, stream = e
            if nbytes < 0:
                raise ValueError(f"trace event {i}: alloc of id {ident} has a negative size {nbytes}")
            if stream < 0:
                raise ValueError(f"trace event {i}: alloc of id {ident} has a negative stream index {stream}")
            if ident in live:
                raise ValueError(
                    f"trace event {i}: alloc of id {ident}, which is still live (allocated at event "
                    f"{live[ident][1]} and not freed since)"
                )
            live[ident] = (nbytes, i)
            total += nbytes
        elif len(e) == 2 and e[0] == FREE:
            ident = e[1]
            got = live.pop(ident, None)
            if got is None:
                raise ValueError(f"trace event {i}: free of id {ident}, which is not live")
            total -= got[0]
        else:
            raise ValueError(f"trace event {i}: {e!r} is neither [1, id, nbytes, stream] nor [0, id]")
        yield i, total


def peak_live_bytes(trace: Trace) -> int:
    """The most bytes requested and not yet freed at any point of the trace (ValueError if invalid)."""
    _trace(trace, "peak_live_bytes")
    return max((total for _, total in _walk(trace.events)), default=0)


def summary(trace: Trace) -> dict[str, Any]:
    """Counts a reader wants first: events, allocations, streams, distinct sizes, peak live
    bytes, and allocations left live at the end (ValueError if the trace is invalid)."""
    validate(_trace(trace, "summary"))
    live: set[int] = set()
    sizes: set[int] = set()
    for e in trace.events:
        if e[0] == ALLOC:
            live.add(e[1])
            sizes.add(e[2])
        else:
            live.discard(e[1])
    return {
        "name": trace.name,
        "events": len(trace.events),
        "allocations": trace.allocations,
        "streams": trace.streams,
        "distinct sizes": len(sizes),
        "peak live bytes": peak_live_bytes(trace),
        "live at the end": len(live),
    }


def truncated(trace: Trace, max_events: int) -> Trace:
    """The trace's first ``max_events`` events (still valid: a prefix frees nothing unknown;
    allocations it cuts off before their free become leftovers)."""
    _trace(trace, "truncated")
    _check_count(max_events, "max_events")
    if len(trace.events) <= max_events:
        return trace
    info = dict(trace.info, truncated=f"first {max_events} of {len(trace.events)} events")
    return Trace(trace.name, trace.description, trace.events[:max_events], info)


# ----------------------------------------------------------------------------- files
def save(trace: Trace, path: str | Path) -> None:
    """Write ``trace`` (validated first) to ``path`` as gzip-compressed JSON.

    The bytes depend on the trace only (no timestamp in the gzip header), so saving the
    same trace twice gives the same file.
    """
    validate(_trace(trace, "save"))
    target = _check_path(path, "save")
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "name": trace.name,
        "description": trace.description,
        "info": trace.info,
        "events": trace.events,
    }
    text = json.dumps(doc, separators=(",", ":"))
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as gz:
        gz.write(text.encode())
    target.write_bytes(buf.getvalue())


def read(path: str | Path) -> Trace:
    """Read a trace that ``save`` wrote (ValueError if it is not one, or not valid; OSError if
    the file cannot be read)."""
    return _parse(_check_path(path, "read").read_bytes(), str(path))


def _parse(data: bytes, where: str) -> Trace:
    try:
        doc = json.loads(gzip.decompress(data))
    except (OSError, EOFError, ValueError) as exc:
        raise ValueError(f"{where}: not a gzip-compressed JSON trace ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f'{where}: not a graphpool trace (no "format": "{FORMAT}")')
    if doc.get("version") != VERSION:
        raise ValueError(
            f"{where}: trace format version {doc.get('version')!r}, this graphpool reads {VERSION}"
        )
    info = doc.get("info") or {}
    events = doc.get("events")
    if not isinstance(events, list) or not all(isinstance(e, list) for e in events):
        raise ValueError(f'{where}: "events" is not a list of [1, id, nbytes, stream] / [0, id] lists')
    if not isinstance(info, dict):
        raise ValueError(f'{where}: "info" is not an object')
    name = doc.get("name")
    if not isinstance(name, str):
        raise ValueError(f'{where}: "name" is not a str')
    try:
        trace = Trace(
            name=name,
            description=str(doc.get("description", "")),
            events=[tuple(e) for e in events],
            info={str(k): str(v) for k, v in info.items()},
        )
        validate(trace)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None
    return trace


def _data_dir() -> Any:
    return resources.files("graphpool.tools").joinpath(_DATA_DIR)


def available() -> list[str]:
    """Names of the traces shipped with graphpool (``graphpool/tools/trace_data``), sorted."""
    root = _data_dir()
    if not root.is_dir():
        return []
    return sorted(p.name[: -len(_SUFFIX)] for p in root.iterdir() if p.name.endswith(_SUFFIX))


def load(name: str) -> Trace:
    """The shipped trace ``name`` (one of ``available()``)."""
    _check_name(name)
    entry = _data_dir().joinpath(name + _SUFFIX)
    if not entry.is_file():
        have = ", ".join(available()) or "none"
        raise ValueError(f"no shipped trace named {name!r} (available: {have})")
    return _parse(entry.read_bytes(), f"trace {name!r}")


# ----------------------------------------------------------------------------- synthetic
KiB = 1024
MiB = 1024 * KiB


def synthetic(
    seed: int,
    n_ops: int = 20000,
    *,
    streams: int = 1,
    name: str | None = None,
) -> Trace:
    """A seeded, deterministic trace of ``n_ops`` events shaped like a training loop.

    A made-up model (16-48 layers) holds long-lived weights, then steps run until the
    trace is long enough: the forward pass keeps one activation per layer (freed in
    reverse order by the backward pass: LIFO) and makes short-lived temporaries around
    it; a fifth of the steps scale the activations (another batch shape); now and then a
    long-lived buffer is replaced. Sizes: mostly small (512 B-1 MiB, log-uniform), some
    large (1-64 MiB), a few very large (64-360 MiB). ``streams=2`` puts side buffers
    (prefetches, communication buckets) on a second stream, each live for a few layers.
    Allocations live when the trace ends (the weights) have no free.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, not {type(seed).__name__}")
    _check_count(n_ops, "n_ops")
    if isinstance(streams, bool) or not isinstance(streams, int):
        raise TypeError(f"streams must be an int (1 or 2), not {type(streams).__name__}")
    if streams not in (1, 2):
        raise ValueError(f"streams must be 1 or 2, not {streams!r}")
    if name is not None:
        _check_name(name)
    rng = random.Random(seed)

    def small() -> int:
        return max(512, int(2 ** rng.uniform(9, 20)) & ~15)

    def large() -> int:
        return int(2 ** rng.uniform(20, 26)) & ~511

    def huge() -> int:
        return int(2 ** rng.uniform(26, 28.5)) & ~4095

    def mixed(p_large: float, p_huge: float) -> int:
        r = rng.random()
        return huge() if r < p_huge else large() if r < p_huge + p_large else small()

    layers = []
    for _ in range(rng.randint(16, 48)):
        layers.append(
            (
                [mixed(0.3, 0.0) for _ in range(rng.randint(1, 3))],  # weights (long-lived)
                mixed(0.28, 0.02),  # activation kept for the backward pass
                [mixed(0.12, 0.0) for _ in range(rng.randint(1, 4))],  # forward temporaries
                [mixed(0.15, 0.0) for _ in range(rng.randint(1, 3))],  # backward temporaries
            )
        )
    events: list[Event] = []
    free_ids: list[int] = []  # ids free for reuse, most recently freed last
    counter = 0

    def alloc(nbytes: int, stream: int = 0) -> int:
        nonlocal counter
        if free_ids and rng.random() < 0.5:
            ident = free_ids.pop()
        else:
            ident = counter
            counter += 1
        events.append((ALLOC, ident, nbytes, stream))
        return ident

    def free(ident: int) -> None:
        events.append((FREE, ident))
        free_ids.append(ident)

    def scaled(nbytes: int, scale: float) -> int:
        return nbytes if scale == 1.0 else max(512, int(nbytes * scale) & ~15)

    weights = [alloc(w) for layer in layers for w in layer[0]]
    weight_sizes = [w for layer in layers for w in layer[0]]
    side: list[tuple[int, int]] = []  # (layer count at which it is freed, id) on stream 1
    clock = 0

    def tick() -> None:
        nonlocal clock
        clock += 1
        if side:
            due = [s for s in side if s[0] <= clock]
            for s in due:
                side.remove(s)
                free(s[1])
        if streams == 2 and rng.random() < 0.3:
            side.append((clock + rng.randint(1, 4), alloc(mixed(0.25, 0.0), 1)))

    while len(events) < n_ops:
        scale = rng.choice((0.5, 0.75, 1.25)) if rng.random() < 0.2 else 1.0
        stack = []
        for _, act, temps, _ in layers:  # forward
            stack.append(alloc(scaled(act, scale)))
            ids = [alloc(scaled(t, scale)) for t in temps]
            for ident in reversed(ids) if rng.random() < 0.8 else ids:
                free(ident)
            tick()
        for _, _, _, grads in reversed(layers):  # backward
            ids = [alloc(scaled(g, scale)) for g in grads]
            free(stack.pop())
            for ident in reversed(ids):
                free(ident)
            tick()
        for i in rng.sample(range(len(weights)), k=max(1, len(weights) // 4)):  # optimizer temps
            free(alloc(weight_sizes[i]))
        if rng.random() < 0.1:  # a long-lived buffer replaced (a cache resized, say)
            i = rng.randrange(len(weights))
            free(weights[i])
            weight_sizes[i] = scaled(weight_sizes[i], rng.choice((0.5, 2.0)))
            weights[i] = alloc(weight_sizes[i])
    n_streams = "one stream" if streams == 1 else "two streams"
    return Trace(
        name=name or (f"synthetic-{seed}" if streams == 1 else f"synthetic-{seed}-2s"),
        description=(
            f"graphpool.traces.synthetic(seed={seed}, n_ops={n_ops}, streams={streams}): a made-up "
            f"training loop on {n_streams} ({len(layers)} layers; LIFO activations, short-lived "
            "temporaries, long-lived weights), deterministic per seed"
        ),
        events=events[:n_ops],
        info={"program": "graphpool.traces.synthetic", "seed": str(seed), "n_ops": str(n_ops)},
    )


# ----------------------------------------------------------------------------- PyTorch
_TORCH_IGNORED = frozenset(
    (
        "free_completed",
        "segment_alloc",
        "segment_free",
        "segment_map",
        "segment_unmap",
        "stream_take",
        "snapshot",
        "oom",
    )
)


def from_torch_snapshot(
    snapshot: dict[str, Any],
    device: int = 0,
    name: str = "torch",
    description: str = "",
    info: dict[str, str] | None = None,
) -> Trace:
    """Convert ``torch.cuda.memory._snapshot()`` (recorded with ``_record_memory_history``).

    ``snapshot["device_traces"][device]`` lists the allocator's actions in order. ``alloc``
    becomes an allocation (a new id for that address; ``size`` is the requested size),
    ``free_requested`` the free of the allocation live at that address. ``free_completed``
    (the block actually reusable, later for a block used on other streams), segment
    events (cudaMalloc/cudaFree, expandable-segment map/unmap), ``snapshot`` and ``oom``
    are the allocator's own doing, not the program's: ignored. Stream handles become
    indices in order of first appearance. A free of an address the trace never saw
    allocated (history kept only the last ``max_entries`` actions) is dropped, as is an
    action this version does not know; ``info`` counts both.
    """
    if not isinstance(snapshot, dict):
        raise TypeError(
            "from_torch_snapshot needs the dict torch.cuda.memory._snapshot() returns, not "
            f"{type(snapshot).__name__}"
        )
    _check_name(name)
    if not isinstance(description, str):
        raise TypeError(f"description must be a str, not {type(description).__name__}")
    if info is not None:
        _check_info(info, "info")
    traces = snapshot.get("device_traces")
    if not isinstance(traces, list):
        raise ValueError("not a torch.cuda.memory._snapshot() dict: no 'device_traces' list")
    if isinstance(device, bool) or not isinstance(device, int):
        raise TypeError(f"device must be an int, not {type(device).__name__}")
    if not 0 <= device < len(traces):
        raise ValueError(f"device {device}: the snapshot has traces for {len(traces)} device(s)")
    if not isinstance(traces[device], list):
        raise ValueError(f"device_traces[{device}] is not a list of actions")
    events: list[Event] = []
    by_addr: dict[int, int] = {}  # address -> id of the allocation live there
    stream_index: dict[int, int] = {}
    dropped_frees = replaced = unknown = next_id = 0
    for i, entry in enumerate(traces[device]):
        if not isinstance(entry, dict):
            raise ValueError(f"device_traces[{device}][{i}] is not an action dict: {entry!r:.80}")
        action = entry.get("action")
        if action not in ("alloc", "free_requested"):
            if action not in _TORCH_IGNORED:
                unknown += 1
            continue
        try:
            addr = int(entry["addr"])
            if action == "alloc":
                size, handle = int(entry["size"]), int(entry.get("stream", 0))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"device_traces[{device}][{i}]: an {action!r} action needs an int 'addr' (and, to "
                f"allocate, 'size' and 'stream'): {type(exc).__name__}: {exc}"
            ) from None
        if action == "alloc":
            old = by_addr.pop(addr, None)
            if old is not None:  # its free fell out of the history: free it here
                events.append((FREE, old))
                replaced += 1
            stream = stream_index.setdefault(handle, len(stream_index))
            ident = next_id  # ids count up, never reused
            next_id += 1
            by_addr[addr] = ident
            events.append((ALLOC, ident, size, stream))
        else:
            got = by_addr.pop(addr, None)
            if got is None:
                dropped_frees += 1
            else:
                events.append((FREE, got))
    facts = {"tool": "torch.cuda.memory._snapshot", "device": str(device)}
    facts.update(info or {})
    if dropped_frees:
        facts["frees of allocations made before the history dropped"] = str(dropped_frees)
    if replaced:
        facts["allocations freed where their address was reused (free missing)"] = str(replaced)
    if unknown:
        facts["actions of unknown kind ignored"] = str(unknown)
    trace = Trace(name, description, events, facts)
    validate(trace)
    return trace


# ----------------------------------------------------------------------------- CuPy
class RecordingAllocator:
    """Records a CuPy program's allocations while a ``cupy.cuda.MemoryPool`` serves them.

    ::

        rec = RecordingAllocator()
        with rec:  # CuPy allocates through the recorder inside the block
            run_the_workload()
        trace = rec.trace("cupy-fft", "what ran, on which GPU")

    The recorder is a ``cupy.cuda.memory.PythonFunctionAllocator`` whose malloc and free
    log an event and pass the request to the pool (its current stream at malloc is the
    event's stream). CuPy is imported when one is made, not with this module.
    """

    def __init__(self, pool: Any = None) -> None:
        import cupy

        self._cupy = cupy
        self.pool = pool if pool is not None else cupy.cuda.MemoryPool()
        self.events: list[Event] = []
        self._live: dict[int, tuple[int, Any]] = {}  # address -> (id, the pool's MemoryPointer)
        self._streams: dict[int, int] = {}
        self._next_id = 0
        self.unknown_frees = 0
        self.allocator = cupy.cuda.memory.PythonFunctionAllocator(self._malloc, self._free)
        self._previous: Any = None

    def _malloc(self, size: int, device_id: int) -> int:
        mem = self.pool.malloc(size)
        ptr = int(mem.ptr)
        handle = int(self._cupy.cuda.get_current_stream().ptr)
        stream = self._streams.setdefault(handle, len(self._streams))
        ident = self._next_id
        self._next_id += 1
        self._live[ptr] = (ident, mem)
        self.events.append((ALLOC, ident, int(size), stream))
        return ptr

    def _free(self, ptr: int, device_id: int) -> None:
        got = self._live.pop(int(ptr), None)
        if got is None:  # not ours (made before recording began): nothing to log
            self.unknown_frees += 1
            return
        self.events.append((FREE, got[0]))
        # dropping got[1], the pool's MemoryPointer, hands the block back to the pool

    def __enter__(self) -> RecordingAllocator:
        self._previous = self._cupy.cuda.get_allocator()
        self._cupy.cuda.set_allocator(self.allocator.malloc)
        return self

    def __exit__(self, *exc: object) -> None:
        self._cupy.cuda.set_allocator(self._previous)

    def trace(self, name: str, description: str, info: dict[str, str] | None = None) -> Trace:
        """The events so far as a Trace (allocations still live stay unfreed)."""
        facts = {"tool": "graphpool.traces.RecordingAllocator (cupy PythonFunctionAllocator)"}
        facts.update(info or {})
        t = Trace(name, description, list(self.events), facts)
        validate(t)
        return t


__all__ = [
    "ALLOC",
    "FORMAT",
    "FREE",
    "VERSION",
    "Event",
    "KiB",
    "MiB",
    "RecordingAllocator",
    "Trace",
    "available",
    "from_torch_snapshot",
    "load",
    "peak_live_bytes",
    "read",
    "save",
    "summary",
    "synthetic",
    "truncated",
    "validate",
]
