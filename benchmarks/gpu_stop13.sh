#!/usr/bin/env bash
# One device call for the capture-rule and robustness fixes (issues 24, 25, 28): build as an
# install does, the GPU-marked tests, the CUDA reproducers, the protection figures of
# foreign_captures_gpu.py and the interrupt stress on CUDA. Run from the repo root on the GPU
# machine with `.whl` (the build's mypy, fastrlock) and `.repro` (a copy of the reproducers)
# carried; every log lands under $OUT.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
ROOT=$(pwd)
source benchmarks/gpu_env.sh  # $DEP, the build's mypy in /tmp/site, $OUT/env.txt
rm -rf /tmp/cc && mkdir /tmp/cc && cp -r setup.py pyproject.toml README.md LICENSE src tests docs /tmp/cc/
sed -i 's/^license = "Apache-2.0"/license = { text = "Apache-2.0" }/; /^license-files/d' /tmp/cc/pyproject.toml
(cd /tmp/cc && PYTHONPATH=/tmp/site timeout 300 python3 setup.py -q build_ext --inplace > "$OUT/build.txt" 2>&1)
find /tmp/cc/src -name '*.so' | wc -l | sed 's/^/compiled modules: /' | tee -a "$OUT/build.txt"
export PYTHONPATH=/tmp/cc/src:$DEP GRAPHPOOL_BACKEND=cuda
python3 -c 'import graphpool as gp; print("graphpool compiled:", gp.compiled())' | tee -a "$OUT/env.txt"
(cd /tmp/cc && timeout "${TEST_TIMEOUT:-280}" python3 -m pytest -q -m gpu -p no:cacheprovider -rs \
  ${PYTEST_ARGS:-} tests > "$OUT/pytest_gpu.txt" 2>&1); tail -4 "$OUT/pytest_gpu.txt"
{
  echo "== other_stream_capture_cupy.py"; timeout 60 python3 .repro/2026-12-01/gpu/other_stream_capture_cupy.py 2>&1 | tail -3
  echo "== foreign_captures_gpu.py"; timeout 120 python3 benchmarks/foreign_captures_gpu.py 2>&1 | tail -25
} > "$OUT/protection.txt" 2>&1; cat "$OUT/protection.txt"
{
  for m in "guarded" "guarded empty_cache no_rs"; do
    echo "== interrupt_min.py $m"; timeout 40 python3 .repro/2026-12-01/usage/interrupt_min.py $m 2>&1 | tail -4
  done
  echo "== interrupt_usage_stress.py --seconds 3"
  timeout 150 python3 benchmarks/interrupt_usage_stress.py --seconds 3 2>&1 | tail -30
} > "$OUT/interrupts.txt" 2>&1; tail -45 "$OUT/interrupts.txt"
