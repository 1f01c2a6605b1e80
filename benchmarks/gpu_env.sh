# Sourced by the GPU scripts (gpu_run.sh, gpu_issue11.sh) on the device machine, from the repo
# root: the carried wheels installed (fastrlock into $DEP if the image lacks it, mypy 2.4.1 and
# its needs into /tmp/site for the build) and the machine's versions written to $OUT/env.txt.
DEP=/tmp/dep   # runtime dependency missing from the image, if any
if ! python3 -c 'import fastrlock' 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target "$DEP" .whl/fastrlock-*.whl >/dev/null 2>&1
fi
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/mypy-*.whl .whl/librt-*.whl \
  .whl/ast_serialize-*.whl .whl/pathspec-*.whl .whl/mypy_extensions-*.whl >/dev/null 2>&1
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  PYTHONPATH=$DEP python3 -c 'import sys, cupy, numpy, fastrlock, setuptools; print("python", sys.version.split()[0], "cupy", cupy.__version__, "numpy", numpy.__version__, "fastrlock", fastrlock.__version__, "setuptools", setuptools.__version__)'
  python3 -c 'from importlib.metadata import version as v; print("cuda-bindings", v("cuda-bindings"), "cuda-core", v("cuda-core"), "torch", v("torch"), "numba-cuda", v("numba-cuda"))'
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
