#!/usr/bin/env bash
# Issue 27 on the GPU, one device call: build graphpool before (.wt-base: main at 31888b3) and
# after (.wt-speed: this tree) as an install does, run the GPU tests of the integrations this
# work touched (after), then the frameworks bench (graphpool.tools.frameworks_bench) with both
# trees as sides, worker processes alternating. Run from the root of the checkout that
# carries .whl (the build's mypy, fastrlock, rmm), .wt-speed and .wt-base; logs under $OUT.
#   SKIP_TESTS=1  skip the tests;  CASES="cupy torch"  run only these bench cases
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source .wt-speed/benchmarks/gpu_env.sh  # $DEP, the build's mypy in /tmp/site, $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --target /tmp/rmm .whl/rmm_cu13-*.whl \
  .whl/librmm_cu13-*.whl .whl/rapids_logger-*.whl >/dev/null 2>&1 || echo "rmm: not installed"
build() {  # $1: tree, $2: where to build it
  rm -rf "$2" && mkdir -p "$2"
  cp -r "$1"/setup.py "$1"/pyproject.toml "$1"/README.md "$1"/LICENSE "$1"/src "$1"/tests "$1"/docs "$2"/
  sed -i 's/^license = "Apache-2.0"/license = { text = "Apache-2.0" }/; /^license-files/d' "$2"/pyproject.toml
  (cd "$2" && PYTHONPATH=/tmp/site timeout 240 python3 setup.py -q build_ext --inplace \
    >"$OUT/build_$(basename "$2").txt" 2>&1)
  echo "$(basename "$2"): $(find "$2"/src -name '*.so' | wc -l) compiled modules" | tee -a "$OUT/build_$(basename "$2").txt"
}
build .wt-speed /tmp/after & build .wt-base /tmp/before & wait
export GRAPHPOOL_BACKEND=cuda
PYTHONPATH=/tmp/after/src:$DEP python3 -c 'import graphpool as gp, graphpool.hooks as h; print("after compiled:", gp.compiled(), h.__file__.endswith(".so"))' | tee -a "$OUT/env.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
  (cd /tmp/after && PYTHONPATH=/tmp/after/src:$DEP timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rs \
    tests/test_integrations_cupy.py tests/test_integrations_torch.py tests/test_twin_cupy_capture.py \
    tests/scenarios/test_replay_checker.py tests/test_integrations_graphed.py >"$OUT/pytest_gpu.txt" 2>&1)
  tail -3 "$OUT/pytest_gpu.txt"
fi
BENCH=.wt-speed/src/graphpool/tools/frameworks_bench.py
for case in ${CASES:-cupy torch replay numba cuda_core}; do
  PYTHONPATH=/tmp/after/src:$DEP:/tmp/rmm timeout 200 python3 $BENCH --case "$case" \
    --tree after=/tmp/after/src --tree before=/tmp/before/src --processes "${PROCS:-2}" \
    --number "${NUMBER:-2000}" --rounds "${ROUNDS:-4}" --json "$OUT/fw_$case.json" \
    >"$OUT/fw_$case.txt" 2>&1 || echo "$case: exit $?"
done
python3 - "$OUT" <<'EOF'
import glob, json, sys
for path in sorted(glob.glob(sys.argv[1] + "/fw_*.json")):
    data = json.load(open(path))
    for case, d in data.items():
        if case == "skipped":
            continue
        for k, row in d["rows"].items():
            med = "  ".join(f"{s}={row[s + ' median (us)']:.2f}" for s in d["sides"] if s + " median (us)" in row)
            rat = "  ".join(f"{c.split(' (')[0]}={v:.2f}x" for c, v in row.items() if "(us)" not in c and "(median)" in c)
            print(f"{case} | {k} | {med} | {rat}")
        for s, e in d["errors"].items():
            print(f"{case} | {s} FAILED: {e}")
EOF
