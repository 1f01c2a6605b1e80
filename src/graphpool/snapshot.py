"""Readable views of the allocator: ``memory_summary()`` and the ``snapshot`` command."""

from __future__ import annotations

import json
from typing import Any

from graphpool.policy.allocator import fmt_bytes

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
    for key in ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free"):
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
