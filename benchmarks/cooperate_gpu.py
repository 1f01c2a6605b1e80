"""Pools that cooperate, on a real GPU: PyTorch's caching allocator and CuPy's default pool each
hold a large free cache in one process; graphpool then asks for more than the device has left
(issue 30, item 6).

    python3 benchmarks/cooperate_gpu.py [--share 0.4] [--json PATH]

PyTorch allocates ``share`` of the device's free memory and drops it (cached by PyTorch),
CuPy does the same through its default pool (cached by CuPy), then graphpool asks for
``1.5 x share`` of the memory free at the start: more than is free, less than is free plus
the caches. Run twice in the process: with cooperation off (``gp.set_release_other_caches(False)``:
expected OutOfMemoryError) and on (the default: PyTorch's and CuPy's caches are released and
the allocation succeeds). Prints the free memory, each cache, the outcome, ``num_ooms``,
``num_alloc_retries`` and the time of the allocation that cooperated.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from typing import Any

GiB = 1 << 30


def _fill_caches(torch: Any, cupy: Any, nbytes: int) -> None:
    t = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    del t  # cached by PyTorch
    c = cupy.cuda.alloc(nbytes)
    del c  # cached by CuPy's default pool
    torch.cuda.synchronize()


def run(cooperate: bool, share: float) -> dict[str, Any]:
    import cupy
    import torch

    import graphpool as gp

    gp.set_release_other_caches(cooperate)
    free0, _total = cupy.cuda.runtime.memGetInfo()
    cache = int(free0 * share) & ~(GiB // 4 - 1)
    _fill_caches(torch, cupy, cache)
    free1, _ = cupy.cuda.runtime.memGetInfo()
    request = int(1.5 * cache)
    row: dict[str, Any] = {
        "cooperation": "on" if cooperate else "off",
        "free at start GiB": round(free0 / GiB, 2),
        "PyTorch cached GiB": round(torch.cuda.memory_reserved() / GiB, 2),
        "CuPy cached GiB": round(cupy.get_default_memory_pool().total_bytes() / GiB, 2),
        "free before GiB": round(free1 / GiB, 2),
        "request GiB": round(request / GiB, 2),
    }
    before = gp.memory_stats()
    t0 = time.perf_counter()
    try:
        buf = gp.alloc(request)
    except gp.OutOfMemoryError:
        row["outcome"] = "OutOfMemoryError"
    else:
        row["outcome"] = "allocated"
        buf.free()
    row["ms"] = round((time.perf_counter() - t0) * 1e3, 1)
    after = gp.memory_stats()
    row["num_ooms +"] = after["num_ooms"] - before["num_ooms"]
    row["num_alloc_retries +"] = after["num_alloc_retries"] - before["num_alloc_retries"]
    row["PyTorch cached after GiB"] = round(torch.cuda.memory_reserved() / GiB, 2)
    row["CuPy cached after GiB"] = round(cupy.get_default_memory_pool().total_bytes() / GiB, 2)
    # leave nothing behind for the next run
    gp.empty_cache()
    torch.cuda.empty_cache()
    cupy.get_default_memory_pool().free_all_blocks()
    gc.collect()
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--share", type=float, default=0.4, help="share of free memory each cache holds")
    parser.add_argument("--json", help="write the rows as JSON here too")
    args = parser.parse_args()
    import cupy
    import torch

    import graphpool as gp

    gp.set_backend("cuda")
    torch.cuda.init()
    rows = [run(False, args.share), run(True, args.share)]
    print(f"PyTorch {torch.__version__}, CuPy {cupy.__version__}, {torch.cuda.get_device_name(0)}")
    for r in rows:
        print("  ".join(f"{k}: {v}" for k, v in r.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    ok = rows[0]["outcome"] == "OutOfMemoryError" and rows[1]["outcome"] == "allocated"
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
