#!/usr/bin/env bash
# Stop 19's last device call (issue 27), lean for a short budget: build this tree only, the
# frameworks bench's cupy case (CuPy's pool; graphpool through CFunctionAllocator and the
# shim's lane, "graphpool-c"; graphpool through PythonFunctionAllocator, the default) and replay case,
# a check of the CuPy C path on real CuPy, then the GPU-marked CuPy, replay and lane tests.
# Carry .whl. Logs under $OUT.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/gpu_env.sh
B=/tmp/cc
rm -rf $B && mkdir -p $B && cp -r setup.py pyproject.toml README.md LICENSE src tests docs $B/
sed -i 's/^license = "Apache-2.0"/license = { text = "Apache-2.0" }/; /^license-files/d' $B/pyproject.toml
(cd $B && PYTHONPATH=/tmp/site timeout 200 python3 setup.py -q build_ext --inplace > "$OUT/build.txt" 2>&1)
echo "compiled modules: $(find $B/src -name '*.so' | wc -l)" | tee -a "$OUT/env.txt"
export GRAPHPOOL_BACKEND=cuda
for case in ${CASES:-cupy replay}; do
  PYTHONPATH=$B/src:$DEP timeout ${CASE_TIMEOUT:-100} python3 src/graphpool/tools/frameworks_bench.py --case "$case" \
    --processes 2 --number "${NUMBER:-1500}" --rounds "${ROUNDS:-3}" --json "$OUT/fw_$case.json" > "$OUT/fw_$case.txt" 2>&1 \
    || echo "$case: exit $?"
  grep -E "median|x$" "$OUT/fw_$case.txt" | head -90
done
PYTHONPATH=$B/src:$DEP timeout 40 python3 - > "$OUT/cpath.txt" 2>&1 <<'PY'
import graphpool as gp, graphpool.cupy as gc, cupy
gc.use_c_allocator = True  # (opt-in since run 15)
gp.set_backend("cuda"); gc.install()
a = cupy.ones(1000, dtype=cupy.float32); p = a.data.ptr; del a
b = cupy.ones(1000, dtype=cupy.float32)
print("c path", gc._hooks is gc._c_hooks, type(b.data.mem).__name__, "same block", b.data.ptr == p, float(b.sum()))
try:
    cupy.empty(1 << 50, dtype=cupy.uint8)
except Exception as e:
    print("oom ->", type(e).__module__, type(e).__name__, str(e)[:150])
c = cupy.ones(10); print("after oom", float(c.sum())); gp.check_invariants(); print("invariants ok")
PY
cat "$OUT/cpath.txt"
(cd $B && PYTHONPATH=$B/src:$DEP timeout ${TEST_TIMEOUT:-90} python3 -m pytest -q -m gpu -p no:cacheprovider \
  ${TESTS:-tests/test_integrations_cupy.py tests/test_twin_cupy_capture.py tests/scenarios/test_replay_plans.py \
  tests/scenarios/test_replay_checker.py} > "$OUT/pytest_gpu_part.txt" 2>&1)
tail -2 "$OUT/pytest_gpu_part.txt"; grep -E "^(FAILED|ERROR)" "$OUT/pytest_gpu_part.txt" | head
