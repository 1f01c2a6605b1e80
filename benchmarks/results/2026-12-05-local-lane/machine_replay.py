"""Replays the allocator machine's example that fails with the tree before stop 18 too (NOTES 50):
``PYTHONPATH=<a graphpool src> python benchmarks/results/2026-12-05-local-lane/machine_replay.py``
prints FAILED (the model's "memory handed out while kept or awaiting events") or PASSED."""
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[3] / "tests"
for sub in ("property", "policy", ""):
    sys.path.insert(0, str(TESTS / sub))
import graphpool as gp
print("graphpool", gp.__file__, gp.compiled())
import test_allocator_machine as M
from graphpool.policy.private_pools import PoolId

class D:
    def __init__(self, vals): self.vals = list(vals)
    def draw(self, strat, label=None):
        v = self.vals.pop(0)
        if isinstance(v, PoolId):  # the pool made in this process (its handle differs)
            ids = [x for x in m.mps] if hasattr(m, "mps") else []
            print("pool ids", ids)
            v = ids[-1] if ids else v
        return v

m = M.AllocatorMachine()
def inv():
    for f in (m.accounting, m.allocator_invariants, m.capture_rules, m.peaks, m.use_counts):
        f()
inv()
m.mempool_session(d=0, data=D(['managed', False, 3, 17592186044416]), free_one='yes', sizes=[0, 4097], stay=False); inv()
m.mempool_op(d=0, data=D([None, PoolId(0, 3029)]), what='enter'); inv()
m.begin_capture(d=1, data=D([]), stream=1, which='new', worker=False); inv()
m.failed_capture_in_live_pool(abandon=False, d=0, data=D([0, 0]), nbytes=3000); inv()
m.fill_device(d=0, nbytes=3000, stream=1); inv()
m.fill_device(d=0, nbytes=3000, stream=3); inv()
m.record_stream(d=0, data=D([17592186044416]), stream=1); inv()
m.stop_capture(d=1, data=D([1001]), how='end'); inv()
try:
    m.free_and_malloc_again(d=0, data=D([17592186044416])); inv()
    print("PASSED")
except AssertionError as e:
    print("FAILED", e)
