"""Byte counts written for people, in messages and tables (the allocator's out-of-memory
message, ``memory_summary()``, the tools' reports). Plain Python, no state."""

from __future__ import annotations


def fmt_bytes(n: int) -> str:
    """Bytes in the largest binary unit that keeps the figure >= 1 (for messages and tables)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{n} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"
