"""Reports: statistics, snapshots, the event history and the invariant check.

What the allocator tells about itself, read under its lock (the public methods are in
allocator.py). Each report first settles queued work and ended captures (``_settle``), so
what it says is never stale.
"""

from __future__ import annotations

from typing import Any

from graphpool.policy.block import iter_segment
from graphpool.policy.expandable import Expandable
from graphpool.policy.history import History
from graphpool.policy.private_pools import (
    PoolId,
    PrivatePool,
)
from graphpool.policy.stats import PoolStats

EXPANDABLE_KEYS = ("expandable_mapped_bytes", "expandable_virtual_bytes")
"""The device statistics' two keys beyond PyTorch's: bytes mapped in expandable segments
(also counted in ``reserved_bytes``) and the address space they hold."""


def zero_device_stats() -> dict[str, int]:
    """A device's statistics before its first allocation: every key ``memory_stats()`` has, 0
    (for a device with no allocator yet, without making one)."""
    return dict.fromkeys(PoolStats().as_dict(), 0) | dict.fromkeys(EXPANDABLE_KEYS, 0)


class Reports(Expandable):
    """The allocator's statistics, snapshots and history (see the module doc)."""

    def _memory_stats(self, pool: PoolId | None) -> dict[str, int]:
        self._settle()
        if pool is None:
            return self._device_stats()
        p = self._pools.get(pool)
        if p is None:
            raise ValueError(f"no private pool {tuple(pool)} on device {self.device.index}")
        out = p.stats.as_dict()
        out["use_count"] = p.use_count
        return out

    def _device_stats(self) -> dict[str, int]:
        """The device's flattened statistics: PyTorch's keys, then the expandable segments'
        mapped bytes (also counted in ``reserved_bytes``) and the address space they hold."""
        out = self.stats.as_dict()
        mapped, virtual = EXPANDABLE_KEYS
        out[mapped] = sum(seg.mapped for seg in self._exp.values())
        out[virtual] = sum(seg.reserved for seg in self._exp.values())
        return out

    def _reset_peak(self) -> None:
        self._settle()  # a free queued before the reset is counted before it, as it was asked
        for st in [self.stats] + [p.stats for p in self._pools.values()]:
            st.reset_peak()

    def _reset_accumulated(self) -> None:
        self._settle()
        for st in [self.stats] + [p.stats for p in self._pools.values()]:
            st.reset_accumulated()

    def _private_pools(self) -> list[PrivatePool]:
        self._settle()
        return list(self._pools.values())

    def _settle(self) -> None:
        """Carry out queued frees and releases, and notice ended and destroyed captures."""
        if self._pending:
            self._drain()
        if self._tokens:
            self._poll_released()
        if self._foreign:
            self._sweep()

    def _snapshot(self) -> list[dict[str, Any]]:
        self._settle()
        kept = self._kept_for()
        out = []
        for base in self._seg_bases:
            head = self._segments[base]
            blocks = iter_segment(head)
            owner = head.free_list.private_pool
            seg: dict[str, Any] = {
                "device": self.device.index,
                "address": base,
                "total_size": sum(b.size for b in blocks),
                "allocated_size": sum(b.size for b in blocks if b.allocated),
                "active_size": sum(b.size for b in blocks if b.allocated or b.holds),
                "requested_size": sum(b.requested for b in blocks if b.allocated or b.holds),
                "stream": self._exp[base].stream if base in self._exp else head.stream,
                "segment_type": "small" if head.free_list.is_small else "large",
                "segment_pool_id": tuple(owner.id) if owner is not None else None,
                "eager_side": head.free_list.eager,
                "is_expandable": base in self._exp,
                "blocks": [
                    {
                        "address": b.ptr,
                        "size": b.size,
                        "requested_size": b.requested,
                        "state": (
                            "active_allocated"
                            if b.allocated
                            else "active_pending_free"
                            if b.holds
                            else "inactive"
                        ),
                        # a block kept for graphs (freed during their capture) shows its keeper
                        "owner_graph": (
                            b.allocated_in.label
                            if b.allocated_in is not None
                            else (kept[id(b)][0].label if id(b) in kept else None)
                        ),
                        "kept_for": [r.label for r in kept.get(id(b), ())],
                    }
                    for b in blocks
                ],
            }
            out.append(seg)
        return out

    def _record_history(self, max_entries: int | None, stacks: bool) -> None:
        if max_entries is None:
            self._history = None
        elif self._history is None:
            self._history = History(self.device.index, max_entries, stacks)
        else:
            self._history.configure(max_entries, stacks)

    @property
    def recording(self) -> bool:
        """Whether the history records events."""
        return self._history is not None

    def _history_snapshot(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        segments = self._snapshot()
        graphs: dict[tuple[int, ...], list[str]] = {}
        for rec in self._records.values():
            graphs.setdefault(tuple(rec.pool.id), []).append(rec.label)
        h = self._history
        for seg in segments:
            pool = seg["segment_pool_id"]
            seg["pool_graphs"] = list(graphs.get(pool, ())) if pool is not None else []
            seg["frames"] = h.segment_frames.get(seg["address"], []) if h is not None else []
            for b in seg["blocks"]:
                frames = None
                if h is not None and b["state"] != "inactive":
                    frames = h.block_frames.get(b["address"])
                b["frames"] = frames if frames is not None else []
        return segments, (list(h.entries) if h is not None else [])

    def _check(self) -> None:
        """check_invariants under the caller's lock; after every malloc and free when
        GRAPHPOOL_DEBUG=1 (O(blocks) each: for tests and bug hunts)."""
        from graphpool.policy.check import check_invariants

        check_invariants(self)
