"""Build hook: compile the allocator's hot path with mypyc, or ship it as plain Python.

The policy (``graphpool/policy``) and the allocation call with its handle (``memory.py``,
``buffer.py``) are plain, fully typed Python that runs as is. Compiled by mypyc the same
source runs a cached malloc+free about 3.4x faster (benchmarks/NOTES.md), so an install
compiles them when it can: mypy comes from the build requirements, the C compiler from
the machine. Without a compiler, or with ``GRAPHPOOL_COMPILE=0``, the install is pure
Python and behaves identically. ``graphpool.compiled()`` says which one runs;
``graphpool.build.COMPILED`` names the same modules as ``COMPILED`` here (a test checks).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext

COMPILED = [
    "src/graphpool/policy/block.py",
    "src/graphpool/policy/freelist.py",
    "src/graphpool/policy/pools.py",
    "src/graphpool/policy/stats.py",
    "src/graphpool/policy/private_pools.py",
    "src/graphpool/policy/allocator.py",
    "src/graphpool/memory.py",
    "src/graphpool/buffer.py",
]


NATIVE = "src/graphpool/device/_capture"  # the C capture query and user objects (device layer)

RECORD = "src/graphpool/_compiled_sources.json"  # read by graphpool.build.stale()


def _clear_in_tree() -> None:
    """Remove compiled modules an earlier editable install left next to the sources."""
    stems = [path[: -len(".py")] for path in COMPILED] + ["src/graphpool/_native__mypyc", NATIVE]
    for stem in stems:
        for path in glob.glob(f"{stem}.*.so") + glob.glob(f"{stem}.*.pyd"):
            os.remove(path)
    if os.path.exists(RECORD):
        os.remove(RECORD)


def _record_sources() -> None:
    """Compiled modules now sit next to their sources: note what they were built from."""
    digests = {}
    for path in COMPILED:
        with open(path, "rb") as fh:
            name = path.removeprefix("src/graphpool/").removesuffix(".py")
            digests[name] = hashlib.sha256(fh.read()).hexdigest()
    with open(RECORD, "w") as fh:
        json.dump(digests, fh, indent=1, sort_keys=True)


class OptionalBuildExt(build_ext):
    """Build the compiled modules if possible; on any failure keep the pure-Python install.

    All or nothing: the compiled modules share one runtime library, so if any of them
    fails to build the others are removed and every module stays plain Python.
    """

    def run(self) -> None:
        in_tree = self.inplace or self.editable_mode
        try:
            super().run()
            if self.editable_mode:  # `pip install -e`: the source tree is what gets imported
                self.copy_extensions_to_source()
            if in_tree and self.extensions:
                _record_sources()
            return
        except Exception as e:  # no compiler, no headers: the .py files serve
            print(f"graphpool: not compiled ({e}); installing the pure-Python modules", file=sys.stderr)
        _clear_in_tree()
        for ext in self.extensions:
            built = os.path.join(self.build_lib, self.get_ext_filename(ext.name))
            for path in (self.get_ext_fullpath(ext.name), built):
                if os.path.exists(path):
                    os.remove(path)


def _ext_modules() -> list:  # type: ignore[type-arg]
    if os.environ.get("GRAPHPOOL_COMPILE", "1") == "0":
        _clear_in_tree()
        return []
    try:
        from mypyc.build import mypycify

        # The build environment holds mypy only: the modules the compiled ones import (numpy,
        # cuda.bindings, frameworks) are absent there and typed as Any.
        args = ["--ignore-missing-imports", *COMPILED]
        mods = mypycify(args, opt_level="3", group_name="graphpool._native")
    except BaseException as e:  # mypy missing, or it refused the source: stay pure Python
        print(f"graphpool: not compiled ({e!r}); installing the pure-Python modules", file=sys.stderr)
        _clear_in_tree()
        return []
    from setuptools import Extension

    libs = [] if sys.platform == "win32" else ["dl"]
    return [*mods, Extension("graphpool.device._capture", [NATIVE + ".c"], libraries=libs)]


setup(ext_modules=_ext_modules(), cmdclass={"build_ext": OptionalBuildExt})
