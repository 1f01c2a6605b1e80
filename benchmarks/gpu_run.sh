#!/usr/bin/env bash
# One device-machine session: the whole test suite, the demo and the benchmarks, for the
# build an install makes (compiled by mypyc, setup.py) and for the pure-Python fallback.
# Each log goes under $OUT. Run from the repo root on the GPU machine (no package registry
# there; `.whl` carries mypy 2.4.1 for the build and fastrlock in case the image lacks it):
#   bash benchmarks/gpu_run.sh
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
ROOT=$(pwd)
DEP=/tmp/dep   # runtime dependency missing from the image, if any
if ! python3 -c 'import fastrlock' 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target "$DEP" .whl/fastrlock-*.whl >/dev/null 2>&1
fi
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/mypy-*.whl .whl/librt-*.whl \
  .whl/ast_serialize-*.whl >/dev/null 2>&1
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  PYTHONPATH=$DEP python3 -c 'import sys, cupy, numpy, fastrlock; print("python", sys.version.split()[0], "cupy", cupy.__version__, "numpy", numpy.__version__, "fastrlock", fastrlock.__version__, fastrlock.__file__)'
  python3 -c 'from importlib.metadata import version as v; print("cuda-bindings", v("cuda-bindings"), "cuda-core", v("cuda-core"), "torch", v("torch"), "numba-cuda", v("numba-cuda"))'
  git log -1 --format='commit %H %s' 2>/dev/null || true
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# The compiled build, as `pip install` makes it (setup.py), in a copy of the tree.
rm -rf /tmp/cc && mkdir /tmp/cc && cp -r setup.py pyproject.toml README.md src tests /tmp/cc/
(cd /tmp/cc && PYTHONPATH=/tmp/site timeout 240 python3 setup.py -q build_ext --inplace > "$OUT/build.txt" 2>&1
 find src -name '*.so' >> "$OUT/build.txt")
tail -3 "$OUT/build.txt"
for build in compiled pure; do
  if [ $build = compiled ]; then SRC=/tmp/cc/src; TESTS=/tmp/cc; else SRC=$ROOT/src; TESTS=$ROOT; fi
  export PYTHONPATH=$SRC:$DEP
  python3 -c 'import graphpool as gp; print("graphpool compiled:", gp.compiled(), gp.__file__)' | tee -a "$OUT/env.txt"
  (cd "$TESTS" && timeout 300 python3 -m pytest -q -p no:cacheprovider -rs ${PYTEST_ARGS:-} 2>&1) \
    > "$OUT/pytest_$build.txt"; tail -1 "$OUT/pytest_$build.txt"
  timeout 240 python3 -m graphpool bench --json "$OUT/bench_$build.json" > /dev/null 2>> "$OUT/bench_errors.txt"
  if [ $build = compiled ]; then
    timeout 120 python3 -m graphpool demo > "$OUT/demo_gpu.txt" 2>&1; tail -4 "$OUT/demo_gpu.txt"
  fi
done
python3 - <<'PY'
import json, os
out = os.environ.get("OUT", "/tmp/out")
for name in ("bench_compiled", "bench_pure"):
    p = os.path.join(out, name + ".json")
    if not os.path.exists(p):
        print(name, "missing"); continue
    r = json.load(open(p))
    for size, row in r.get("malloc_free_pair_us", {}).items():
        print(name, size, {k: round(v, 3) for k, v in row.items()})
    for k in ("routing", "replay"):
        print(name, k, {kk: round(vv, 3) for kk, vv in r.get(k, {}).items()})
PY
