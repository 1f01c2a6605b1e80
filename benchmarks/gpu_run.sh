#!/usr/bin/env bash
# One device-machine session: GPU test suite, demo, benchmarks (pure Python and mypyc-compiled
# policy), each log under $OUT. Run from the repo root on the GPU machine:
#   bash benchmarks/gpu_run.sh
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import sys, cupy, numpy; print("python", sys.version.split()[0], "cupy", cupy.__version__, "numpy", numpy.__version__)'
  python3 -c 'from importlib.metadata import version as v; print("cuda-bindings", v("cuda-bindings"), "cuda-core", v("cuda-core"), "torch", v("torch"), "numba-cuda", v("numba-cuda"))'
  git log -1 --format='commit %H' 2>/dev/null || true
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
timeout 420 python3 -m pytest -q -p no:cacheprovider -rs ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest_gpu.txt" | tail -25
timeout 120 python3 -m graphpool demo 2>&1 | tee "$OUT/demo_gpu.txt" | tail -45
timeout 200 python3 -m graphpool bench --json "$OUT/bench_pure.json" > /dev/null 2>> "$OUT/bench_errors.txt"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
  rm -rf /tmp/srcc && cp -r src /tmp/srcc && (cd /tmp/srcc && PYTHONPATH=/tmp/site timeout 200 python3 -m mypyc --ignore-missing-imports graphpool/policy/block.py graphpool/policy/freelist.py graphpool/policy/pools.py graphpool/policy/stats.py graphpool/policy/private_pools.py graphpool/policy/allocator.py > "$OUT/mypyc_build.txt" 2>&1; ls graphpool/policy/*.so >> "$OUT/mypyc_build.txt" 2>&1)
  PYTHONPATH=/tmp/srcc timeout 200 python3 -m graphpool bench --json "$OUT/bench_compiled.json" > /dev/null 2>> "$OUT/bench_errors.txt"
  PYTHONPATH=/tmp/srcc timeout 200 python3 -c 'import graphpool.policy.allocator as m; print("compiled policy:", m.__file__)' >> "$OUT/pytest_compiled.txt" 2>&1
  PYTHONPATH=/tmp/srcc timeout 240 python3 -m pytest -q -p no:cacheprovider tests/policy tests/property tests/scenarios >> "$OUT/pytest_compiled.txt" 2>&1
  tail -2 "$OUT/pytest_compiled.txt"
fi
python3 - <<'PY'
import json, os
out = os.environ.get("OUT", "/tmp/out")
for name in ("bench_pure", "bench_compiled"):
    p = os.path.join(out, name + ".json")
    if not os.path.exists(p):
        print(name, "missing"); continue
    r = json.load(open(p))
    print(name, {k: {kk: round(vv, 3) if isinstance(vv, float) else vv for kk, vv in v.items()} if isinstance(v, dict) and "512" not in v else v for k, v in r.items() if k != "malloc_free_pair_us"})
    for size, row in r.get("malloc_free_pair_us", {}).items():
        print(" ", name, size, {k: round(v, 3) for k, v in row.items()})
PY
