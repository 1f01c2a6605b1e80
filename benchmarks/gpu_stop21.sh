#!/usr/bin/env bash
# Stop 21's device call (issue 27), from the repo root on the device machine, carrying .whl:
# build; CuPy's paths side by side in one process (lanes on, lanes off); every GPU-marked
# test with the Dask wheels on the path; the frameworks bench. Logs packed into $OUT/all.tgz.
#   PART=1: build, A/B, tests.   PART=2: the frameworks bench (cupy, torch, replay, cuda_core).
#   PART=3: the glue probe, then PART=2 for torch, replay, cuda_core and numba.
#   PART=6: bench sections pair, mixed, routing, traces (goal 6: what is fast today stays fast).
#   PART=4: the GPU-marked CuPy tests, then PART=2 for cupy (four sides: CuPy's pool, graphpool's
#           default C path, its hooks path, RMM's pool).
#   PART=8 (stop 22): benchmarks/cupy_program_diag_gpu.py, each path in its own process, three times.
#   PART=9 (stop 22): the GPU-marked cuda.core tests, then the cuda_core case with two graphpool
#           sides: this tree and this tree with .before/cuda_core.py (the integration before);
#           THEN="case:t:n:r ..." runs PART=2 for those cases afterwards.
#   PART=10 (stop 22): benchmarks/torch_lane_diag_gpu.py in six processes (the lane's misses counted).
#   PART=7 (stop 22): every GPU-marked test, then PART=2 for torch and replay.
#   PART=11 (stop 23): benchmarks/torch_program_probe.py, two rounds of five processes: PyTorch's
#           own allocator, graphpool (lane on), graphpool with the lane off, the hooks counted
#           (the lane's misses), the hooks timed (the miss path's time; nothing parks).
#   NOASLR=1 (stop 22): the frameworks bench's workers run with address-space randomization off.
#   PIN=N (stop 22): the frameworks bench and its workers run on CPU N alone (taskset), so that
#   every side's processes share one core instead of wherever the scheduler puts them.
set -u
FINAL=$OUT; export OUT=/tmp/o; mkdir -p $OUT
export PYTHONUNBUFFERED=1
PART=${PART:-1}
source benchmarks/gpu_env.sh > /dev/null
X=/tmp/extra
if [ ! -d $X/dask ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target $X .whl/dask-*.whl \
    .whl/distributed-*.whl .whl/dask_cuda-*.whl .whl/rmm_cu13-*.whl .whl/librmm_cu13-*.whl \
    .whl/rapids_logger-*.whl .whl/partd-*.whl .whl/locket-*.whl .whl/importlib_metadata-*.whl \
    .whl/tblib-*.whl .whl/tornado-*.whl .whl/zict-*.whl .whl/pynvml-*.whl .whl/nvidia_ml_py-*.whl \
    .whl/toolz-*.whl .whl/cloudpickle-*.whl .whl/filecheck-*.whl > "$OUT/extra_install.txt" 2>&1 || echo "extra install failed"
fi
B=/tmp/cc
if ! ls $B/src/graphpool/policy/allocator*.so >/dev/null 2>&1 || [ "${REBUILD:-0}" = 1 ]; then
  rm -rf $B && mkdir -p $B && cp -r setup.py pyproject.toml README.md LICENSE src tests docs benchmarks $B/
  sed -i 's/^license = "Apache-2.0"/license = { text = "Apache-2.0" }/; /^license-files/d' $B/pyproject.toml
  (cd $B && PYTHONPATH=/tmp/site timeout 200 python3 setup.py -q build_ext --inplace > "$OUT/build.txt" 2>&1)
fi
echo "compiled modules: $(find $B/src -name '*.so' | wc -l)" | tee -a "$OUT/env.txt"
export GRAPHPOOL_BACKEND=cuda
pack() { tar czf $FINAL/all.tgz -C $OUT . ; }
lscpu > $OUT/lscpu.txt 2>&1; grep -E "^Model name|^CPU\(s\)|^Thread|^NUMA node\(s\)" $OUT/lscpu.txt
PINCMD=""; if [ -n "${PIN:-}" ]; then PINCMD="taskset -c $PIN"; echo "pinned to CPU $PIN" | tee -a "$OUT/env.txt"; fi
if [ "$PART" = 1 ]; then
  PYTHONPATH=$B/src:$DEP timeout 120 python3 benchmarks/cupy_paths_ab_gpu.py --rounds 7 --number 20000 \
    --json $OUT/ab_lanes_on.json > $OUT/ab_lanes_on.txt 2>&1; grep -v "^round" $OUT/ab_lanes_on.txt; pack
  GRAPHPOOL_LANE=0 PYTHONPATH=$B/src:$DEP timeout 120 python3 benchmarks/cupy_paths_ab_gpu.py --rounds 7 --number 20000 \
    --json $OUT/ab_lanes_off.json > $OUT/ab_lanes_off.txt 2>&1; grep -v "^round" $OUT/ab_lanes_off.txt; pack
  (cd $B && PYTHONPATH=$B/src:$DEP:$X timeout ${TEST_T:-240} python3 -m pytest -q -m gpu -p no:cacheprovider tests > "$OUT/pytest_gpu.txt" 2>&1)
  tail -2 "$OUT/pytest_gpu.txt"; grep -E "^(FAILED|ERROR)" "$OUT/pytest_gpu.txt" | head; pack
elif [ "$PART" = 4 ]; then
  (cd $B && PYTHONPATH=$B/src:$DEP:$X timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/test_integrations_cupy.py tests/test_twin_cupy.py > "$OUT/pytest_cupy.txt" 2>&1)
  tail -1 "$OUT/pytest_cupy.txt"; grep -E "^(FAILED|ERROR)" "$OUT/pytest_cupy.txt" | head; pack
  CASES=${CASES:-"cupy:330:2000:3"} PART=2 FINAL=$FINAL OUT=$FINAL bash $0
elif [ "$PART" = 7 ]; then
  (cd $B && PYTHONPATH=$B/src:$DEP:$X timeout ${TEST_T:-240} python3 -m pytest -q -m gpu -p no:cacheprovider tests > "$OUT/pytest_gpu.txt" 2>&1)
  tail -2 "$OUT/pytest_gpu.txt"; grep -E "^(FAILED|ERROR)" "$OUT/pytest_gpu.txt" | head; pack
  CASES=${CASES:-"torch:110:1500:3 replay:70:1000:3"} PART=2 FINAL=$FINAL OUT=$FINAL bash $0
elif [ "$PART" = 8 ]; then
  for rep in 1 2 3; do for mode in pool hooks c c-nolane; do
    L=1; m=$mode; if [ $mode = c-nolane ]; then L=0; m=c; fi
    echo "== rep $rep $mode"
    GRAPHPOOL_LANE=$L PYTHONPATH=$B/src:$DEP timeout 60 $PINCMD python3 benchmarks/cupy_program_diag_gpu.py $m
  done; done > $OUT/program_diag.txt 2>&1; grep -E "^==|^mode|program:" $OUT/program_diag.txt; pack
elif [ "$PART" = 9 ]; then
  (cd $B && PYTHONPATH=$B/src:$DEP:$X timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/test_integrations_cuda_core.py tests/test_foreign_streams.py > "$OUT/pytest_cuda_core.txt" 2>&1)
  tail -1 "$OUT/pytest_cuda_core.txt"; grep -E "^(FAILED|ERROR)" "$OUT/pytest_cuda_core.txt" | head; pack
  rm -rf /tmp/before_src && cp -r $B/src /tmp/before_src && cp .before/cuda_core.py /tmp/before_src/graphpool/
  PYTHONPATH=$B/src:$DEP timeout 150 $PINCMD python3 src/graphpool/tools/frameworks_bench.py --case cuda_core ${NOASLR:+--no-aslr} \
    --tree after=$B/src --tree before=/tmp/before_src --processes ${PROCS:-8} --number 1000 --rounds 3 \
    --json $OUT/fw_cuda_core_ab.json > $OUT/fw_cuda_core_ab.txt 2>&1; cat $OUT/fw_cuda_core_ab.txt; pack
  if [ -n "${THEN:-}" ]; then CASES="$THEN" PART=2 FINAL=$FINAL OUT=$FINAL bash $0; fi
elif [ "$PART" = 11 ]; then
  for round in 1 2; do
    for mode in PROBE_NATIVE=1 PROBE_UNTIMED=1 "PROBE_UNTIMED=1 GRAPHPOOL_LANE=0" PROBE_COUNT=1 PROBE_TIMED=1; do
      env $mode PYTHONPATH=$B/src:$DEP timeout 60 $PINCMD python3 benchmarks/torch_program_probe.py "round $round" \
        >> $OUT/torch_program_probe.jsonl 2>> $OUT/torch_program_probe.err
    done
  done; cat $OUT/torch_program_probe.jsonl; tail -3 $OUT/torch_program_probe.err; pack
elif [ "$PART" = 10 ]; then
  for rep in 1 2 3 4 5 6; do echo "== process $rep"
    PYTHONPATH=$B/src:$DEP timeout 60 $PINCMD python3 benchmarks/torch_lane_diag_gpu.py
  done > $OUT/torch_lane_diag.txt 2>&1; cat $OUT/torch_lane_diag.txt; pack
elif [ "$PART" = 5 ]; then
  for v in "" "--count" "--ab" "--ab --count"; do
    echo "== cupy_lane_diag_gpu.py $v"
    PYTHONPATH=$B/src:$DEP timeout 60 python3 benchmarks/cupy_lane_diag_gpu.py $v 2>&1 | tail -8
  done | tee $OUT/lane_diag.txt; pack
elif [ "$PART" = 6 ]; then
  PYTHONPATH=$B/src:$DEP timeout ${SECT_T:-150} python3 benchmarks/bench_sections.py --backend cuda \
    --sections pair,mixed,routing,traces --repeat ${REPEAT:-5} --json $OUT/sections.json > $OUT/sections.txt 2>&1
  grep -vE "^\s*$" $OUT/sections.txt | tail -60; pack
elif [ "$PART" = 3 ]; then
  GRAPHPOOL_LANE=0 PYTHONPATH=$B/src:$DEP timeout 90 python3 benchmarks/cupy_glue_probe_gpu.py > $OUT/glue_lanes_off.txt 2>&1
  cat $OUT/glue_lanes_off.txt; pack
  PYTHONPATH=$B/src:$DEP timeout 90 python3 benchmarks/cupy_glue_probe_gpu.py > $OUT/glue_lanes_on.txt 2>&1
  grep -E "glue|C -" $OUT/glue_lanes_on.txt; pack
  CASES=${CASES:-"torch:110:1500:3 replay:70:1000:3 cuda_core:60:1000:3 numba:60:1000:3"} PART=2 FINAL=$FINAL OUT=$FINAL bash $0
else
  for spec in ${CASES:-"cupy:200:2000:3" "torch:110:1500:3" "replay:70:1000:3" "cuda_core:60:1000:3"}; do
    IFS=: read case t n r <<< "$spec"
    PYTHONPATH=$B/src:$DEP${XP-:$X} timeout $t $PINCMD python3 src/graphpool/tools/frameworks_bench.py --case $case ${NOASLR:+--no-aslr} \
      --processes ${PROCS:-3} --number $n --rounds $r --json $OUT/fw_$case.json > $OUT/fw_$case.txt 2>&1 || echo "$case: exit $?"
    grep -E "program|median|x$" $OUT/fw_$case.txt | grep -v "(min)" | head -60; pack
  done
fi
