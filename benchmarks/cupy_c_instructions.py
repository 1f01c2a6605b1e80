"""Instructions per CuPy array for graphpool's side of CuPy's two allocator paths, counted by
callgrind on the simulator (no GPU, no CuPy): what the C path and its lane save.

    python benchmarks/cupy_c_instructions.py SRC

SRC: a compiled graphpool tree (with the shim). Each variant runs a loop of N malloc + free
pairs of 4096 bytes on the legacy stream, as CuPy's memory object makes them, for N = 20,000
and 120,000, and prints the difference per pair, so import and warm-up cancel:

* ``hooks``: ``CupyHooks.malloc(4096, 0)`` and ``.free(ptr, 0)`` called from Python, as
  CuPy's ``PythonFunctionAllocatorMemory`` calls them (CuPy's current stream stood in for by
  a C-level dict lookup);
* ``c, lane``: the shim's ``graphpool_cupy_malloc``/``free`` through ctypes with the GIL held
  (as CuPy's ``CFunctionAllocatorMemory`` calls them), CuPy's stream function stood in for by
  a C function that returns 0 (``PyErr_Occurred``, with no error set);
* ``c, no lane``: the same with the lanes off (every call reaches the hooks);
* ``ctypes floor``: the same two ctypes calls of a C function that does nothing of note
  (``PyGILState_Check``), the cost ctypes adds and CuPy's Cython does not;
* ``hooks, two sizes`` and ``c, two sizes``: 4096 and 8192 bytes in turn, so the lane never
  answers (what the C path costs where parking does not pay; per two pairs).
"""

from __future__ import annotations

import re
import subprocess
import sys

LOOP = """
import ctypes, sys, types
sys.path.insert(0, {src!r})
import graphpool as gp
import graphpool.cupy as gcupy
from graphpool import lanes, runtime
from graphpool.hooks import CupyHooks
from graphpool.sim import SimBackend

class SimAsCuda(SimBackend):
    name = "cuda"

runtime.set_backend("cuda", backend=SimAsCuda())
current = {{0: types.SimpleNamespace(ptr=0)}}.__getitem__
variant = {variant!r}
shim = lanes.shim()
if variant.startswith("hooks"):
    h = CupyHooks(current, gcupy._find)
    hm, hf = h.malloc, h.free
    if variant == "hooks, two sizes":
        def pair():
            hf(hm(4096, 0), 0)
            hf(hm(8192, 0), 0)
    else:
        def pair():
            hf(hm(4096, 0), 0)
else:
    h = CupyHooks(current, gcupy._find, lanes.binder("bench"))
    stream_fn = ctypes.cast(ctypes.pythonapi.PyErr_Occurred, ctypes.c_void_p).value
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype = ctypes.py_object
    new_capsule.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)
    name = b"intptr_t (void)"
    shim.set_cupy_hooks(h.malloc_on, h.free, new_capsule(stream_fn, name, None))
    m_addr, f_addr = shim.cupy_entry_points()
    if variant == "c, no lane":
        shim.set_lanes_enabled(False)
    if variant == "ctypes floor":
        m_addr = f_addr = ctypes.cast(ctypes.pythonapi.PyGILState_Check, ctypes.c_void_p).value
    cm = ctypes.PYFUNCTYPE(ctypes.c_ssize_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)(m_addr)
    cf = ctypes.PYFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)(f_addr)
    if variant == "c, two sizes":
        def pair():
            cf(None, cm(None, 4096, 0), 0)
            cf(None, cm(None, 8192, 0), 0)
    else:
        def pair():
            cf(None, cm(None, 4096, 0), 0)

def run(n):
    for _ in range(n):
        pair()

run(1000)
run({n})
"""
VARIANTS = ("hooks", "c, lane", "c, no lane", "ctypes floor", "hooks, two sizes", "c, two sizes")


def instructions(src: str, variant: str, n: int) -> int:
    code = LOOP.format(src=src, n=n, variant=variant)
    r = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=False,
    )
    m = re.search(r"Collected : (\d+)", r.stderr)
    if r.returncode or m is None:
        raise SystemExit(r.stderr[-3000:])
    return int(m.group(1))


def main() -> int:
    src = sys.argv[1]
    for variant in sys.argv[2:] or VARIANTS:
        low, high = instructions(src, variant, 20_000), instructions(src, variant, 120_000)
        print(f"{variant}: {(high - low) / 100_000:,.0f} instructions per pair", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
