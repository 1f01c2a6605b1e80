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
pack() { tar czf $FINAL/all.tgz -C $OUT . ; }
(cd $B && PYTHONPATH=$B/src:$DEP timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests > "$OUT/pytest_gpu.txt" 2>&1)
tail -2 "$OUT/pytest_gpu.txt"; grep -E "^(FAILED|ERROR)" "$OUT/pytest_gpu.txt" | head; pack
for spec in "cupy:150:10000:5" "torch:110:1500:3"; do
  IFS=: read case t n r <<< "$spec"
  PYTHONPATH=$B/src:$DEP timeout $t python3 src/graphpool/tools/frameworks_bench.py --case $case --tree after=$B/src \
    --processes 2 --number $n --rounds $r --json $OUT/fw_$case.json > $OUT/fw_$case.txt 2>&1 || echo "$case: exit $?"
  grep -E "program|median|x$" $OUT/fw_$case.txt | grep -v "(min)" | head -80; pack
done
