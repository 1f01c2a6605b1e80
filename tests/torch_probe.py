"""Run in a fresh process by tests/test_integrations_torch.py on a GPU: PyTorch with graphpool as
its allocator (graphpool.torch.install()), each check's outcome printed as one JSON object.

A fresh process because PyTorch's allocator can be swapped only before its first CUDA
allocation, and never back.
"""

from __future__ import annotations

import gc
import json
import sys
import warnings
from typing import Any

import graphpool as gp


def _try(fn: Any) -> str:
    """'ok: <value>' or '<ExceptionType>: <message, first 200 characters>'."""
    try:
        return f"ok: {fn()!r}"
    except Exception as e:  # recorded, not raised: the probe reports what PyTorch does
        return f"{type(e).__name__}: {str(e)[:200]}"


def main() -> dict[str, Any]:
    gp.set_backend("cuda")
    import torch

    import graphpool.torch as gtorch

    out: dict[str, Any] = {"torch": torch.__version__}
    gtorch.install()
    gtorch.install()  # idempotent
    out["installed"] = gtorch.is_installed()
    out["backend"] = (
        torch._C._cuda_getAllocatorBackend() if hasattr(torch._C, "_cuda_getAllocatorBackend") else None
    )

    # 1. tensors come from graphpool, with the right contents
    base = gp.memory_allocated()
    x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    y = x * 2 + 1
    torch.cuda.synchronize()
    out["allocated_delta"] = gp.memory_allocated() - base
    out["tensor_bytes"] = 2 * x.numel() * 4
    out["owned_by_graphpool"] = any(
        b["address"] <= y.data_ptr() < b["address"] + b["size"]
        for seg in gp.memory_snapshot()
        for b in seg["blocks"]
        if b["state"] == "active_allocated"
    )
    out["values_ok"] = bool(torch.equal(y[:5].cpu(), torch.tensor([1.0, 3.0, 5.0, 7.0, 9.0])))
    torch_blocks = (x.data_ptr(), y.data_ptr())
    del x, y
    gc.collect()
    out["freed_back"] = gp.memory_allocated() == base

    # 2. one cache with CuPy: the memory PyTorch freed is what CuPy gets next (same stream;
    # PyTorch's two 4 MiB blocks merged back into their segment, so CuPy's block starts there)
    try:
        import cupy

        import graphpool.cupy as gcupy

        gcupy.install()
        reserved = gp.memory_reserved()
        with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream; older CuPy lacks the new call
            warnings.simplefilter("ignore", DeprecationWarning)
            cs = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
        with cs:
            a = cupy.empty(1 << 20, dtype=cupy.float32)
            out["cupy_reuses_torch_block"] = (
                int(a.data.ptr) in torch_blocks and gp.memory_reserved() == reserved
            )
            del a
        gcupy.uninstall()
    except ImportError:
        out["cupy_reuses_torch_block"] = None

    # 3. autograd (backward runs on PyTorch's own threads)
    w = torch.randn(256, 256, device="cuda", requires_grad=True)
    loss = (w @ w).square().sum()
    loss.backward()
    torch.cuda.synchronize()
    out["backward_ok"] = w.grad is not None and bool(torch.isfinite(w.grad).all())
    del w, loss
    gc.collect()

    # 4. out of memory: a clean error, the process and the allocator keep working
    try:
        torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
        out["oom"] = "no error"
    except Exception as e:
        out["oom"] = f"{type(e).__name__}: {str(e)[:160]}"
    z = torch.ones(1000, device="cuda")
    out["after_oom_ok"] = float(z.sum().item()) == 1000.0
    del z
    gp.check_invariants()

    # 5. a torch.cuda.graph capture: the CuPy hazard, through PyTorch's API
    s = torch.cuda.Stream()
    inp = torch.ones(1 << 20, device="cuda")
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g, stream=s):
            t = inp * 3.0
            res = t + 1.0
            del t  # freed inside the capture: graphpool keeps it for the graph
        with torch.cuda.stream(s):
            eager = torch.full((1 << 20,), 7.0, device="cuda")  # same stream, after the capture
        s.synchronize()
        g.replay()
        s.synchronize()
        out["graph_overwritten"] = int((eager != 7.0).sum().item())
        out["graph_result_ok"] = bool((res == 4.0).all().item())
        pools = [p for p in gp.memory_snapshot() if p["segment_pool_id"] is not None]
        out["graph_private_segments"] = len(pools)
        del g, res, eager
        gc.collect()
        torch.cuda.synchronize()
        gp.empty_cache()
        out["graph_pool_segments_after_del"] = len(
            [p for p in gp.memory_snapshot() if p["segment_pool_id"] is not None]
        )
    except Exception as e:
        out["graph"] = f"{type(e).__name__}: {str(e)[:300]}"

    # 6. PyTorch's own memory calls, forwarded to graphpool (graphpool.torch.forward_calls)
    out["torch_memory_allocated"] = _try(torch.cuda.memory_allocated)
    out["torch_allocated_is_graphpools"] = torch.cuda.memory_allocated() == gp.memory_allocated()
    out["torch_reserved_is_graphpools"] = torch.cuda.memory_reserved(0) == gp.memory_reserved()
    out["torch_summary"] = _try(lambda: len(torch.cuda.memory_summary()) > 0)
    big = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    del big
    torch.cuda.reset_peak_memory_stats()
    out["torch_peak_reset"] = torch.cuda.max_memory_allocated() == gp.memory_allocated()
    torch.cuda.synchronize()
    before = gp.memory_reserved()
    out["torch_empty_cache"] = _try(torch.cuda.empty_cache)
    out["torch_empty_cache_released"] = before - gp.memory_reserved()
    # record_stream: a tensor of the current stream used on side stream s, dropped while s's
    # work still runs, keeps its block from the current stream until that work is done
    from graphpool.tools.benchkit import cuda_spin

    side = gp.Stream()
    cur = torch.cuda.current_stream()
    r = torch.ones(1 << 16, device="cuda")
    kept = r.data_ptr()
    gc.collect()  # (before the spin: a collection of this process can take longer than it)
    with torch.cuda.stream(torch.cuda.ExternalStream(side.handle)):
        cuda_spin(side, cycles=2_000_000_000)  # about 1 s
        spun = gp.Event()
        spun.record(side)
        out["record_stream"] = _try(lambda t=r: t.record_stream(torch.cuda.current_stream()))
    del r
    again = torch.empty(1 << 16, device="cuda")
    out["record_stream_side_busy"] = not spun.query()  # else the check below proves nothing
    out["record_stream_block_held"] = again.data_ptr() != kept and cur == torch.cuda.current_stream()
    del again
    side.synchronize()
    gc.collect()
    torch.cuda.synchronize()

    # 7. the shim's lane (policy/heap.py, Note [Parking]): a tensor of one size made and dropped
    # in turn gets the same block each time, handed out by the shim without Python; the
    # statistics count every one; a capture on the parked block's stream is never served so
    shim = gtorch._shim()
    gp.memory_stats()  # settles the lane
    stats0 = gp.memory_stats()
    same, hits = True, []
    for stream in (torch.cuda.default_stream(), torch.cuda.Stream()):
        with torch.cuda.stream(stream):
            first = torch.empty(1000, device="cuda")
            ptr = first.data_ptr()
            del first
            for _ in range(200):
                t = torch.empty(1000, device="cuda")
                same = same and t.data_ptr() == ptr
                del t
            hits.append(int(shim.lane_state(0)["hits"]))
        gp.memory_stats()
    out["lane_same_block"] = same
    out["lane_hits"] = hits
    out["lane_counted"] = gp.memory_stats()["allocation.all.allocated"] - stats0["allocation.all.allocated"]
    cs = torch.cuda.Stream()
    with torch.cuda.stream(cs):
        t = torch.empty(4096, device="cuda")
        parked = t.data_ptr()
        del t
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2, stream=cs):
        u = torch.empty(4096, device="cuda")
        u.fill_(1.0)
    private = {
        b["address"]
        for seg in gp.memory_snapshot()
        if seg["segment_pool_id"] is not None
        for b in seg["blocks"]
    }
    out["lane_capture_private"] = u.data_ptr() != parked and u.data_ptr() in private
    del g2, u
    gc.collect()
    torch.cuda.synchronize()
    gp.check_invariants()
    out["invariants_ok"] = True
    return out


if __name__ == "__main__":
    result = main()
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")
