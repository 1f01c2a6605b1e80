"""Peak reserved / peak live of the policy with expandable segments, on the simulator.

    python benchmarks/expandable_ratios.py

Replays every shipped allocation trace, ``traces.synthetic(seed)`` for seeds 0-7 on one
stream and seeds 0-3 on two streams, through a CachingAllocator with
``expandable_segments:True`` on the simulated device (2 MiB granules, as an H200's), from an
empty cache, and prints each trace's peak reserved / peak live. No kernels run, so every
stream is idle whenever asked. For the recorded traces these figures equal the H200's to the
hundredth (benchmarks/NOTES.md, entries 32 and 44): a policy change can be judged here
first, on more traces than the GPU run replays, and then measured on the GPU.
"""

from __future__ import annotations

import dataclasses
import sys

import graphpool as gp
from graphpool import runtime
from graphpool.policy.allocator import CachingAllocator
from graphpool.tools import trace_bench, traces


def main() -> int:
    gp.set_backend("sim")
    dev = gp.current_device()
    rt = runtime.get()
    like = runtime.allocator(dev)
    sizes = dataclasses.replace(like.sizes, expandable_segments=True)
    todo = [traces.load(n) for n in traces.available()]
    todo += [traces.synthetic(s) for s in range(8)]
    todo += [traces.synthetic(s, streams=2, name=f"synthetic-{s}, 2 streams") for s in range(4)]
    for tr in todo:
        events = trace_bench._trace_events(tr)
        streams = [gp.Stream(dev) for _ in range(max(1, tr.streams))]
        bound = trace_bench._bind(events, [s.handle for s in streams])
        a = CachingAllocator(like.device, sizes=sizes, world=rt.world)
        live: dict[int, int] = {}
        for k, i, n, s in bound:
            if k:
                live[i] = a.malloc(n, stream=s)
            else:
                a.free(live.pop(i))
        peak = a.memory_stats()["reserved_bytes.all.peak"]
        a.check_invariants()
        a.empty_cache()
        print(f"{tr.name:32s} {peak / traces.peak_live_bytes(tr):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
