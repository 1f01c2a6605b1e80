"""Floor: two ctypes calls into the shim that return at once (a free of a null pointer): what
ctypes itself costs per pair, with no GIL taken by the shim."""
import ctypes, sys
import graphpool as gp, graphpool.torch as gtorch
gp.set_backend("sim")
shim = gtorch._shim(); shim.set_hooks(max, min)
lib = ctypes.CDLL(gtorch.library_path())
lib.graphpool_torch_free.restype = None
lib.graphpool_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
tf = lib.graphpool_torch_free
n = int(sys.argv[1])
for _ in range(1000 + n): tf(None, 4096, 0, None); tf(None, 4096, 0, None)
