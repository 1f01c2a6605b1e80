#!/usr/bin/env bash
# The H200 runs of stop 17 (issue 27), in two device calls from the repo root; carry .whl and
# .wt-base (`git archive 31888b3`, the tree before the split and the boundary work, as in stop
# 16). Logs under $OUT.
#   PART=1 bash benchmarks/gpu_stop17.sh  # build both trees; the GPU-marked tests (the PyTorch
#                                         # probe's forwarded calls among them); the replay case
#   PART=2 bash benchmarks/gpu_stop17.sh  # the frameworks bench's cupy and torch cases, this
#                                         # tree beside the base and the frameworks' own pools
# A warm machine keeps /tmp/cc and /tmp/cb between the calls; a cold one builds again.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PART=${PART:-1}
source benchmarks/gpu_env.sh  # $DEP, the build's mypy in /tmp/site, $OUT/env.txt
X=/tmp/extra  # RMM (the bench's third side), Dask (the README's Dask example) and their needs
if [ ! -d $X/dask ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target $X .whl/dask-*.whl \
    .whl/distributed-*.whl .whl/dask_cuda-*.whl .whl/rmm_cu13-*.whl .whl/librmm_cu13-*.whl \
    .whl/rapids_logger-*.whl .whl/partd-*.whl .whl/locket-*.whl .whl/importlib_metadata-*.whl \
    .whl/tblib-*.whl .whl/tornado-*.whl .whl/zict-*.whl .whl/pynvml-*.whl .whl/filecheck-*.whl \
    > "$OUT/extra_install.txt" 2>&1 || echo "extra install failed: $(tail -2 "$OUT/extra_install.txt")"
fi
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

frameworks() {  # the named cases, this tree ("after") beside the base ("before")
  export GRAPHPOOL_BACKEND=cuda
  for case in "$@"; do
    PYTHONPATH=/tmp/cc/src:$DEP:$X timeout ${CASE_TIMEOUT:-170} python3 src/graphpool/tools/frameworks_bench.py \
      --case "$case" --tree after=/tmp/cc/src --tree before=/tmp/cb/src --processes "${PROCS:-2}" \
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
            rat = " ".join(f"{c}={v:.2f}" for c, v in row.items() if "(us)" not in c)
            print(f"{case}|{k}|{med}|{rat}")
        for s, e in d["errors"].items():
            print(f"{case}|{s} FAILED: {e}")
EOF
}

if [ "$PART" = 1 ]; then
  (cd /tmp/cc && PYTHONPATH=/tmp/cc/src:$DEP:$X timeout 300 python3 -m pytest -q -m gpu \
    -p no:cacheprovider -rs > "$OUT/pytest_gpu.txt" 2>&1)
  tail -4 "$OUT/pytest_gpu.txt"; grep -E "^(FAILED|ERROR)" "$OUT/pytest_gpu.txt" | head -30 | cut -c1-300
  # the torch probe's own output, for the record
  (cd /tmp/cc && PYTHONPATH=/tmp/cc/src:$DEP:$X timeout 120 python3 tests/torch_probe.py > "$OUT/torch_probe.json" 2> "$OUT/torch_probe.err")
  tail -c 1500 "$OUT/torch_probe.json"
  frameworks replay
fi
if [ "$PART" = 2 ]; then
  frameworks ${CASES:-cupy torch}
fi
ls "$OUT"
if [ "$PART" = 3 ]; then  # the PyTorch programs, where their time goes (torch_program_probe.py)
  (cd /tmp/cc && PYTHONPATH=/tmp/cc/src:$DEP:$X timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/test_integrations_torch.py tests/scenarios/test_replay_checker.py > "$OUT/pytest_torch.txt" 2>&1)
  tail -3 "$OUT/pytest_torch.txt"
  for round in 1 2; do
    for t in cc cb; do
      for mode in "" PROBE_GC_OFF=1 PROBE_UNTIMED=1; do
        env $mode PYTHONPATH=/tmp/$t/src:$DEP timeout 100 python3 benchmarks/torch_program_probe.py "$t $mode" \
          >> "$OUT/torch_program_probe.jsonl" 2>> "$OUT/torch_program_probe.err"
      done
    done
  done
  cat "$OUT/torch_program_probe.jsonl"
fi
if [ "$PART" = 4 ]; then  # the final tree: every GPU-marked test, then the frameworks cases named
  (cd /tmp/cc && PYTHONPATH=/tmp/cc/src:$DEP:$X timeout 300 python3 -m pytest -q -m gpu \
    -p no:cacheprovider -rs > "$OUT/pytest_gpu.txt" 2>&1)
  tail -4 "$OUT/pytest_gpu.txt"; grep -E "^(FAILED|ERROR)" "$OUT/pytest_gpu.txt" | head -30 | cut -c1-300
  frameworks ${CASES:-replay numba cuda_core}
fi
