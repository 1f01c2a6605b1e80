#!/usr/bin/env bash
# Expandable segments on the H200 in one device call (issue 11): build this tree and .baseline/
# (the tree before the change, `git archive`) as an install does, side by side; the GPU-marked
# tests on this tree; then the bench's trace section (graphpool, its policy with the option off
# and on, CuPy, PyTorch with and without expandable segments, cudaMallocAsync) for both builds
# in alternating processes. Run from the repo root there with .whl (mypy 2.4.1 and its needs,
# fastrlock) and .baseline carried:  ROUNDS="1 2" bash benchmarks/gpu_issue11.sh
# Without .baseline only this tree is built and replayed; FC=1 adds the foreign-capture figures.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/gpu_env.sh  # $DEP, the build's mypy in /tmp/site, $OUT/env.txt
rm -rf /tmp/cc /tmp/cb && mkdir /tmp/cc && cp -r setup.py pyproject.toml README.md LICENSE src tests /tmp/cc/
TREES=cc
if [ -d .baseline ]; then
  TREES="cc cb"
  cp -r .baseline /tmp/cb && mkdir -p /tmp/cb/src/graphpool/tools && cp -r src/graphpool/tools/. /tmp/cb/src/graphpool/tools/
fi
for d in $TREES; do
  (cd /tmp/$d && PYTHONPATH=/tmp/site timeout 300 python3 setup.py -q build_ext --inplace > "$OUT/build_$d.txt" 2>&1) &
done
wait
for d in $TREES; do echo "$d: $(find /tmp/$d/src -name '*.so' | wc -l) compiled modules"; done | tee -a "$OUT/env.txt"
export PYTHONPATH=/tmp/cc/src:$DEP
python3 -c 'import graphpool as gp; from graphpool.device import cuda; gp.set_backend("cuda"); print("graphpool compiled:", gp.compiled(), gp.__file__, "| native capture module:", cuda.native_missing or "loaded")' | tee -a "$OUT/env.txt"
(cd /tmp/cc && timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider -rs -m gpu 2>&1) > "$OUT/pytest_compiled.txt"
tail -3 "$OUT/pytest_compiled.txt"
if [ "${FC:-0}" = 1 ]; then
  timeout 150 python3 benchmarks/foreign_captures_gpu.py --json "$OUT/foreign_captures.json" > "$OUT/foreign_captures.txt" 2>&1
  tail -8 "$OUT/foreign_captures.txt" | cut -c1-300
fi
for round in ${ROUNDS:-1 2}; do
  for d in $TREES; do
    PYTHONPATH=/tmp/$d/src:$DEP timeout 150 python3 benchmarks/bench_sections.py --backend cuda \
      --sections traces --repeat ${REPEAT:-9} --json "$OUT/traces_${d}_$round.json" > "$OUT/traces_${d}_$round.txt" 2>&1
    echo "== $d round $round"; grep -E 'expandable peak reserved/peak live|torch expandable peak|cudaMallocAsync peak reserved/peak|expandable/policy time, warm' "$OUT/traces_${d}_$round.txt"
  done
done
(cd "$OUT" && tar czf traces.tgz traces_*.txt traces_*.json build_*.txt && rm -f traces_*.txt traces_*.json build_*.txt)
