#!/usr/bin/env bash
# One device-machine call: build as an install does (mypyc + the C capture module), then the
# whole test suite on the GPU, the foreign-capture figures, the demo and the benchmarks.
# Each log goes under $OUT. Run from the repo root on the GPU machine (no package registry
# there; `.whl` carries mypy 2.4.1 and its needs for the build, and fastrlock):
#   bash benchmarks/gpu_run.sh            # PART=all (default) | build | tests | figures | pure | cupy | traces | conformance
# PART=cupy runs CuPy's own test suite (a v14.2.0 checkout's tests carried in .cupy/) with CuPy's
# pool and with graphpool as its allocator (benchmarks/cupy_suite.sh).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
ROOT=$(pwd)
PART=${PART:-all}
source benchmarks/gpu_env.sh  # $DEP, the build's mypy in /tmp/site, $OUT/env.txt

# The compiled build, as `pip install` makes it (setup.py), in a copy of the tree.
rm -rf /tmp/cc && mkdir /tmp/cc && cp -r setup.py pyproject.toml README.md LICENSE src tests /tmp/cc/
build() {
  (cd /tmp/cc && PYTHONPATH=/tmp/site timeout 300 python3 setup.py -q build_ext --inplace > "$OUT/build.txt" 2>&1)
}
build
if ! ls /tmp/cc/src/graphpool/policy/allocator*.so >/dev/null 2>&1; then
  # an older setuptools may refuse pyproject's SPDX license string: retry with the old table form
  sed -i 's/^license = "Apache-2.0"/license = { text = "Apache-2.0" }/; /^license-files/d' /tmp/cc/pyproject.toml
  echo "retry with license table" >> "$OUT/build.txt"; build
fi
find /tmp/cc/src -name '*.so' >> "$OUT/build.txt"
tail -12 "$OUT/build.txt"

run_tests() {  # $1: compiled | pure
  local SRC TESTS
  if [ "$1" = compiled ]; then SRC=/tmp/cc/src; TESTS=/tmp/cc; else SRC=$ROOT/src; TESTS=$ROOT; fi
  export PYTHONPATH=$SRC:$DEP
  python3 -c 'import graphpool as gp; from graphpool.device import cuda; gp.set_backend("cuda"); print("graphpool compiled:", gp.compiled(), gp.__file__, "| native capture module:", cuda.native_missing or "loaded")' | tee -a "$OUT/env.txt"
  (cd "$TESTS" && timeout ${TEST_TIMEOUT:-330} python3 -m pytest -q -p no:cacheprovider -rs ${PYTEST_ARGS:-} 2>&1) \
    > "$OUT/pytest_$1.txt"; tail -3 "$OUT/pytest_$1.txt"
}

if [ "$PART" = final ]; then  # the suite and CuPy's tests (a subset) at once, then the figures
  (OUT=$OUT/cupy; mkdir -p "$OUT"; PYTHONPATH=/tmp/cc/src:$DEP CUPY_SUITE_PARALLEL=1 \
   CUPY_SUITE_TIMEOUT=${CUPY_SUITE_TIMEOUT:-250} CUPY_PYTEST_ARGS="-n 5 -q" bash benchmarks/cupy_suite.sh .cupy \
   > "$OUT/cupy_suite.txt" 2>&1) &
  run_tests compiled
  wait
  tail -5 "$OUT/cupy/cupy_suite.txt"; head -30 "$OUT/cupy/diff.txt" 2>/dev/null
  PART=figures_only
fi
if [ "$PART" = traces ]; then  # record the traces, then pair/mixed/trace figures of this tree and .baseline/
  export PYTHONPATH=/tmp/cc/src:$DEP
  if [ "${RECORD:-1}" = 1 ]; then  # RECORD=0: the committed traces (src/graphpool/tools/trace_data)
    mkdir -p "$OUT/trace_data"
    timeout 240 python3 benchmarks/record_traces.py --out "$OUT/trace_data" > "$OUT/record_traces.txt" 2>&1
    tail -25 "$OUT/record_traces.txt"
    mkdir -p /tmp/cc/src/graphpool/tools/trace_data && cp "$OUT"/trace_data/*.json.gz /tmp/cc/src/graphpool/tools/trace_data/
  fi
  if [ -d .baseline ]; then  # the tree before this stop's changes, with this tree's bench code
    rm -rf /tmp/cb && cp -r .baseline /tmp/cb && mkdir -p /tmp/cb/src/graphpool/tools/trace_data
    cp -r src/graphpool/tools/. /tmp/cb/src/graphpool/tools/
    if [ "${RECORD:-1}" = 1 ]; then cp "$OUT"/trace_data/*.json.gz /tmp/cb/src/graphpool/tools/trace_data/ 2>/dev/null; fi
    sed -i 's/^license = "Apache-2.0"/license = { text = "Apache-2.0" }/; /^license-files/d' /tmp/cb/pyproject.toml
    (cd /tmp/cb && PYTHONPATH=/tmp/site timeout 300 python3 setup.py -q build_ext --inplace > "$OUT/build_baseline.txt" 2>&1)
  fi
  for round in ${ROUNDS:-1}; do
    PYTHONPATH=/tmp/cc/src:$DEP timeout 200 python3 benchmarks/bench_sections.py --backend cuda \
      --sections ${SECTIONS:-pair,mixed,traces} --repeat ${REPEAT:-9} --json "$OUT/sections_new_$round.json" \
      > "$OUT/sections_new_$round.txt" 2>&1
    tail -4 "$OUT/sections_new_$round.txt"
    if [ -d /tmp/cb ]; then
      PYTHONPATH=/tmp/cb/src:$DEP timeout 200 python3 benchmarks/bench_sections.py --backend cuda \
        --sections ${SECTIONS:-pair,mixed,traces} --repeat ${REPEAT:-9} --json "$OUT/sections_old_$round.json" \
        > "$OUT/sections_old_$round.txt" 2>&1
      tail -4 "$OUT/sections_old_$round.txt"
    fi
  done
  (cd "$OUT" && F=$(ls sections_*.txt sections_*.json build*.txt record_traces.txt 2>/dev/null || true) \
   && tar czf sections.tgz $F && rm -f $F)
fi
if [ "$PART" = all ] || [ "$PART" = tests ]; then run_tests compiled; fi
if [ "$PART" = pure ]; then run_tests pure; fi
if [ "$PART" = figures_only ]; then
  export PYTHONPATH=/tmp/cc/src:$DEP
  timeout 120 python3 benchmarks/foreign_captures_gpu.py --json "$OUT/foreign_captures.json" > "$OUT/foreign_captures.txt" 2>&1
  tail -8 "$OUT/foreign_captures.txt" | cut -c1-300
  if [ "${FINAL_BENCH:-0}" = 1 ]; then  # the whole bench, traces included
    timeout ${BENCH_TIMEOUT:-170} python3 -m graphpool bench --backend cuda --json "$OUT/bench_compiled.json" \
      --no-progress > "$OUT/bench_compiled.txt" 2> "$OUT/bench_errors.txt"; tail -60 "$OUT/bench_compiled.txt"
    tail -5 "$OUT/bench_errors.txt"
  fi
  if [ -d "$OUT/cupy" ]; then (cd "$OUT" && tar czf cupy.tgz cupy && rm -rf cupy); fi
fi
if [ "$PART" = all ] || [ "$PART" = figures ]; then
  export PYTHONPATH=/tmp/cc/src:$DEP
  timeout 150 python3 benchmarks/foreign_captures_gpu.py --json "$OUT/foreign_captures.json" > "$OUT/foreign_captures.txt" 2>&1
  tail -8 "$OUT/foreign_captures.txt" | cut -c1-400
  timeout 100 python3 -m graphpool demo --backend cuda > "$OUT/demo_gpu.txt" 2>&1; tail -3 "$OUT/demo_gpu.txt"
  timeout 200 python3 -m graphpool bench --backend cuda --json "$OUT/bench_compiled.json" --no-progress \
    > "$OUT/bench_compiled.txt" 2> "$OUT/bench_errors.txt"; tail -40 "$OUT/bench_compiled.txt"
fi
if [ "$PART" = conformance ]; then  # numba-cuda's driver tests and CuPy's subset, side by side
  python3 -m pip install -q --no-index --no-deps --target "$DEP" .whl/filecheck-*.whl >/dev/null 2>&1
  export PYTHONPATH=/tmp/cc/src:$DEP
  (OUT=$OUT/numba; mkdir -p "$OUT"; NUMBA_SUITE_PARALLEL=1 NUMBA_SUITE_TIMEOUT=${NUMBA_SUITE_TIMEOUT:-420} \
   NUMBA_PYTEST_ARGS="${NUMBA_PYTEST_ARGS:--n 4}" bash benchmarks/numba_suite.sh > "$OUT/numba_suite.txt" 2>&1) &
  (OUT=$OUT/cupy; mkdir -p "$OUT"; CUPY_SUITE_PARALLEL=1 CUPY_SUITE_TIMEOUT=${CUPY_SUITE_TIMEOUT:-420} \
   CUPY_PYTEST_ARGS="${CUPY_PYTEST_ARGS:--n 4 -q}" bash benchmarks/cupy_suite.sh .cupy > "$OUT/cupy_suite.txt" 2>&1) &
  wait
  tail -12 "$OUT/numba/numba_suite.txt"; tail -12 "$OUT/cupy/cupy_suite.txt"
  (cd "$OUT" && tar czf conformance.tgz numba cupy && rm -rf numba cupy)
fi
if [ "$PART" = cupy ]; then
  export PYTHONPATH=/tmp/cc/src:$DEP
  rm -f "$OUT/build.txt"
  CUPY_SUITE_PARALLEL=1 CUPY_SUITE_TIMEOUT=${CUPY_SUITE_TIMEOUT:-420} bash benchmarks/cupy_suite.sh .cupy
  cat "$OUT/diff.txt" 2>/dev/null | head -40
fi
