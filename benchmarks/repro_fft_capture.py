"""Reproduce a crash seen in CuPy's test_graph.py::test_capture_run_on_same_stream[True] with
graphpool as CuPy's allocator. Usage: python3 repro_fft_capture.py MODE  (MODE: full | nohook |
nodetect | cupypool | helperN). Prints OK or dies; run each in its own process."""

# ruff: noqa: E402  (faulthandler must be on before CuPy loads)
import faulthandler
import sys

faulthandler.enable()
import cupy
from cupy import testing

import graphpool as gp
import graphpool.cupy as gcupy

mode = sys.argv[1]
gp.set_backend("cuda")
if mode != "cupypool":
    gcupy.install()
if mode == "nohook":
    gcupy._unhook()
if mode == "nodetect":
    gp.set_capture_detection(False)


def h1(a):
    a = a + 3
    a = a * 7.6
    return a**2


def h2(a):
    a = 3 * cupy.sin(a)
    return cupy.sqrt(a)


def h3(a):
    a = a * cupy.fft.fft(a)
    return cupy.fft.ifft(a)


helpers = [h1, h2, h3]
if mode.startswith("helper"):
    helpers = [helpers[int(mode[-1]) - 1]]
s = cupy.cuda.Stream(non_blocking=True)
a = cupy.random.random((100,))
cupy.cuda.get_current_stream().synchronize()
for func in helpers:
    with s:
        s.begin_capture()
        out1 = func(a)
        g = s.end_capture()
        print(mode, func.__name__, "captured", flush=True)
        g.upload()
        print(mode, func.__name__, "uploaded", flush=True)
        g.launch()
    s.synchronize()
    out2 = func(a)
    testing.assert_array_equal(out1, out2)
    print(mode, func.__name__, "ok", flush=True)
del g
import gc

gc.collect()
gp.memory_stats()
gp.check_invariants()
print(mode, "OK", flush=True)
