import sys, operator
import cupy.cuda.memory as cm
pfa, ptr_ = cm.PythonFunctionAllocatorMemory, cm.MemoryPointer
add = operator.add
U = cm.UnownedMemory
mode = sys.argv[1]; n = int(sys.argv[2])
owner = object()
def floor_pfa(): ptr_(pfa(4096, add, add, 0), 0)
def floor_unowned(): ptr_(U(1 << 40, 4096, owner, 0), 0)
fn = floor_pfa if mode == "pfa" else floor_unowned
for _ in range(1000): fn()
for _ in range(n): fn()
