"""Floor: the torch-shim pair through ctypes with graphpool's hooks replaced by C no-ops
(``max`` as malloc, ``min`` as free: 0, nothing parked): ctypes, the GIL taken and released
by the shim, two C calls."""
import ctypes, sys
import graphpool as gp, graphpool.torch as gtorch
gp.set_backend("sim")
shim = gtorch._shim(); shim.set_hooks(max, min)
lib = ctypes.CDLL(gtorch.library_path())
lib.graphpool_torch_malloc.restype = ctypes.c_void_p
lib.graphpool_torch_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
lib.graphpool_torch_free.restype = None
lib.graphpool_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
tm, tf = lib.graphpool_torch_malloc, lib.graphpool_torch_free
n = int(sys.argv[1])
for _ in range(1000 + n): tf(tm(4096, 0, None), 4096, 0, None)
