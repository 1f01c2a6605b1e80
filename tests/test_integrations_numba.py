"""graphpool.numba: the Numba EMM plugin (GPU only).

Numba takes its memory manager when it creates its CUDA context, once per process, so
the check runs in a fresh interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpu_guard import cuda_unusable

pytestmark = pytest.mark.gpu

SRC = str(Path(__file__).resolve().parents[1] / "src")

SCRIPT = textwrap.dedent(
    """
    import gc
    import numpy as np
    import graphpool as gp
    import graphpool.numba as gnumba

    gp.set_backend("cuda")
    gnumba.install()
    from numba import cuda

    ctx = cuda.current_context()
    assert isinstance(ctx.memory_manager, gnumba.GraphpoolEMMPlugin), type(ctx.memory_manager)
    free, total = ctx.get_memory_info()
    assert 0 < free <= total

    gc.collect()
    base = gp.memory_allocated()
    host = np.arange(100_000, dtype=np.float32)
    d = cuda.to_device(host)
    assert gp.memory_allocated() == base + -(-host.nbytes // 512) * 512, (gp.memory_allocated(), base)
    ptr = d.device_ctypes_pointer.value
    assert any(s["address"] <= ptr < s["address"] + s["total_size"] for s in gp.memory_snapshot())
    np.testing.assert_array_equal(d.copy_to_host(), host)
    e = cuda.device_array_like(d)
    e.copy_to_device(d)
    np.testing.assert_array_equal(e.copy_to_host(), host)
    ipch = ctx.get_ipc_handle(d.gpu_data)  # the graphpool segment, and the offset in it
    seg = [s for s in gp.memory_snapshot() if s["address"] <= ptr < s["address"] + s["total_size"]][0]
    assert ipch.size == d.nbytes and ipch.offset == ptr - seg["address"], (ipch.size, ipch.offset)
    del ipch
    before = gp.memory_stats()
    z = ctx.memalloc(0)  # zero bytes: a NULL pointer that holds no memory (as gp.alloc(0))
    assert gp.memory_stats()["allocation.all.allocated"] == before["allocation.all.allocated"]
    del z
    del d, e
    gc.collect()
    cuda.synchronize()
    assert gp.memory_allocated() == base, (gp.memory_allocated(), base)
    print("NUMBA-OK")
    """
)


def test_numba_emm_plugin() -> None:
    reason = cuda_unusable()
    if reason is not None:
        pytest.skip(reason)
    pytest.importorskip("numba.cuda")
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("GRAPHPOOL_BACKEND", None)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "NUMBA-OK" in proc.stdout, proc.stdout + proc.stderr
