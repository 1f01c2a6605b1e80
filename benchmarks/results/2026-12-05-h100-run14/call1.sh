set -u
FINAL=$OUT; export OUT=/tmp/o; mkdir -p $OUT
export PYTHONUNBUFFERED=1
source benchmarks/gpu_env.sh > /dev/null
B=/tmp/cc
rm -rf $B && mkdir -p $B && cp -r setup.py pyproject.toml README.md LICENSE src tests docs $B/
sed -i 's/^license = "Apache-2.0"/license = { text = "Apache-2.0" }/; /^license-files/d' $B/pyproject.toml
(cd $B && PYTHONPATH=/tmp/site timeout 200 python3 setup.py -q build_ext --inplace > "$OUT/build.txt" 2>&1)
echo "compiled modules: $(find $B/src -name '*.so' | wc -l)" | tee -a "$OUT/env.txt"
export GRAPHPOOL_BACKEND=cuda
sed -n '/^PYTHONPATH=\$B\/src:\$DEP timeout 40 python3 - /,/^PY$/p' benchmarks/gpu_stop19.sh > /tmp/cpath.sh
B=$B DEP=$DEP OUT=$OUT bash /tmp/cpath.sh; cat $OUT/cpath.txt
pack() { tar czf $FINAL/all.tgz -C $OUT . ; }
pack
rm -rf /tmp/old && cp -r $B/src /tmp/old && cp gpu_extra/cuda_core_before.py /tmp/old/graphpool/cuda_core.py
for spec in "cupy:130:--tree after=$B/src" "replay:70:--tree after=$B/src" "cuda_core:60:--tree after=$B/src --tree before=/tmp/old"; do
  case=${spec%%:*}; rest=${spec#*:}; t=${rest%%:*}; trees=${rest#*:}
  PYTHONPATH=$B/src:$DEP timeout $t python3 src/graphpool/tools/frameworks_bench.py --case $case $trees \
    --processes 2 --number 1000 --rounds 3 --json $OUT/fw_$case.json > $OUT/fw_$case.txt 2>&1 || echo "$case: exit $?"
  grep -E "median|x$" $OUT/fw_$case.txt | head -60; pack
done
(cd $B && PYTHONPATH=$B/src:$DEP timeout 80 python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/test_integrations_cupy.py tests/test_twin_cupy_capture.py tests/scenarios/test_replay_plans.py \
  tests/scenarios/test_replay_checker.py tests/test_integrations_cuda_core.py tests/test_integrations_torch.py > "$OUT/pytest_gpu_part.txt" 2>&1)
tail -2 "$OUT/pytest_gpu_part.txt"; grep -E "^(FAILED|ERROR)" "$OUT/pytest_gpu_part.txt" | head; pack
