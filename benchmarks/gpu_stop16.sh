#!/usr/bin/env bash
# The H200 runs of issues 26, 27, 29 and 30, in two device calls (run from the repo root on the
# device machine; carry .whl and .wt-base, a `git archive` of the tree before the split and the
# boundary work, 31888b3). Logs under $OUT, packed into few files (eight come back at most).
#   PART=1 bash benchmarks/gpu_stop16.sh  # build both trees; the GPU-marked tests; numba-cuda's
#                                         # driver and IPC tests, both managers; the pinned
#                                         # hazard; cooperation; the Dask comparison
#   PART=2 bash benchmarks/gpu_stop16.sh  # the frameworks bench (this tree, the base, the
#                                         # frameworks' pools, RMM) and pair/mixed/trace sections
# A warm machine keeps /tmp/cc and /tmp/cb between the calls; a cold one builds again.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PART=${PART:-1}
source benchmarks/gpu_env.sh  # $DEP, the build's mypy in /tmp/site, $OUT/env.txt
X=/tmp/extra  # dask, distributed, dask-cuda, RMM and their needs the image lacks
if [ ! -d $X/dask ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target $X .whl/dask-*.whl \
    .whl/distributed-*.whl .whl/dask_cuda-*.whl .whl/rmm_cu13-*.whl .whl/librmm_cu13-*.whl \
    .whl/rapids_logger-*.whl .whl/partd-*.whl .whl/locket-*.whl .whl/importlib_metadata-*.whl \
    .whl/tblib-*.whl .whl/tornado-*.whl .whl/zict-*.whl .whl/pynvml-*.whl .whl/filecheck-*.whl \
    > "$OUT/extra_install.txt" 2>&1 || echo "extra install failed: $(tail -2 "$OUT/extra_install.txt")"
fi
PYTHONPATH=$X python3 -c 'import dask, distributed, dask_cuda, rmm; print("dask", dask.__version__, "distributed", distributed.__version__, "dask_cuda", dask_cuda.__version__, "rmm", rmm.__version__)' >> "$OUT/env.txt" 2>&1
build() {  # $1: tree, $2: where to build it (skipped when a build is already there)
  if ls "$2"/src/graphpool/policy/allocator*.so >/dev/null 2>&1; then return; fi
  rm -rf "$2" && mkdir -p "$2"
  cp -r "$1"/setup.py "$1"/pyproject.toml "$1"/README.md "$1"/LICENSE "$1"/src "$1"/tests "$2"/
  [ -d "$1"/docs ] && cp -r "$1"/docs "$2"/
  sed -i 's/^license = "Apache-2.0"/license = { text = "Apache-2.0" }/; /^license-files/d' "$2"/pyproject.toml
  (cd "$2" && PYTHONPATH=/tmp/site timeout 300 python3 setup.py -q build_ext --inplace \
    > "$OUT/build_$(basename "$2").txt" 2>&1)
  echo "$(basename "$2"): $(find "$2"/src -name '*.so' | wc -l) compiled modules" | tee -a "$OUT/env.txt"
}
build . /tmp/cc & build .wt-base /tmp/cb & wait
PYTHONPATH=/tmp/cc/src:$DEP python3 -c 'import graphpool as gp; from graphpool.device import cuda; gp.set_backend("cuda"); print("graphpool compiled:", gp.compiled(), "| native capture module:", cuda.native_missing or "loaded")' | tee -a "$OUT/env.txt"

if [ "$PART" = 1 ]; then
  export PYTHONPATH=/tmp/cc/src:$DEP:$X
  timeout 60 python3 benchmarks/pinned_hazard_gpu.py --json "$OUT/pinned_hazard.json" > "$OUT/pinned_hazard.txt" 2>&1
  tail -12 "$OUT/pinned_hazard.txt"
  timeout 90 python3 benchmarks/cooperate_gpu.py --json "$OUT/cooperate.json" > "$OUT/cooperate.txt" 2>&1
  tail -14 "$OUT/cooperate.txt"
  # the tests and numba-cuda's suites at once (functional; nothing here is timed)
  (cd /tmp/cc && PYTHONPATH=/tmp/cc/src:$DEP:$X timeout 270 python3 -m pytest -q -m gpu \
    -p no:cacheprovider -rs > "$OUT/pytest_gpu.txt" 2>&1) &
  (mkdir -p "$OUT/numba"; PYTHONPATH=/tmp/cc/src:$DEP:$X OUT=$OUT/numba NUMBA_SUITE_PARALLEL=1 \
   NUMBA_SUITE_TIMEOUT=260 NUMBA_PYTEST_ARGS="-n 3" \
   NUMBA_SUITE="numba.cuda.tests.cudadrv numba.cuda.tests.cudapy.test_ipc" \
   bash benchmarks/numba_suite.sh > "$OUT/numba/numba_suite.txt" 2>&1) &
  wait
  tail -4 "$OUT/pytest_gpu.txt"; grep -E "^(FAILED|ERROR)" "$OUT/pytest_gpu.txt" | head -30 | cut -c1-300
  tail -8 "$OUT/numba/numba_suite.txt"
  timeout $(( ${BUDGET:-580} - SECONDS > 30 ? ${BUDGET:-580} - SECONDS : 30 )) python3 benchmarks/dask_gpu.py --repeat 3 --json "$OUT/dask.json" > "$OUT/dask.txt" 2>&1
  tail -20 "$OUT/dask.txt"
  (cd "$OUT" && tar czf part1.tgz numba build_*.txt extra_install.txt pinned_hazard.txt cooperate.txt dask.txt 2>/dev/null \
   && rm -rf numba build_*.txt extra_install.txt pinned_hazard.txt cooperate.txt dask.txt)
fi

if [ "$PART" = 2 ]; then
  export GRAPHPOOL_BACKEND=cuda
  BENCH=src/graphpool/tools/frameworks_bench.py
  for case in ${CASES:-cupy torch replay numba cuda_core}; do
    PYTHONPATH=/tmp/cc/src:$DEP:$X timeout ${CASE_TIMEOUT:-150} python3 $BENCH --case "$case" \
      --tree after=/tmp/cc/src --tree before=/tmp/cb/src --processes "${PROCS:-2}" \
      --number "${NUMBER:-2000}" --rounds "${ROUNDS:-4}" --json "$OUT/fw_$case.json" \
      > "$OUT/fw_$case.txt" 2>&1 || echo "$case: exit $?"
  done
  python3 - "$OUT" <<'EOF'
import glob, json, sys
for path in sorted(glob.glob(sys.argv[1] + "/fw_*.json")):
    data = json.load(open(path))
    for case, d in data.items():
        if case == "skipped":
            print("skipped:", d); continue
        for k, row in d["rows"].items():
            med = " ".join(f"{s}={row[s + ' median (us)']:.2f}" for s in d["sides"] if s + " median (us)" in row)
            rat = " ".join(f"{c.split(' (')[0]}={v:.2f}" for c, v in row.items() if "(us)" not in c and "(median)" in c)
            print(f"{case}|{k}|{med}|{rat}")
        for s, e in d["errors"].items():
            print(f"{case}|{s} FAILED: {e}")
EOF
  rm -rf /tmp/cb/src/graphpool/tools && cp -r /tmp/cc/src/graphpool/tools /tmp/cb/src/graphpool/  # same bench code
  for round in 1 2; do
    for t in cc cb; do
      PYTHONPATH=/tmp/$t/src:$DEP timeout 100 python3 benchmarks/bench_sections.py --backend cuda \
        --sections pair,mixed,traces --repeat ${REPEAT:-7} --json "$OUT/sections_${t}_$round.json" \
        > "$OUT/sections_${t}_$round.txt" 2>&1
      tail -3 "$OUT/sections_${t}_$round.txt"
    done
  done
  (cd "$OUT" && tar czf part2.tgz fw_*.txt fw_*.json sections_* 2>/dev/null && rm -f fw_*.txt fw_*.json sections_*)
fi
ls "$OUT"
