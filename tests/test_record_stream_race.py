"""record_stream on the simulator, with slow work really queued on the user stream.

A block freed after ``record_stream(other)`` must not be reused, nor its bytes
overwritten, while ``other`` still has queued work on it.
"""

from __future__ import annotations

from typing import Any

import graphpool as gp
from graphpool import runtime


def test_record_stream_really_waits_for_the_user_stream(sim: Any) -> None:
    dev = runtime.get().device(0)
    s, other = gp.Stream(), gp.Stream()
    buf = gp.alloc(4096, s)
    keep = gp.alloc(4096, s)  # no merge with the tail
    dev.launch_sleep(other.handle, rounds=50)  # other is busy...
    dev.memset(buf.ptr, 0xAA, 4096, other.handle)  # ...then writes buf
    buf.record_stream(other)
    p = buf.ptr
    buf.free()
    new = gp.alloc(4096, s)
    assert new.ptr != p
    dev.write(new.ptr, b"\x01" * 4096, s.handle)
    gp.synchronize()
    assert dev.read(new.ptr, 4096, s.handle) == b"\x01" * 4096, "other's late write landed in a reused block"
    new.free()
    keep.free()
    gp.synchronize()
    again = gp.alloc(4096, s)  # other is done: the block is the best fit again
    assert again.ptr == p
    again.free()
    gp.check_invariants()
