"""Readable views of the allocator: ``memory_summary()``, the ``snapshot`` command, and the
history with snapshots in PyTorch's layout (``record_memory_history()``,
``torch_snapshot()``, ``dump_snapshot()``; the events themselves: policy/history.py)."""

from __future__ import annotations

import json
import os
import pickle
import sys
from typing import Any

from graphpool import runtime
from graphpool.policy.limits import AllocConf
from graphpool.policy.stats import SCALAR_NAMES
from graphpool.policy.units import fmt_bytes

ROWS = (
    ("Allocated memory", "allocated_bytes", True),
    ("Active memory", "active_bytes", True),
    ("Requested memory", "requested_bytes", True),
    ("Reserved memory", "reserved_bytes", True),
    ("Non-releasable memory", "inactive_split_bytes", True),
    ("Allocations", "allocation", False),
    ("Active allocs", "active", False),
    ("Segments", "segment", False),
    ("Non-releasable allocs", "inactive_split", False),
)


def summary(device: int, stats: dict[str, int]) -> str:
    """A table of every statistic: current, peak, allocated and freed, for all/small/large."""
    width = 84
    lines = [
        "=" * width,
        f" graphpool memory summary, device {device}".ljust(width),
        "-" * width,
        f"{'Metric':<28}{'Cur Usage':>14}{'Peak Usage':>14}{'Tot Alloc':>14}{'Tot Freed':>14}",
        "-" * width,
    ]
    for title, stat, is_bytes in ROWS:
        kinds = (("all", title), ("large_pool", "  from large pool"), ("small_pool", "  from small pool"))
        for pool, label in kinds:
            cells = []
            for counter in ("current", "peak", "allocated", "freed"):
                v = stats.get(f"{stat}.{pool}.{counter}", 0)
                cells.append(fmt_bytes(v) if is_bytes else str(v))
            lines.append(f"{label:<28}" + "".join(f"{c:>14}" for c in cells))
        lines.append("-" * width)
    for key in SCALAR_NAMES:
        lines.append(f"{key:<28}{stats.get(key, 0):>14}")
    lines.append("=" * width)
    return "\n".join(lines)


def render_snapshot(segments: list[dict[str, Any]], as_json: bool = False) -> str:
    """The segments of ``memory_snapshot()`` as JSON or as one line per block."""
    if as_json:
        return json.dumps(segments, indent=2)
    out = []
    for seg in segments:
        pool = seg["segment_pool_id"]
        owner = f"private pool {tuple(pool)}" if pool is not None else "ordinary pool"
        out.append(
            f"segment 0x{seg['address']:x} {fmt_bytes(seg['total_size'])} {seg['segment_type']} "
            f"stream 0x{seg['stream']:x} {owner}"
        )
        for b in seg["blocks"]:
            graph = f" graph {b['owner_graph']}" if b["owner_graph"] else ""
            out.append(f"  0x{b['address']:x} {fmt_bytes(b['size']):>12} {b['state']}{graph}")
    return "\n".join(out) if out else "(no segments)"


# --------------------------------------------------------------- PyTorch's layout
PICKLE_PROTOCOL = 4
"""The web viewer's own unpickler (pytorch.org/memory_viz, MemoryViz.js) reads protocols 2
to 4, and only dicts, lists, tuples, str, int, float, bool and None."""

ORDINARY_POOL = (0, 0)
"""``segment_pool_id`` of the ordinary pool: PyTorch's id for "no private pool" (graphpool's
private pool ids always have one part non-zero)."""


def _frames(frames: list[dict[str, Any]], memo: dict[int, Any]) -> list[dict[str, Any]]:
    """A copy of a frame list that the allocator's history shares; each frame dict and list
    is copied once (``memo``), so the copies stay shared and the pickle small."""
    key = id(frames)
    out = memo.get(key)
    if out is None:
        out = []
        for f in frames:
            d = memo.get(id(f))
            if d is None:
                d = memo[id(f)] = dict(f)
            out.append(d)
        memo[key] = out
    return out


def torch_layout(
    states: list[tuple[list[dict[str, Any]], list[dict[str, Any]]]],
    backend: str,
    conf: AllocConf | None = None,
) -> dict[str, Any]:
    """The snapshot of ``torch.cuda.memory._snapshot()`` from each device's segments and
    events (``CachingAllocator.history_snapshot()``, one pair per device index).

    PyTorch's keys (2.11), in its order, then graphpool's: a segment's ``pool_graphs``
    (labels of the unreleased graphs using its private pool) and ``eager_side``, a block's ``owner_graph`` and
    ``kept_for`` (as ``memory_snapshot()``), an event's ``device`` and ``pool_id``, and
    ``allocator_settings``' ``GRAPHPOOL_ALLOC_CONF`` and ``backend``. ``conf``: the options in
    force (``max_split_size`` and ``garbage_collection_threshold`` come from it; default: none).
    """
    conf = conf or AllocConf()
    memo: dict[int, Any] = {}
    segments: list[dict[str, Any]] = []
    traces: list[list[dict[str, Any]]] = []
    for segs, events in states:
        for seg in segs:
            pool = seg["segment_pool_id"]
            segments.append(
                {
                    "device": seg["device"],
                    "address": seg["address"],
                    "total_size": seg["total_size"],
                    "allocated_size": seg["allocated_size"],
                    "active_size": seg["active_size"],
                    "requested_size": seg["requested_size"],
                    "stream": seg["stream"],
                    "segment_type": seg["segment_type"],
                    "segment_pool_id": ORDINARY_POOL if pool is None else tuple(pool),
                    "is_expandable": seg["is_expandable"],
                    "frames": _frames(seg["frames"], memo),
                    "blocks": [
                        {
                            "address": b["address"],
                            "size": b["size"],
                            "requested_size": b["requested_size"],
                            "state": b["state"],
                            "frames": _frames(b["frames"], memo),
                            "owner_graph": b["owner_graph"],
                            "kept_for": list(b["kept_for"]),
                        }
                        for b in seg["blocks"]
                    ],
                    "pool_graphs": list(seg["pool_graphs"]),
                    "eager_side": seg["eager_side"],
                }
            )
        trace = []
        for e in events:
            entry = dict(e)
            entry["frames"] = _frames(e["frames"], memo)
            entry["compile_context"] = "N/A"  # PyTorch 2.11's keys, without meaning here
            entry["user_metadata"] = ""
            trace.append(entry)
        traces.append(trace)
    return {
        "segments": segments,
        "device_traces": traces,
        "allocator_settings": {
            "PYTORCH_CUDA_ALLOC_CONF": "",
            "max_split_size": -1 if conf.max_split_size is None else conf.max_split_size,
            "garbage_collection_threshold": conf.garbage_collection_threshold or 0.0,
            "expandable_segments": bool(conf.expandable_segments),
            "GRAPHPOOL_ALLOC_CONF": os.environ.get("GRAPHPOOL_ALLOC_CONF", ""),
            "backend": backend,
        },
        "external_annotations": [],
    }


def dump(snapshot: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Write ``snapshot`` as a pickle PyTorch's viewers open (protocol ``PICKLE_PROTOCOL``).

    ``path`` must be a path: ``open`` would take an int as a file descriptor (``True`` is 1,
    this process's stdout) and close it after."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"dump_snapshot needs a file path (str or os.PathLike), not {type(path).__name__}")
    with open(path, "wb") as fh:
        pickle.dump(snapshot, fh, protocol=PICKLE_PROTOCOL)


# ------------------------------------------------------------------ the public calls
def record_memory_history(
    enabled: bool | str | None = True, *, max_entries: int = 100_000, stacks: bool = True
) -> None:
    """Record what the allocator does, for ``torch_snapshot()`` and ``dump_snapshot()``.

    Every device records, in a ring buffer of its newest ``max_entries`` events:
    allocations, frees (``free_requested``, then ``free_completed`` once the block is back
    in its pool, later for a block held by stream uses or graphs), segment allocations and
    releases, out-of-memory errors, capture begins and ends, and private pool creations and
    releases, each with its device, stream, private pool id (None for the ordinary pool),
    time and, with ``stacks``, the Python stack (at most 64 frames). ``enabled=False``
    stops recording and drops the events: take the snapshot first. PyTorch's
    ``enabled="all"`` and ``None`` mean True and False. Off by default; off, the cost is
    one attribute test per allocation and per free.
    """
    if enabled is None or enabled == "all":
        enabled = enabled == "all"
    if not isinstance(enabled, bool):
        raise ValueError(f"record_memory_history: enabled is True, False, 'all' or None, not {enabled!r}")
    if isinstance(max_entries, bool) or not isinstance(max_entries, int):
        raise TypeError(f"max_entries must be an int, not {type(max_entries).__name__}")
    if not 1 <= max_entries <= sys.maxsize:  # the ring buffer's length is a C ssize_t
        raise ValueError(f"max_entries must be at least 1 and at most {sys.maxsize}, not {max_entries}")
    if not isinstance(stacks, bool):
        raise TypeError(f"stacks must be True or False, not {stacks!r}")
    runtime.set_memory_history(max_entries if enabled else None, stacks)


def torch_snapshot() -> dict[str, Any]:
    """Every device's segments and recorded events in PyTorch's snapshot layout.

    The dict ``torch.cuda.memory._snapshot()`` returns (``segments``, ``device_traces``,
    ``allocator_settings``), which PyTorch's viewers read (``dump_snapshot`` writes it for
    them); graphpool's additions name the private pools' graphs (docs/behaviour.rst,
    "History and snapshots"). Needs no PyTorch.
    """
    rt = runtime.get()
    states = [([], []) if a is None else a.history_snapshot() for a in list(rt.allocators)]
    try:
        conf = runtime.alloc_conf()
    except ValueError:  # a bad GRAPHPOOL_ALLOC_CONF: no allocator was made under it
        conf = AllocConf()
    return torch_layout(states, rt.name, conf)


def dump_snapshot(path: str | os.PathLike[str]) -> None:
    """Write ``torch_snapshot()`` to ``path`` as a pickle that pytorch.org/memory_viz and
    ``python -m torch.cuda._memory_viz`` open (PyTorch's ``_dump_snapshot``)."""
    dump(torch_snapshot(), path)
