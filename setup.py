"""Build hook: with GRAPHPOOL_COMPILE=1 the allocator policy is compiled by mypyc.

The policy is plain, fully typed Python and runs as is; compiling it is optional and
only changes speed (benchmarks/results/ records both). Needs mypy and a C compiler:
``GRAPHPOOL_COMPILE=1 pip install --no-build-isolation .`` with mypy installed.
"""

from __future__ import annotations

import os

from setuptools import setup

POLICY = ["block", "freelist", "pools", "stats", "private_pools", "allocator"]

ext_modules = []
if os.environ.get("GRAPHPOOL_COMPILE") == "1":
    from mypyc.build import mypycify

    ext_modules = mypycify([f"src/graphpool/policy/{m}.py" for m in POLICY], opt_level="3")

setup(ext_modules=ext_modules)
