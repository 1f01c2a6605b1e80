#!/usr/bin/env bash
# CuPy's own tests, twice: with CuPy's memory pool, then with graphpool as CuPy's allocator.
#
#   benchmarks/cupy_suite.sh /path/to/cupy-checkout        (results in $OUT, default ./cupy_suite_out)
#
# Needs: a GPU, the installed CuPy (cupy-cuda13x) and graphpool, pytest, and a CuPy source
# checkout of the *same version* as the installed CuPy (its tests/ folder is what runs; the
# installed CuPy is what is tested). No network. Nothing is built or installed.
#
# Runs tests/cupy_tests/{core,creation,manipulation,indexing,math}_tests and
# cuda_tests/test_graph*.py, test_stream.py. Writes to $OUT:
#   cupy_pool.xml, graphpool.xml       junit XML of each run
#   cupy_pool.log, graphpool.log       pytest's output (last lines: the summary)
#   graphpool_stats.json               graphpool's statistics at the end of its run
#   diff.txt                           the failure sets compared (diff_failures.py)
#   env.txt                            versions
# Exit status: 0 when no test fails only with graphpool, 1 otherwise, 2 on a setup error.
#
# Environment: PYTHON (default python3), CUPY_PYTEST_ARGS (extra pytest arguments, e.g.
# "-m 'not slow'" or "-x"), CUPY_SUITE_TIMEOUT (seconds per run, default 3000).
set -uo pipefail

CHECKOUT="${1:?usage: cupy_suite.sh /path/to/cupy-checkout}"
CHECKOUT="$(cd "$CHECKOUT" && pwd)" || exit 2
HERE="$(cd "$(dirname "$0")" && pwd)"
PY="${PYTHON:-python3}"
OUT="${OUT:-$PWD/cupy_suite_out}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
TIMEOUT="${CUPY_SUITE_TIMEOUT:-3000}"

TESTS="$CHECKOUT/tests/cupy_tests"
if [ ! -d "$TESTS" ]; then
    echo "cupy_suite.sh: $TESTS not found: give the root of a CuPy source checkout" >&2
    exit 2
fi
# Run from an empty folder: the checkout's root must not be on sys.path, or `import cupy`
# would find its unbuilt sources instead of the installed CuPy.
SCRATCH="$(mktemp -d)"
trap 'rm -rf "$SCRATCH"' EXIT
cd "$SCRATCH" || exit 2

"$PY" - "$CHECKOUT" > "$OUT/env.txt" 2>&1 <<'EOF'
import os, re, sys
import cupy, graphpool, numpy, pytest
checkout = sys.argv[1]
print("python", sys.version.split()[0])
print("cupy", cupy.__version__, "from", os.path.dirname(cupy.__file__))
print("numpy", numpy.__version__, "pytest", pytest.__version__)
print("graphpool", graphpool.__version__, "compiled" if graphpool.compiled() else "plain Python",
      "from", os.path.dirname(graphpool.__file__))
name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
print("gpu", name.decode() if isinstance(name, bytes) else name, "x", cupy.cuda.runtime.getDeviceCount())
if os.path.realpath(cupy.__file__).startswith(os.path.realpath(checkout) + os.sep):
    sys.exit("the CuPy being imported is the checkout's source, not the installed one")
text = open(os.path.join(checkout, "cupy", "_version.py")).read()
found = re.search(r"""__version__\s*=\s*['"]([^'"]+)['"]""", text)
version = found.group(1) if found else "?"
print("checkout", version)
if version != cupy.__version__:
    print(f"WARNING: the checkout's tests are of CuPy {version}, the installed CuPy is {cupy.__version__}")
EOF
status=$?
cat "$OUT/env.txt"
if [ $status -ne 0 ]; then
    echo "cupy_suite.sh: setup check failed (see $OUT/env.txt)" >&2
    exit 2
fi

PATHS=()
# CUPY_SUITE_PATHS: a subset instead (paths under tests/cupy_tests, space-separated)
for p in ${CUPY_SUITE_PATHS:-core_tests creation_tests manipulation_tests indexing_tests math_tests \
         cuda_tests/test_graph.py cuda_tests/test_graph_functional_api.py cuda_tests/test_stream.py}; do
    if [ -e "$TESTS/$p" ]; then
        PATHS+=("$TESTS/$p")
    else
        echo "cupy_suite.sh: note: $p is not in this checkout; skipped" | tee -a "$OUT/env.txt" >&2
    fi
done


run() {  # run NAME [extra pytest args...]
    local name="$1"; shift
    # shellcheck disable=SC2086  # CUPY_PYTEST_ARGS is split on purpose
    # SIGINT at the limit: pytest stops like on Ctrl-C and still writes its junit XML
    timeout -s INT -k 60 "$TIMEOUT" "$PY" -m pytest -p no:cacheprovider -rN \
        --rootdir "$CHECKOUT/tests" --junitxml "$OUT/$name.xml" \
        ${CUPY_PYTEST_ARGS:-} "$@" "${PATHS[@]}" > "$OUT/$name.log" 2>&1
    echo "$name: pytest exit $? -- $(tail -n 1 "$OUT/$name.log")"
}

rm -f "$OUT/cupy_pool.xml" "$OUT/graphpool.xml" "$OUT"/graphpool_stats.json*
# CUPY_SUITE_PARALLEL=1: both runs at once, as two processes on the one GPU (half the wall time)
if [ "${CUPY_SUITE_PARALLEL:-0}" = 1 ]; then
    run cupy_pool &
    PYTHONPATH="$HERE/cupy_suite${PYTHONPATH:+:$PYTHONPATH}" GRAPHPOOL_CUPY_STATS="$OUT/graphpool_stats.json" \
        run graphpool -p graphpool_cupy_plugin &
    wait
else
    run cupy_pool
    PYTHONPATH="$HERE/cupy_suite${PYTHONPATH:+:$PYTHONPATH}" GRAPHPOOL_CUPY_STATS="$OUT/graphpool_stats.json" \
        run graphpool -p graphpool_cupy_plugin
fi
grep -m1 "as the allocator of CuPy" "$OUT/graphpool.log" || echo "WARNING: the plugin's header line is missing"

"$PY" "$HERE/cupy_suite/sum_stats.py" "$OUT" | tee -a "$OUT/env.txt"
"$PY" "$HERE/cupy_suite/diff_failures.py" "$OUT/cupy_pool.xml" "$OUT/graphpool.xml" "$OUT/diff.txt"
