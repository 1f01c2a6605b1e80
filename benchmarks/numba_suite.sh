#!/usr/bin/env bash
# numba-cuda's own driver tests, twice: with Numba's memory manager, then with graphpool's
# (NUMBA_CUDA_MEMORY_MANAGER=graphpool.numba), and the failure sets compared.
#
#   benchmarks/numba_suite.sh                   (results in $OUT, default ./numba_suite_out)
#
# Needs: a GPU, numba-cuda (its tests ship inside the package: numba.cuda.tests), pytest,
# filecheck (numba-cuda's test helpers import it; put its wheel on PYTHONPATH where it is not
# installed) and graphpool. No network. Writes to $OUT:
#   numba_own.xml, graphpool.xml       junit XML of each run
#   numba_own.log, graphpool.log       pytest's output (last line: the summary)
#   diff.txt                           the failure sets compared (cupy_suite/diff_failures.py)
#   env.txt                            versions
# Exit status: 0 when no test fails only with graphpool, 1 otherwise, 2 on a setup error.
#
# Environment: PYTHON (default python3), NUMBA_SUITE (the test package, default
# numba.cuda.tests.cudadrv), NUMBA_PYTEST_ARGS (extra pytest arguments, e.g. "-n 4"),
# NUMBA_SUITE_TIMEOUT (seconds per run, default 900), NUMBA_SUITE_PARALLEL=1 (both runs at
# once, as two processes on the one GPU).
set -uo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
PY="${PYTHON:-python3}"
OUT="${OUT:-$PWD/numba_suite_out}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
TIMEOUT="${NUMBA_SUITE_TIMEOUT:-900}"
SUITE="${NUMBA_SUITE:-numba.cuda.tests.cudadrv}"
SCRATCH="$(mktemp -d)"  # an empty working folder: nothing of this checkout on sys.path by accident
trap 'rm -rf "$SCRATCH"' EXIT
cd "$SCRATCH" || exit 2

"$PY" - > "$OUT/env.txt" 2>&1 <<'EOF'
import os, sys
from importlib.metadata import version
import graphpool, numba.cuda, pytest, filecheck  # noqa: F401
print("python", sys.version.split()[0], "numba-cuda", version("numba-cuda"), "pytest", pytest.__version__)
print("graphpool", graphpool.__version__, "compiled" if graphpool.compiled() else "plain Python",
      "from", os.path.dirname(graphpool.__file__))
print("gpu", numba.cuda.get_current_device().name)
EOF
status=$?
cat "$OUT/env.txt"
if [ $status -ne 0 ]; then
    echo "numba_suite.sh: setup check failed (see $OUT/env.txt)" >&2
    exit 2
fi

run() {  # run NAME [VAR=value ...]: the suite in a fresh process with those variables set
    local name="$1"; shift
    # shellcheck disable=SC2086  # NUMBA_PYTEST_ARGS is split on purpose
    # importlib mode: numba-cuda installs its tests under numba_cuda/numba (a redirected path),
    # where pytest's default mode derives a wrong package name and collects nothing
    # numba_suite_plugin: the fixture and option of numba-cuda's repository conftest (not installed)
    timeout -s INT -k 60 "$TIMEOUT" env PYTHONPATH="$HERE/numba_suite${PYTHONPATH:+:$PYTHONPATH}" "$@" \
        "$PY" -m pytest -p no:cacheprovider -p numba_suite_plugin -q -rN --import-mode=importlib \
        --junitxml "$OUT/$name.xml" ${NUMBA_PYTEST_ARGS:-} --pyargs $SUITE > "$OUT/$name.log" 2>&1
    echo "$name: pytest exit $? -- $(tail -n 1 "$OUT/$name.log")"
}

if [ "${NUMBA_SUITE_PARALLEL:-0}" = 1 ]; then
    run numba_own GRAPHPOOL_UNUSED=1 &
    run graphpool NUMBA_CUDA_MEMORY_MANAGER=graphpool.numba GRAPHPOOL_BACKEND=cuda &
    wait
else
    run numba_own GRAPHPOOL_UNUSED=1
    run graphpool NUMBA_CUDA_MEMORY_MANAGER=graphpool.numba GRAPHPOOL_BACKEND=cuda
fi
BASELINE_NAME="Numba's memory manager" "$PY" "$HERE/cupy_suite/diff_failures.py" "$OUT/numba_own.xml" "$OUT/graphpool.xml" "$OUT/diff.txt"
