"""Does the PyTorch lane answer in every process (GPU)? One process per run of this script.

Run 16 read ``torch.empty(1024)`` + drop through ``graphpool.torch`` at 1.9 us in some worker
processes and 3.0 us in others on one host, while PyTorch's own allocator held 2.1-2.3 us in
every process. A lane that engages in some processes and not in others would look like that.
This installs graphpool as PyTorch's allocator with counting wrappers around the hooks the
shim calls (a call that reaches them is one the lane did not answer), then times the bench
worker's sequence (the default stream, then a side stream) and prints, per stream, the time
per tensor and the hooks' calls and parks per tensor. Run it several times (one process each)
and compare the slow processes' counts with the fast ones'.

Usage: ``python benchmarks/torch_lane_diag_gpu.py [--number 20000]``.
"""

from __future__ import annotations

import contextlib
import sys
import time


def main() -> int:
    number = int(sys.argv[sys.argv.index("--number") + 1]) if "--number" in sys.argv else 20000
    import torch

    import graphpool as gp
    import graphpool.torch as gtorch

    gp.set_backend("cuda")
    counts = {"malloc": 0, "free": 0, "parked": 0}
    real = gtorch.hooks

    def counting(rt: object = None) -> tuple[object, object]:
        m, f = real(rt)  # type: ignore[arg-type]

        def cm(size: int, device: int, stream: int) -> int:
            counts["malloc"] += 1
            return m(size, device, stream)

        def cf(ptr: int, size: int, device: int, stream: int) -> object:
            counts["free"] += 1
            r = f(ptr, size, device, stream)
            counts["parked"] += bool(r)
            return r

        return cm, cf

    gtorch.hooks = counting  # type: ignore[assignment]
    gtorch.install()
    side = torch.cuda.Stream()
    for name, st in (("default stream", None), ("side stream", side)):
        with torch.cuda.stream(st) if st is not None else contextlib.nullcontext():
            for _ in range(number // 10):  # the bench's untimed first run
                torch.empty(1024, device="cuda")
            torch.cuda.synchronize()
            for k in counts:
                counts[k] = 0
            t0 = time.perf_counter()
            for _ in range(number):
                torch.empty(1024, device="cuda")
            torch.cuda.synchronize()
            us = (time.perf_counter() - t0) / number * 1e6
        print(
            f"{name:15s} {us:.3f} us/tensor; per tensor: hook mallocs {counts['malloc'] / number:.4f}"
            f" frees {counts['free'] / number:.4f} parked {counts['parked'] / number:.4f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
