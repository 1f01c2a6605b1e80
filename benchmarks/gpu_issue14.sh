#!/usr/bin/env bash
# issue 14 on a GPU host: the whole suite (the GPU-skip guard active), the twins beside the
# real frameworks, and the benchmarks (quick, then full) with their table and JSON.
# Not run yet: the device machine runs /work/main's tree, not this branch. From the repo root:
#   OUT=/tmp/out bash benchmarks/gpu_issue14.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ nvidia-smi -L; python3 -c 'import sys, numpy; print(sys.version.split()[0], numpy.__version__)'
  python3 -c 'from importlib.metadata import version as v
for p in ("cupy-cuda12x","cupy-cuda13x","cuda-bindings","cuda-core","torch","numba-cuda","fastrlock","hypothesis","pytest"):
    try: print(p, v(p))
    except Exception as e: print(p, "-")'
  python3 -c 'from graphpool.device import cuda; print("unavailable_reason:", cuda.unavailable_reason())'
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
timeout 330 python3 -m pytest -q -p no:cacheprovider -rsfEx > "$OUT/pytest.txt" 2>&1; tail -25 "$OUT/pytest.txt"
timeout 60 python3 -m graphpool bench --quick > "$OUT/bench_quick.txt" 2>&1; tail -5 "$OUT/bench_quick.txt"
timeout 180 python3 -m graphpool bench --json "$OUT/bench.json" > "$OUT/bench_table.txt" 2> "$OUT/bench_stderr.txt"; cat "$OUT/bench_table.txt"
