"""Host cost of the CUDA calls a cross-stream reuse would add (issue 11), on the GPU.

us per call, min of 5 x 20,000: cudaEventRecord + cudaEventQuery through graphpool's CUDA
device (what ``_borrow`` does per borrowed block, twice), cudaStreamQuery through
cuda.bindings' runtime module, and graphpool's capture query for scale.
"""

from __future__ import annotations

import json
import sys
import time

import graphpool as gp
from graphpool import runtime


def per_call(fn: object, n: int = 20000) -> float:
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()  # type: ignore[operator]
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def main() -> int:
    from cuda.bindings import runtime as rt

    gp.set_backend("cuda")
    dev = runtime.get().device(0)
    s = gp.Stream()
    ev = dev.create_event()
    h = s.handle

    def rec_query() -> None:
        dev.record_event(ev, h)
        dev.query_event(ev)

    out = {
        "event record + query (us)": per_call(rec_query),
        "cudaStreamQuery via cuda.bindings (us)": per_call(lambda: rt.cudaStreamQuery(h)),
        "capture query (us)": per_call(lambda: dev.capture_id(h)),
    }
    print(json.dumps(out, indent=1))
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
