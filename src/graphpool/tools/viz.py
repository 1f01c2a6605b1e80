"""Pictures of a snapshot in PyTorch's layout (``gp.torch_snapshot()``): a self-contained HTML
page, and a PNG when matplotlib is installed.

For each device with segments or recorded events: its segments as bars, blocks inside,
filled with the colour of their pool (the ordinary pool or a private pool) and outlined
in the colour of their stream; and memory over time from ``device_traces``: allocated
and reserved bytes after each event, with capture begins and ends and out-of-memory errors
marked. The levels are worked out backwards from the snapshot's segments, so they are
right even when the ring buffer has dropped the oldest events. The page is one file of
HTML with inline SVG and CSS: no script, nothing fetched.
"""

from __future__ import annotations

import html
import os
from dataclasses import dataclass, field
from typing import Any

from graphpool.policy.units import fmt_bytes

ORDINARY_COLOUR = "#4e79a7"
POOL_COLOURS = ("#f28e2c", "#e15759", "#59a14f", "#af7aa1", "#edc949", "#76b7b2", "#ff9da7", "#9c755f")
STREAM_COLOURS = ("#222222", "#d62728", "#2ca02c", "#9467bd", "#17becf", "#8c564b", "#e377c2", "#bcbd22")
MARKS = {"capture_begin": "#59a14f", "capture_end": "#af7aa1", "oom": "#d62728"}
"""Events drawn as vertical lines on the memory plot, with their colours."""

TABLE_ROWS = 200
"""The HTML page lists this many of each device's newest events."""


def _pool(pid: Any) -> tuple[int, int] | None:
    """A pool id of a segment or event as a tuple, None for the ordinary pool."""
    if pid is None or tuple(pid) == (0, 0):
        return None
    return (int(pid[0]), int(pid[1]))


def pool_label(pid: Any) -> str:
    """The words for a pool id: ordinary pool, or private pool (g, h)."""
    p = _pool(pid)
    return "ordinary pool" if p is None else f"private pool {p}"


@dataclass
class Device:
    """What the pictures show of one device."""

    index: int
    segments: list[dict[str, Any]]
    events: list[dict[str, Any]]
    allocated: list[int] = field(default_factory=list)  # after each event, index 0 = before any
    reserved: list[int] = field(default_factory=list)
    pools: dict[tuple[int, int] | None, str] = field(default_factory=dict)  # pool -> colour
    streams: dict[int, str] = field(default_factory=dict)  # stream -> colour
    graphs: dict[tuple[int, int] | None, list[str]] = field(default_factory=dict)  # pool -> graphs


def devices(snapshot: dict[str, Any]) -> list[Device]:
    """The devices with segments or events, with their levels over time and their colours."""
    traces = snapshot["device_traces"]
    indices = sorted({s["device"] for s in snapshot["segments"]} | {i for i, t in enumerate(traces) if t})
    out = []
    for i in indices:
        segs = sorted(
            (s for s in snapshot["segments"] if s["device"] == i),
            key=lambda s: (_pool(s["segment_pool_id"]) or (0, 0), s["stream"], s["address"]),
        )
        d = Device(i, segs, list(traces[i]) if i < len(traces) else [])
        _levels(d)
        _colours(d)
        out.append(d)
    return out


def _levels(d: Device) -> None:
    """Allocated and reserved bytes before the first event and after each one, worked back
    from the final state (blocks allocated, segments held)."""
    allocated = sum(
        b["requested_size"] for s in d.segments for b in s["blocks"] if b["state"] == "active_allocated"
    )
    reserved = sum(s["total_size"] for s in d.segments)
    alloc_after = [allocated]
    reserved_after = [reserved]
    for e in reversed(d.events):
        action, size = e["action"], e["size"]
        if action == "alloc":
            allocated -= size
        elif action == "free_requested":
            allocated += size
        elif action == "segment_alloc":
            reserved -= size
        elif action == "segment_free":
            reserved += size
        alloc_after.append(allocated)
        reserved_after.append(reserved)
    d.allocated = alloc_after[::-1]
    d.reserved = reserved_after[::-1]


def _colours(d: Device) -> None:
    """A colour per pool (in order of appearance) and per stream; the graphs of each pool."""

    def graph(pool: tuple[int, int] | None, name: str) -> None:
        names = d.graphs.setdefault(pool, [])
        if name not in names:
            names.append(name)

    pools: list[tuple[int, int] | None] = [None]
    streams: list[int] = []
    for s in d.segments:
        pool = _pool(s["segment_pool_id"])
        pools.append(pool)
        streams.append(s["stream"])
        for name in s.get("pool_graphs", ()):
            graph(pool, name)
    for e in d.events:
        pool = _pool(e.get("pool_id"))
        pools.append(pool)
        if not e["action"].startswith("pool_"):  # pool events have no stream
            streams.append(e["stream"])
        if e["action"] == "capture_begin" and e.get("graph"):
            graph(pool, e["graph"])
    for p in pools:
        if p not in d.pools:
            d.pools[p] = (
                ORDINARY_COLOUR if p is None else POOL_COLOURS[(len(d.pools) - 1) % len(POOL_COLOURS)]
            )
    for st in streams:
        if st not in d.streams:
            d.streams[st] = STREAM_COLOURS[len(d.streams) % len(STREAM_COLOURS)]


# ------------------------------------------------------------------------ HTML
_STYLE = """
body { font: 14px system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.2em; margin-top: 2em; }
svg { background: #fafafa; border: 1px solid #ddd; }
table { border-collapse: collapse; font: 12px ui-monospace, monospace; }
td, th { padding: 1px 8px; text-align: left; border-bottom: 1px solid #eee; }
.key span { display: inline-block; margin-right: 1.2em; }
.sw { display: inline-block; width: 12px; height: 12px; vertical-align: middle; margin-right: 4px; }
"""


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _key(d: Device) -> str:
    pools = "".join(
        f'<span><i class="sw" style="background:{c}"></i>{_e(pool_label(p))}'
        + (f" ({_e(', '.join(d.graphs[p]))})" if d.graphs.get(p) else "")
        + "</span>"
        for p, c in d.pools.items()
    )
    streams = "".join(
        f'<span><i class="sw" style="border:3px solid {c};width:8px;height:8px"></i>stream 0x{s:x}</span>'
        for s, c in d.streams.items()
    )
    return f'<p class="key">Fill: {pools}</p><p class="key">Outline: {streams}</p>'


def _segments_svg(d: Device) -> str:
    if not d.segments:
        return "<p>No segments.</p>"
    label_w, bar_w, row_h = 300, 760, 22
    largest = max(s["total_size"] for s in d.segments)
    rows = []
    for i, s in enumerate(d.segments):
        y = 8 + i * row_h
        pool = _pool(s["segment_pool_id"])
        fill = d.pools.get(pool, ORDINARY_COLOUR)
        outline = d.streams.get(s["stream"], "#222")
        width = max(2.0, s["total_size"] / largest * bar_w)
        text = f"0x{s['address']:x} {fmt_bytes(s['total_size'])} {pool_label(pool)}"
        rows.append(f'<text x="4" y="{y + 14}" font-size="11">{_e(text)}</text>')
        rows.append(
            f'<rect x="{label_w}" y="{y}" width="{width:.1f}" height="{row_h - 6}" fill="white" '
            f'stroke="{outline}" stroke-width="2"><title>{_e(text)}, stream 0x{s["stream"]:x}, '
            f"{fmt_bytes(s['allocated_size'])} allocated</title></rect>"
        )
        for b in s["blocks"]:
            if b["state"] == "inactive":
                continue
            x = label_w + (b["address"] - s["address"]) / largest * bar_w
            w = max(2.0, b["size"] / largest * bar_w)
            pending = b["state"] == "active_pending_free"
            owner = f", graph {b['owner_graph']}" if b.get("owner_graph") else ""
            asked = f"({b['requested_size']} B asked) {b['state']}{owner}"
            tip = f"0x{b['address']:x} {fmt_bytes(b['size'])} {asked}"
            rows.append(
                f'<rect x="{x:.1f}" y="{y + 2}" width="{w:.1f}" height="{row_h - 10}" fill="{fill}" '
                f'fill-opacity="{0.35 if pending else 1}"><title>{_e(tip)}</title></rect>'
            )
    height = 16 + len(d.segments) * row_h
    return (
        f'<svg width="{label_w + bar_w + 20}" height="{height}" role="img" aria-label="segments">'
        + "".join(rows)
        + "</svg>"
    )


def _timeline_svg(d: Device) -> str:
    if not d.events:
        return "<p>No events recorded (gp.record_memory_history() was off).</p>"
    left, width, height, top = 80, 900, 240, 10
    n = len(d.events)
    peak = max(max(d.reserved), max(d.allocated), 1)

    def x(i: int) -> float:
        return left + i / n * width

    def y(v: int) -> float:
        return top + height - v / peak * height

    parts = []
    for series, colour, name in (
        (d.reserved, "#9aa5b1", "reserved"),
        (d.allocated, ORDINARY_COLOUR, "allocated"),
    ):
        pts = [f"{x(0):.1f},{y(series[0]):.1f}"]
        for i in range(1, n + 1):
            pts.append(f"{x(i):.1f},{y(series[i - 1]):.1f}")
            pts.append(f"{x(i):.1f},{y(series[i]):.1f}")
        parts.append(
            f'<polyline points="{" ".join(pts)}" fill="none" stroke="{colour}" stroke-width="2">'
            f"<title>{name}</title></polyline>"
        )
    for i, e in enumerate(d.events):
        mark = MARKS.get(e["action"])
        if mark is not None:
            what = e.get("graph") or fmt_bytes(e["size"])
            parts.append(
                f'<line x1="{x(i + 1):.1f}" x2="{x(i + 1):.1f}" y1="{top}" y2="{top + height}" '
                f'stroke="{mark}" stroke-dasharray="4 3"><title>{_e(e["action"])} {_e(what)} '
                f"(event {i})</title></line>"
            )
    span_ms = (d.events[-1]["time_us"] - d.events[0]["time_us"]) / 1000
    parts.append(f'<text x="4" y="{top + 12}" font-size="11">{_e(fmt_bytes(peak))}</text>')
    parts.append(f'<text x="4" y="{top + height}" font-size="11">0</text>')
    parts.append(
        f'<text x="{left}" y="{top + height + 18}" font-size="11">{n} events over {span_ms:.1f} ms: '
        "reserved (grey), allocated (blue); dashed: capture begin (green), end (purple), "
        "out of memory (red)</text>"
    )
    size = f'width="{left + width + 20}" height="{height + 40}"'
    return f'<svg {size} role="img" aria-label="memory over time">{"".join(parts)}</svg>'


def _table(d: Device) -> str:
    if not d.events:
        return ""
    first = d.events[0]["time_us"]
    start = max(0, len(d.events) - TABLE_ROWS)
    rows = []
    for i in range(start, len(d.events)):
        e = d.events[i]
        where = e["frames"][0] if e["frames"] else None
        site = f"{os.path.basename(where['filename'])}:{where['line']} {where['name']}" if where else ""
        addr = e.get("addr")
        rows.append(
            "<tr>"
            + "".join(
                f"<td>{_e(c)}</td>"
                for c in (
                    i,
                    f"{(e['time_us'] - first) / 1000:.3f}",
                    e["action"],
                    f"0x{addr:x}" if addr else "",
                    e["size"],
                    f"0x{e['stream']:x}",
                    pool_label(e.get("pool_id")),
                    e.get("graph", ""),
                    site,
                )
            )
            + "</tr>"
        )
    head = "".join(
        f"<th>{h}</th>" for h in ("#", "ms", "action", "address", "bytes", "stream", "pool", "graph", "where")
    )
    shown = f"the newest {len(d.events) - start} of {len(d.events)}" if start else f"all {len(d.events)}"
    return f"<p>Events ({shown}):</p><table><tr>{head}</tr>{''.join(rows)}</table>"


def render_html(snapshot: dict[str, Any], title: str = "graphpool memory snapshot") -> str:
    """The snapshot as one self-contained HTML page (no script, nothing fetched)."""
    body = []
    for d in devices(snapshot):
        reserved = sum(s["total_size"] for s in d.segments)
        body.append(
            f"<h2>Device {d.index}: {len(d.segments)} segments, {_e(fmt_bytes(reserved))} reserved, "
            f"{len(d.events)} events</h2>"
        )
        body.append(_key(d))
        body.append("<h3>Segments</h3>" + _segments_svg(d))
        body.append("<h3>Memory over time</h3>" + _timeline_svg(d))
        body.append(_table(d))
    if not body:
        body.append("<p>No segments and no events.</p>")
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
        f"<style>{_STYLE}</style></head><body><h1>{_e(title)}</h1>"
        "<p>Open the pickle beside this page at pytorch.org/memory_viz for PyTorch's viewer.</p>"
        + "\n".join(body)
        + "</body></html>\n"
    )


def write_html(snapshot: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Write ``render_html(snapshot)`` to ``path``."""
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(render_html(snapshot))


# ------------------------------------------------------------------------- PNG
def write_png(snapshot: dict[str, Any], path: str | os.PathLike[str]) -> bool:
    """Draw the segments and memory over time of each device into a PNG with matplotlib;
    False (nothing written) when matplotlib is not installed."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch, Rectangle
    except ImportError:
        return False
    devs = devices(snapshot) or [Device(0, [], [])]
    fig = Figure(figsize=(12, 4.5 * len(devs)), layout="constrained")
    axes = fig.subplots(len(devs), 2, squeeze=False)
    for d, (seg_ax, time_ax) in zip(devs, axes, strict=True):
        largest = max((s["total_size"] for s in d.segments), default=1)
        for row, s in enumerate(d.segments):
            colour = d.pools.get(_pool(s["segment_pool_id"]), ORDINARY_COLOUR)
            outline = d.streams.get(s["stream"], "#222")
            seg_ax.add_patch(
                Rectangle(
                    (0, row - 0.4), s["total_size"] / largest, 0.8, fill=False, edgecolor=outline, lw=1.5
                )
            )
            for b in s["blocks"]:
                if b["state"] != "inactive":
                    x0 = (b["address"] - s["address"]) / largest
                    width = max(b["size"] / largest, 0.004)  # tiny blocks stay visible
                    alpha = 0.35 if b["state"] == "active_pending_free" else 1.0
                    seg_ax.add_patch(Rectangle((x0, row - 0.3), width, 0.6, color=colour, alpha=alpha))
        seg_ax.set_xlim(0, 1.02)
        seg_ax.set_ylim(len(d.segments) - 0.5, -0.5)
        seg_ax.set_yticks(range(len(d.segments)))
        seg_ax.set_yticklabels(
            [f"{fmt_bytes(s['total_size'])} {pool_label(s['segment_pool_id'])}" for s in d.segments]
        )
        seg_ax.set_xlabel(f"fraction of the largest segment ({fmt_bytes(largest)})")
        seg_ax.set_title(f"device {d.index}: segments (fill: pool, outline: stream)")
        shown = {_pool(s["segment_pool_id"]) for s in d.segments}  # the pools of the segments
        handles: list[Any] = [Patch(color=c, label=pool_label(p)) for p, c in d.pools.items() if p in shown]
        streams = {s["stream"] for s in d.segments}
        handles += [
            Line2D([], [], color=c, label=f"stream 0x{st:x}") for st, c in d.streams.items() if st in streams
        ]
        seg_ax.legend(handles=handles, loc="lower right", fontsize="small")
        steps = range(len(d.allocated))
        time_ax.step(steps, [v / 2**20 for v in d.reserved], where="post", color="#9aa5b1", label="reserved")
        time_ax.step(
            steps, [v / 2**20 for v in d.allocated], where="post", color=ORDINARY_COLOUR, label="allocated"
        )
        for i, e in enumerate(d.events):
            mark = MARKS.get(e["action"])
            if mark is not None:
                time_ax.axvline(i + 1, color=mark, ls="--", lw=0.8)
        time_ax.set_xlabel("event")
        time_ax.set_ylabel("MiB")
        time_ax.set_title(f"device {d.index}: memory over time")
        time_ax.legend(loc="upper left")
    fig.savefig(path, dpi=100)
    return True
